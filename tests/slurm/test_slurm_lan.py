"""gpusd and the real Slurm (issue 23, docs/slurm.md): Debian's slurmctld, slurmd and munge on a LAN
of network namespaces (tests/netns.py, tests/slurm_helpers.py), gpusd daemons on fake NVML GPUs.
Skipped, with the reason, without root, ``ip netns`` or the Slurm packages.  Every wait is bounded
and every process is stopped by pid (SlurmLab.close, Lan.close), even when a test fails."""

from __future__ import annotations

import re
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

from fakenvml import make_gpus
from lan_helpers import secret_file
from netns import GpuHost, Lan, lan, netns_ok  # noqa: F401
from slurm_helpers import DYNAMIC, SlurmLab, gpu_host, job_scripts, slurm, wait_for  # noqa: F401
from slurm_helpers import devices as _devices
from slurm_helpers import slurm_leases as _slurm_leases


def conf_from(lan: Lan, node: Any, key: Path, *extra: str) -> subprocess.CompletedProcess[str]:  # noqa: F811
    return lan.gpusd(node, ["slurm", "conf", "--token-file", str(key), "--browse", "4", *extra],
                     env=lan.base_env(node, GPUSD_MDNS_FAST="1"), timeout=60)


def conf_of(lan: Lan, node: Any, key: Path, names: list[str], *extra: str) -> subprocess.CompletedProcess[str]:  # noqa: F811
    """``conf_from`` once every host of ``names`` is in its output (browsing may miss a host that is
    slow to prove itself under load: asked again, for at most 60 s)."""
    out: list[subprocess.CompletedProcess[str]] = []

    def ask() -> bool:
        out[:] = [conf_from(lan, node, key, *extra)]
        return out[0].returncode == 0 and all(f"NodeName={n} " in out[0].stdout for n in names)

    wait_for(ask, 60, lambda: f"{names} in gpusd slurm conf: {out[0].stdout} {out[0].stderr}")
    return out[0]


