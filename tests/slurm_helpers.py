"""Real Slurm daemons (Debian's slurmctld, slurmd, munge) on a namespace LAN (tests/netns.py).

One ``munged`` in the machine's own namespace with a key made here serves every namespace (its socket
is a file in a world-executable directory); ``slurmctld`` runs in one namespace host, ``slurmd`` in
others, each with its own host name (``unshare --uts``) and, for slurmd, a private mount namespace
with what it needs inside ``ip netns exec``: a tmpfs on /sys/fs/cgroup with an empty named hierarchy
(slurmd 22.05 always loads a cgroup plugin) and munge's socket at the default path (a configless
slurmd asks it there before it has read ``AuthInfo``).  Facts: /work/shared/NOTES.md, "Slurm".

Every process is started by pid and stopped by pid in :meth:`SlurmLab.close`; every wait is bounded.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import pytest

from fakenvml import FakeGPU, make_gpus
from netns import GpuHost, Lan, Node

SLURM_BINARIES = ("munged", "slurmctld", "slurmd", "srun", "scontrol")


def unavailable() -> str | None:
    """Why the real-Slurm tests cannot run here, or None."""
    for b in SLURM_BINARIES:
        if shutil.which(b) is None and not Path(f"/usr/sbin/{b}").exists():
            return f"{b} is not installed (apt-get install slurmctld slurmd slurm-client munge)"
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    return None


def wait_for(pred: Callable[[], object], timeout: float, what: str | Callable[[], str],
             every: float = 0.2) -> object:
    """``pred()`` once it is true; TimeoutError after ``timeout`` s, saying ``what`` (a callable is
    asked then: logs as they are at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what() if callable(what) else what}")
        time.sleep(every)


BASE_CONF = """\
ClusterName=gpusdtest
SlurmctldHost={ctl_name}({ctl_ip})
SlurmctldPort={ctl_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={work}/ctl-state
SlurmdSpoolDir={work}/spool-%h
SlurmctldPidFile={work}/slurmctld.pid
SlurmdPidFile={work}/slurmd-%h.pid
SlurmctldLogFile={work}/slurmctld.log
SlurmdLogFile={work}/slurmd-%h.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
MessageTimeout=10
InactiveLimit=0
KillWait=5
MaxNodeCount=16
TreeWidth=65533
SlurmctldParameters=enable_configless
"""