def test_slurm_conf_lines_are_accepted_by_a_real_slurmctld_and_slurmd(lan: Lan, slurm: SlurmLab,  # noqa: F811
                                                                    tmp_path: Path) -> None:
    """Done when (1): the NodeName and gres.conf lines ``gpusd slurm conf`` prints for a namespace fleet
    of 2 and 4 GPUs are what slurmctld takes (``scontrol show node`` shows each host's GRES), a slurmd
    started on them registers IDLE with its GPUs, a job gets a GPU, and ``--check`` on a slurm.conf
    that lacks a host reports it added."""
    key = secret_file(tmp_path / "fleet.key", secrets.token_hex(32))
    a = gpu_host(lan, "gpu-a", 2, key)
    b = gpu_host(lan, "gpu-b", 4, key)
    ctl = lan.add_node("ctl")
    a.start()
    b.start()
    nodes = conf_of(lan, ctl, key, ["gpu-a", "gpu-b"])
    gres = conf_of(lan, ctl, key, ["gpu-a", "gpu-b"], "--gres")
    for h, n in ((a, 2), (b, 4)):
        assert re.search(rf"^NodeName={h.hostname} NodeAddr={re.escape(h.ip)} .*Gres=gpu:a100:{n} ", nodes.stdout,
                         re.M), nodes.stdout
    assert len(re.findall(r"^NodeName=gpu-b Name=gpu Type=a100 File=/dev/nvidia[0-3]", gres.stdout, re.M)) == 4
    # the GPUs are simulated: File= names device files the test made (a char device is what slurmd needs)
    dev = slurm.device_files(4)
    gres_text = gres.stdout.replace("File=/dev/nvidia", f"File={dev}/nvidia")
    slurm.start_slurmctld(ctl, extra=nodes.stdout + "PartitionName=gpus Nodes=ALL Default=YES\n", gres_conf=gres_text)
    assert slurm.node_info("gpu-a").get("Gres") == "gpu:a100:2"
    assert slurm.node_info("gpu-b").get("Gres") == "gpu:a100:4"
    # slurmd reads the gres.conf lines (Cores=, Links=) and registers with them
    slurm.start_slurmd(a.node, "gpu-a")
    wait_for(lambda: "IDLE" in slurm.node_info("gpu-a").get("State", ""), 60,
             lambda: f"gpu-a to register IDLE:\n{slurm.log('slurmd-gpu-a.log')}\n{slurm.log('slurmctld.log')}")
    r = slurm.run_in(ctl, ["srun", "-w", "gpu-a", "--gres=gpu:2", "printenv", "CUDA_VISIBLE_DEVICES"], timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "0,1", (r.stdout, r.stderr)
    # --check: a slurm.conf with gpu-a only reports gpu-b as added; the generated one matches
    only_a = tmp_path / "only-a.conf"
    only_a.write_text("\n".join(line for line in nodes.stdout.splitlines() if "gpu-b" not in line) + "\n")
    # (asked again where browsing missed a host that was slow to prove itself: it would read as gone)
    got: list[subprocess.CompletedProcess[str]] = []
    wait_for(lambda: got.append(conf_from(lan, ctl, key, "--check", str(only_a))) or "gone" not in got[-1].stdout,
             60, lambda: got[-1].stdout)
    checked = got[-1]
    assert checked.returncode == 1, (checked.stdout, checked.stderr)
    assert checked.stdout.splitlines() == ["added: gpu-b (in the fleet, not in the file)"], checked.stdout
    full = tmp_path / "full.conf"
    full.write_text(nodes.stdout)
    wait_for(lambda: got.append(conf_from(lan, ctl, key, "--check", str(full))) or "gone" not in got[-1].stdout,
             60, lambda: got[-1].stdout)
    assert got[-1].returncode == 0, (got[-1].stdout, got[-1].stderr)


def prolog_script(slurm: SlurmLab, host: GpuHost, what: str) -> Path:
    """Slurm's Prolog/Epilog for ``host``: two lines that call gpusd (docs/slurm.md) with the test's
    lease socket and source tree (Slurm gives the script only the job's variables)."""
    path = slurm.work / f"{what}-{host.hostname}"
    env = " ".join(f"{k}={v}" for k, v in host.env.items()
                   if k in ("GPUSD_LEASE_SOCKET", "GPUSD_LOCK_DIR", "GPUSD_STATE_DIR", "PYTHONPATH"))
    path.write_text(f"#!/bin/sh\nexec env {env} {sys.executable} -m gpusd slurm {what} "
                    f">>{slurm.work}/{what}.log 2>&1\n")
    path.chmod(0o755)
    return path


def test_a_slurm_job_gpus_are_a_gpusd_lease_and_local_runs_are_refused(lan: Lan, slurm: SlurmLab,  # noqa: F811
                                                                       tmp_path: Path) -> None:
    """Done when (2): ``srun --gres=gpu:1`` gets a GPU, which gpusd on that node shows as leased by the
    Slurm job (its id and user) while a concurrent local ``gpusd run`` is refused with how to ask Slurm
    (none given twice); after the job the lease is gone."""
    key = secret_file(tmp_path / "fleet.key", secrets.token_hex(32))
    a = gpu_host(lan, "gpu-a", 2, key, ["--slurm", "--slurm-controller", "198.18.0.2"])
    ctl = lan.add_node("ctl")
    a.env["GPUSD_SLURMD"] = "off"  # this test starts slurmd itself, from a static slurm.conf
    a.start()
    nodes = conf_of(lan, ctl, key, ["gpu-a"])
    gres = conf_of(lan, ctl, key, ["gpu-a"], "--gres")
    dev = slurm.device_files(2)
    extra = (nodes.stdout + "PartitionName=gpus Nodes=ALL Default=YES\nPrologFlags=Alloc\n"
             f"Prolog={prolog_script(slurm, a, 'prolog')}\nEpilog={prolog_script(slurm, a, 'epilog')}\n")
    slurm.start_slurmctld(ctl, extra=extra, gres_conf=gres.stdout.replace("File=/dev/nvidia", f"File={dev}/nvidia"))
    slurm.start_slurmd(a.node, "gpu-a")
    wait_for(lambda: "IDLE" in slurm.node_info("gpu-a").get("State", ""), 60, "gpu-a to register IDLE")
    job = subprocess.Popen(["ip", "netns", "exec", ctl.ns, "srun", "-w", "gpu-a", "--gres=gpu:1", "sh", "-c",
                            "echo $CUDA_VISIBLE_DEVICES; sleep 6"], env=slurm.env(), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        held = wait_for(lambda: _slurm_leases(a), 30, lambda: f"the Slurm job's lease:\n{slurm.log('prolog.log')}\n"
                        f"{slurm.log('slurmd-gpu-a.log')}\n{slurm.log('slurmctld.log', 20)}\n{a.log_tail()}")
        assert isinstance(held, list) and len(held) == 1
        assert held[0]["user"] == "root" and held[0]["command"].startswith("slurm job ")
        slurm_job = held[0]["slurm_job"]
        # a local gpusd run on this Slurm node is refused, saying how to ask Slurm
        r = lan.gpusd(a.node, ["run", "--", "true"], env=a.env, timeout=60)
        assert r.returncode == 4 and "srun --gres=gpu:1" in r.stderr, (r.returncode, r.stderr)
        out, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(10)
    assert job.returncode == 0, err
    assert out.strip() == str(held[0]["gpu"]), (out, held)  # the GPU Slurm gave is the one gpusd shows leased
    assert re.fullmatch(r"[0-9]+", slurm_job)
    wait_for(lambda: not _slurm_leases(a), 30, lambda: f"the lease to end after the job:\n{slurm.log('epilog.log')}")


def test_gpu_hosts_join_slurm_with_no_config_line_and_leave_when_gpusd_stops(lan: Lan, slurm: SlurmLab,  # noqa: F811
                                                                            tmp_path: Path) -> None:
    """Done when (2, 3): two hosts started with ``gpusd start --slurm`` find the controller through the
    daemon started with ``--slurmctld`` and join as dynamic configless nodes (no NodeName line written:
    ``scontrol show node`` shows their GRES, 2 and 4 GPUs); a job's GPU is leased by the Slurm job in
    gpusd while a local ``gpusd run`` is refused; the lease ends with the job; a lost GPU drains the node
    with gpusd's reason; after ``gpusd stop`` the node is gone from the controller."""
    key = secret_file(tmp_path / "fleet.key", secrets.token_hex(32))
    ctl_host = lan.add_gpu_host("ctl", [], fast=True, node_name="ctl",
                                args=["--token-file", str(key), "--interval", "0.2", "--slurmctld", "6817"],
                                extra_env={"GPUSD_LEASE_SOCKET": str(lan.workdir / "ctl-lease.sock")})
    hosts = [gpu_host(lan, "gpu-a", 2, key, ["--slurm"]), gpu_host(lan, "gpu-b", 4, key, ["--slurm"])]
    dev = slurm.device_files(4)
    # the cluster's gres.conf is one Include of each host's own file, which gpusd writes (docs/slurm.md)
    slurm.start_slurmctld(ctl_host.node, extra=DYNAMIC + job_scripts(slurm, lan, hosts),
                          gres_conf="Include /run/gpusd/slurm/gres.conf\n")
    ctl_host.start()
    for h in hosts:
        slurm_dir = lan.workdir / f"{h.node.name}-slurm"
        h.env.update(GPUSD_SLURMD=str(slurm.slurmd_wrapper()), SLURMD_HOST=h.hostname,
                     GPUSD_SLURM_DIR=str(slurm_dir), SLURM_CONF=str(slurm.conf),
                     GPUSD_SLURM_DEVICES=f"{dev}/nvidia")  # the simulated GPUs' device files
        h.start()
    for h, n in zip(hosts, (2, 4)):
        wait_for(lambda h=h: "IDLE" in slurm.node_info(h.hostname).get("State", ""), 60,
                 lambda h=h: f"{h.hostname} to join:\n{h.log_tail()}\n{slurm.log(f'slurmd-{h.hostname}.log')}")
        info = slurm.node_info(h.hostname)
        assert info["Gres"] == f"gpu:a100:{n}" and "DYNAMIC" in info["State"], info
        # gres.conf's File= are the GPUs' device files (the simulated ones: in the test's directory)
        assert (lan.workdir / f"{h.node.name}-slurm" / "gres.conf").read_text().count(f"File={dev}/nvidia") == n
    assert "NodeName" not in slurm.conf.read_text()  # nobody wrote a node line
    b = hosts[1]
    job = subprocess.Popen(["ip", "netns", "exec", ctl_host.node.ns, "srun", "-w", "gpu-b", "--gres=gpu:1", "sh", "-c",
                            "echo $CUDA_VISIBLE_DEVICES; sleep 6"], env=slurm.env(), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        held = wait_for(lambda: _slurm_leases(b), 40,
                        lambda: f"the Slurm job's lease on gpu-b:\n{slurm.log('prolog.log')}\n"
                        f"{slurm.log('slurmd-gpu-b.log')}")
        assert isinstance(held, list) and len(held) == 1
        r = lan.gpusd(b.node, ["run", "--", "true"], env=b.env, timeout=60)
        assert r.returncode == 4 and "srun --gres=gpu:1" in r.stderr, (r.returncode, r.stderr)
        out, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(10)
    assert job.returncode == 0, err
    assert out.strip() == str(held[0]["gpu"]), (out, held)
    wait_for(lambda: not _slurm_leases(b), 30, lambda: f"the lease to end:\n{slurm.log('epilog.log')}")
    # a remote reservation of gpu-b's GPUs through gpusd's pool is refused too (Slurm allocates there)
    r = lan.gpusd(ctl_host.node, ["reserve", "-n", "1", "--host", "gpu-b", "--for", "60", "--token-file", str(key)],
                  env=lan.base_env(ctl_host.node, GPUSD_MDNS_FAST="1"), timeout=90)
    assert r.returncode == 4, (r.returncode, r.stdout, r.stderr)
    assert _slurm_leases(b) == [] and not any(g.get("leases") for g in _devices(b)["gpus"])
    # GPU 3 of gpu-b falls off the bus: the node is drained with gpusd's reason
    gpus = make_gpus(4)
    gpus[3].errors = {"*": 15}
    b.write(gpus)
    wait_for(lambda: "DRAIN" in slurm.node_info("gpu-b").get("State", ""), 30,
             lambda: f"gpu-b drained:\n{b.log_tail()}")
    assert "gpusd: GPU 3" in slurm.scontrol("show", "node", "gpu-b").stdout
    # gpusd stop: the node leaves the controller
    hosts[0].stop(timeout=60)
    wait_for(lambda: not slurm.node_info("gpu-a"), 30, lambda: f"gpu-a removed:\n{hosts[0].log_tail()}")
    assert slurm.node_info("gpu-b")
    # the daemon dies without a word: its slurmd goes with it (PR_SET_PDEATHSIG)
    m = re.search(r"slurmd \(pid (\d+)\) joins", (b.state_dir / "gpusd.log").read_text())
    assert m, b.log_tail()
    slurmd_pid = int(m.group(1))
    b.kill()
    wait_for(lambda: not Path(f"/proc/{slurmd_pid}").exists() or
             "Z" in Path(f"/proc/{slurmd_pid}/stat").read_text().split()[2], 20, "slurmd to end with its daemon")


def test_a_daemon_restarted_during_a_slurm_job_takes_its_lease_again(lan: Lan, slurm: SlurmLab,  # noqa: F811
                                                                     tmp_path: Path) -> None:
    """The job's lease ends with the daemon; the next daemon asks the controller and, the job still
    running, takes it again; the job's epilog then ends it."""
    key = secret_file(tmp_path / "fleet.key", secrets.token_hex(32))
    ctl = lan.add_node("ctl")
    b = gpu_host(lan, "gpu-b", 2, key, ["--slurm", "--slurm-controller", ctl.ip])
    dev = slurm.device_files(2)
    cases = (f"  gpu-b) export GPUSD_LEASE_SOCKET={b.env['GPUSD_LEASE_SOCKET']} "
             f"GPUSD_LOCK_DIR={b.env['GPUSD_LOCK_DIR']};;\n")
    for what in ("prolog", "epilog"):
        script = slurm.work / what
        script.write_text(f"#!/bin/sh\ncase \"$SLURMD_NODENAME\" in\n{cases}esac\n"
                          f"exec env PYTHONPATH={lan.base_env(b.node)['PYTHONPATH']} {sys.executable} "
                          f"-m gpusd slurm {what} >>{slurm.work}/{what}.log 2>&1\n")
        script.chmod(0o755)
    slurm.start_slurmctld(ctl, extra=DYNAMIC + f"Prolog={slurm.work}/prolog\nEpilog={slurm.work}/epilog\n",
                          gres_conf="Include /run/gpusd/slurm/gres.conf\n")
    b.env.update(GPUSD_SLURMD=str(slurm.slurmd_wrapper()), SLURMD_HOST="gpu-b",
                 GPUSD_SLURM_DIR=str(lan.workdir / "gpu-b-slurm"), SLURM_CONF=str(slurm.conf),
                 GPUSD_SLURM_DEVICES=f"{dev}/nvidia")
    b.start()
    wait_for(lambda: "IDLE" in slurm.node_info("gpu-b").get("State", ""), 60, lambda: b.log_tail())
    job = subprocess.Popen(["ip", "netns", "exec", ctl.ns, "srun", "-w", "gpu-b", "--gres=gpu:1", "sleep", "25"],
                           env=slurm.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: _slurm_leases(b), 40, lambda: slurm.log("prolog.log"))
        b.stop(timeout=60)  # the job runs on: the node is drained, not removed
        assert _slurm_leases(b) == []
        assert "DRAIN" in slurm.node_info("gpu-b").get("State", ""), slurm.node_info("gpu-b")
        b.start()
        held = wait_for(lambda: _slurm_leases(b), 30, lambda: b.log_tail())
        assert isinstance(held, list) and len(held) == 1 and held[0]["slurm_job"]
        _, err = job.communicate(timeout=60)
        assert job.returncode == 0, err  # the job ran through both daemons
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(10)
    wait_for(lambda: not _slurm_leases(b), 40,
             lambda: f"the lease to end:\n{slurm.log('epilog.log')}\n{b.log_tail()}")