class SlurmLab:
    """munged + one slurmctld + slurmds on ``lan``; ``close()`` stops them all by pid."""

    def __init__(self, lan: Lan, work: Path) -> None:
        self.lan = lan
        self.work = work
        work.mkdir(parents=True, exist_ok=True)
        os.chmod(work, 0o755)
        (work / "ctl-state").mkdir(exist_ok=True)
        self.munge_dir = work / "munge"
        self.munge_dir.mkdir(mode=0o755)
        os.chmod(self.munge_dir, 0o755)  # world-executable: every client reaches the socket
        self.munge_socket = self.munge_dir / "munge.socket.2"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.ctl: Node | None = None
        self.ctl_name = "ctl"
        self.ctl_port = 6817
        self.slurmd_port = 6818
        self.conf = work / "slurm.conf"

    # -- munge --------------------------------------------------------------------------------------
    def start_munge(self) -> None:
        key = self.work / "munge.key"
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(1024))
        argv = ["munged", "-F", "--force", f"--key-file={key}", f"--socket={self.munge_socket}",
                f"--pid-file={self.work}/munged.pid", f"--log-file={self.work}/munged.log",
                f"--seed-file={self.work}/munged.seed"]
        log = open(self.work / "munged.out", "ab")
        self.procs.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log))
        log.close()
        wait_for(self.munge_socket.exists, 20, "munged's socket")

    # -- slurmctld ---------------------------------------------------------------------------------
    def write_conf(self, extra: str = "") -> Path:
        assert self.ctl is not None
        text = BASE_CONF.format(ctl_name=self.ctl_name, ctl_ip=self.ctl.ip, ctl_port=self.ctl_port,
                                slurmd_port=self.slurmd_port, munge_socket=self.munge_socket, work=self.work)
        self.conf.write_text(text + extra)
        return self.conf

    def start_slurmctld(self, ctl: Node, extra: str = "", gres_conf: str | None = None) -> None:
        self.ctl = ctl
        self.write_conf(extra)
        if gres_conf is not None:
            (self.work / "gres.conf").write_text(gres_conf)
        # a private mount namespace: /run/gpusd/slurm/gres.conf (the Include of a configless cluster,
        # docs/slurm.md) is the controller's own, empty file
        script = (f"set -e; hostname {shlex.quote(self.ctl_name)}; mount -t tmpfs none /run; "
                  "mkdir -p /run/gpusd/slurm; : > /run/gpusd/slurm/gres.conf; "
                  f"exec slurmctld -D -i -f {shlex.quote(str(self.conf))}")
        log = open(self.work / "slurmctld.out", "ab")
        p = self.lan.popen(ctl, ["unshare", "--uts", "--mount", "--propagation", "private", "sh", "-c", script],
                           env=self.env(), stdout=log, stderr=log)
        log.close()
        self.procs.append(p)
        wait_for(lambda: self.scontrol("ping").returncode == 0 or p.poll() is not None, 30, "slurmctld to answer")
        if p.poll() is not None:
            raise RuntimeError(f"slurmctld exited:\n{self.log('slurmctld.log')}\n{self.log('slurmctld.out')}")

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.conf)
        for k in list(env):
            if k.startswith("SLURM_") and k != "SLURM_CONF":
                env.pop(k)
        return env

    def log(self, name: str, n: int = 40) -> str:
        try:
            return "\n".join((self.work / name).read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return f"(no {name})"

    # -- slurmd ------------------------------------------------------------------------------------
    def slurmd_wrapper(self) -> Path:
        """An executable that runs ``slurmd "$@"`` in a private mount namespace prepared as slurmd
        needs it inside ``ip netns exec`` (see the module docstring).  Host name: ``$SLURMD_HOST``."""
        path = self.work / "slurmd-in-netns"
        if not path.exists():
            path.write_text(f"""#!/bin/sh
set -e
exec unshare --uts --mount --propagation private sh -c '
set -e
[ -n "$SLURMD_HOST" ] && hostname "$SLURMD_HOST"
mount -t tmpfs none /sys/fs/cgroup
mkdir -p /sys/fs/cgroup/systemd
mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd
mount -t tmpfs none /run
mkdir -p /run/munge /run/gpusd/slurm
mount --bind {self.munge_dir} /run/munge
[ -n "$GPUSD_SLURM_DIR" ] && mount --bind "$GPUSD_SLURM_DIR" /run/gpusd/slurm
unset SLURM_CONF
exec slurmd "$@"' slurmd "$@"
""")
            os.chmod(path, 0o755)
        return path

    def start_slurmd(self, node: Node, hostname: str, args: Sequence[str] = ()) -> subprocess.Popen[bytes]:
        env = self.env()
        env["SLURMD_HOST"] = hostname
        log = open(self.work / f"slurmd-{hostname}.out", "ab")
        p = self.lan.popen(node, [str(self.slurmd_wrapper()), "-D", "-f", str(self.conf), *args], env=env,
                           stdout=log, stderr=log)
        log.close()
        self.procs.append(p)
        return p

    def device_files(self, count: int) -> Path:
        """``count`` character devices (nvidia's major 195) for gres.conf's File=, in a directory here."""
        d = self.work / "dev"
        d.mkdir(exist_ok=True)
        for i in range(count):
            p = d / f"nvidia{i}"
            if not p.exists():
                os.mknod(p, 0o666 | 0o020000, os.makedev(195, i))
        return d

    def render_files(self, count: int) -> Path:
        """``count`` DRM render nodes (major 226, minors 128 and up: AMD and Intel GPUs), ``renderD128``...,
        in a directory here."""
        d = self.work / "dri"
        d.mkdir(exist_ok=True)
        for i in range(count):
            p = d / f"renderD{128 + i}"
            if not p.exists():
                os.mknod(p, 0o666 | 0o020000, os.makedev(226, 128 + i))
        return d

    # -- clients -----------------------------------------------------------------------------------
    def run_in(self, node: Node, argv: Sequence[str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ip", "netns", "exec", node.ns, *argv], env=self.env(), capture_output=True,
                              text=True, timeout=timeout, stdin=subprocess.DEVNULL)

    def scontrol(self, *args: str, timeout: float = 15) -> subprocess.CompletedProcess[str]:
        assert self.ctl is not None
        try:
            return self.run_in(self.ctl, ["scontrol", *args], timeout=timeout)
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess(["scontrol", *args], 124, "", "timed out")

    def node_info(self, name: str) -> dict[str, str]:
        """``scontrol show node NAME`` as key -> value ({} when unknown)."""
        r = self.scontrol("show", "node", name, "-o")
        if r.returncode != 0:
            return {}
        out: dict[str, str] = {}
        for w in r.stdout.split():
            k, sep, v = w.partition("=")
            if sep:
                out[k] = v
        return out

    def close(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 8
        for p in reversed(self.procs):
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    pass


# -- gpusd beside Slurm ---------------------------------------------------------------------------------
# A dynamic cluster: every node gpusd joins has the feature "gpusd"; one partition of them all
DYNAMIC = ("Nodeset=gpusd Feature=gpusd\nPartitionName=gpus Nodes=gpusd Default=YES\nGresTypes=gpu\n"
           "PrologFlags=Alloc\n")


def gpu_host(lan: Lan, name: str, n: int | Sequence[FakeGPU], key: Path, args: Sequence[str] = ()) -> GpuHost:
    """A namespace host for ``gpusd start`` with ``n`` fake NVML GPUs (or these), its own lease socket."""
    node_name = f"h{len(lan.nodes) + 1}"
    gpus = make_gpus(n) if isinstance(n, int) else list(n)
    return lan.add_gpu_host(name, gpus, fast=True, node_name=node_name,
                            args=["--token-file", str(key), "--interval", "0.2", *args],
                            extra_env={"GPUSD_LEASE_SOCKET": str(lan.workdir / f"{node_name}-lease.sock")})


def devices(host: GpuHost) -> dict[str, Any]:
    """``gpusd devices --json`` on ``host``."""
    r = host.lan.gpusd(host.node, ["devices", "--json"], env=host.env)
    assert r.returncode == 0, r.stderr
    out: dict[str, Any] = json.loads(r.stdout)
    return out


def slurm_leases(host: GpuHost) -> list[dict[str, Any]]:
    """The leases Slurm jobs hold on ``host``, each with its GPU's index as ``gpu``."""
    return [dict(le, gpu=g["index"]) for g in devices(host)["gpus"] for le in g.get("leases") or []
            if le.get("slurm_job")]


def job_scripts(slurm: SlurmLab, lan: Lan, hosts: Sequence[GpuHost]) -> str:
    """Slurm's Prolog and Epilog for ``hosts`` (``gpusd slurm prolog|epilog`` with each host's lease
    socket, chosen by ``$SLURMD_NODENAME``); the slurm.conf lines naming them."""
    cases = "".join(f"  {h.hostname}) export GPUSD_LEASE_SOCKET={h.env['GPUSD_LEASE_SOCKET']} "
                    f"GPUSD_LOCK_DIR={h.env['GPUSD_LOCK_DIR']};;\n" for h in hosts)
    for what in ("prolog", "epilog"):
        script = slurm.work / what
        script.write_text(f"#!/bin/sh\ncase \"$SLURMD_NODENAME\" in\n{cases}esac\n"
                          f"exec env PYTHONPATH={lan.base_env(hosts[0].node)['PYTHONPATH']} {sys.executable} "
                          f"-m gpusd slurm {what} >>{slurm.work}/{what}.log 2>&1\n")
        script.chmod(0o755)
    return f"Prolog={slurm.work}/prolog\nEpilog={slurm.work}/epilog\n"


@pytest.fixture
def slurm(lan: Lan) -> Iterator[SlurmLab]:
    """munged and the lab of a test (skipped, with the reason, where the Slurm packages are missing);
    every daemon it started is stopped by pid at the end."""
    why = unavailable()
    if why:
        pytest.skip(why)
    lab = SlurmLab(lan, lan.workdir / "slurm")
    try:
        lab.start_munge()
        yield lab
    finally:
        lab.close()
