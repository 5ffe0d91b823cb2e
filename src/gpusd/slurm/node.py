"""Running slurmd beside the daemon as a dynamic, configless Slurm node (``gpusd start --slurm``,
docs/slurm.md): the slurmd command line from the host's snapshot, the controller's address, and
draining or removing the node when the host goes or a GPU is lost (``scontrol``)."""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import shlex
import signal
import subprocess
from pathlib import Path

from ..errors import ConfigError
from ..model import HostSnapshot
from . import conf

DEFAULT_PORT = 6817
_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,253})$")


def parse_controller(text: str) -> tuple[str, int]:
    """``HOST[:PORT]`` (or a bare ``PORT`` for this host, as ``--slurmctld`` takes it) -> (host, port);
    ConfigError when it is neither a host name nor an address, or the port is out of range."""
    text = text.strip()
    host, port_s = text, ""
    if text.isdigit():
        host, port_s = "", text
    elif text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_s = rest[1:] if rest.startswith(":") else ""
    elif text.count(":") == 1:
        host, port_s = text.split(":")
    port = DEFAULT_PORT
    if port_s:
        if not port_s.isdigit() or not 0 < int(port_s) < 65536:
            raise ConfigError(f"bad Slurm controller port in {text[:80]!r}")
        port = int(port_s)
    if host:
        try:
            ipaddress.ip_address(host)
        except ValueError:
            if not _HOST.match(host):
                raise ConfigError(f"bad Slurm controller {text[:80]!r} (HOST[:PORT])") from None
    return host, port


# -- the node: its gres.conf, its slurmd, its state in the controller -------------------------------
log = logging.getLogger("gpusd.slurm")

DEFAULT_DIR = "/run/gpusd/slurm"  # where gres.conf is written: the cluster's gres.conf includes it
SCONTROL_TIMEOUT = 15.0


def gres_dir() -> Path:
    return Path(os.environ.get("GPUSD_SLURM_DIR") or DEFAULT_DIR)


def device_prefix() -> str:
    """The GPUs' device files as gres.conf names them: ``$GPUSD_SLURM_DEVICES`` (default
    ``/dev/nvidia``; GPU N is PREFIX + N).  Slurm needs them to be character devices."""
    raw = os.environ.get("GPUSD_SLURM_DEVICES") or "/dev/nvidia"
    if not raw.startswith("/") or any(c.isspace() or not c.isprintable() for c in raw):
        raise ConfigError(f"$GPUSD_SLURM_DEVICES must be an absolute path prefix, not {raw[:80]!r}")
    return raw


def slurmd_command() -> list[str] | None:
    """slurmd's command (``$GPUSD_SLURMD``, default ``slurmd``); None: ``off``, start none."""
    raw = os.environ.get("GPUSD_SLURMD", "slurmd").strip()
    if raw.lower() in ("off", "none", "0", ""):
        return None
    return shlex.split(raw)


def write_gres(snap: HostSnapshot, directory: Path | None = None) -> Path:
    """This host's gres.conf lines (no NodeName: the file is the host's own) in ``directory``,
    replaced atomically; the directory is made root-only-writable when it does not exist."""
    d = directory or gres_dir()
    d.mkdir(mode=0o755, parents=True, exist_ok=True)
    st = os.lstat(d)
    import stat as _stat

    if not _stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise ConfigError(f"{d} must be a directory of this user that others cannot write")
    text = "# written by gpusd start --slurm from this host's GPUs (docs/slurm.md)\n" + "\n".join(
        conf.gres_lines(snap, with_node=False, device=device_prefix())) + "\n"
    tmp = d / f".gres.conf.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, d / "gres.conf")
    return d / "gres.conf"


def slurmd_argv(snap: HostSnapshot, controller: tuple[str, int], command: list[str]) -> list[str]:
    """``slurmd -D -Z --conf-server HOST:PORT --conf "Gres=... Feature=..."``: a dynamic node in
    configless mode with the host's GPUs (its CPUs and memory slurmd reads itself)."""
    host, port = controller
    words = [w for w in conf.node_params(snap) if w.startswith(("Gres=", "Feature="))]
    server = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return [*command, "-D", "-Z", "--conf-server", server, "--conf", " ".join(words)]


def scontrol(*args: str, timeout: float = SCONTROL_TIMEOUT) -> tuple[bool, str]:
    """Run scontrol (its config: ``$SLURM_CONF``, else what the configless slurmd cached); (ok, output)."""
    try:
        r = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=timeout,
                           stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, str(exc)
    return r.returncode == 0, (r.stdout + r.stderr).strip()[:500]


def job_running(job: str) -> bool:
    """Whether the controller says Slurm job ``job`` still runs (False when it cannot tell)."""
    ok, out = scontrol("show", "job", "-o", job)
    state = next((w.split("=", 1)[1] for w in out.split() if w.startswith("JobState=")), "") if ok else ""
    return state in ("RUNNING", "CONFIGURING", "SUSPENDED")


def _reason(text: str) -> str:
    """A drain reason scontrol takes as one argument: printable, no quotes, bounded."""
    return "".join(c if c.isprintable() and c not in "\"'\\" else " " for c in text)[:200]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    """slurmd ends when the daemon does, however it ends (PR_SET_PDEATHSIG): the controller then
    sees the node not responding and marks it DOWN."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class SlurmNode:
    """slurmd beside the daemon, for one host: started by :meth:`start`, drained on a lost GPU,
    removed from the controller and stopped by :meth:`stop`."""

    def __init__(self, controller: tuple[str, int], name: str, log_path: Path | None = None) -> None:
        self.controller = controller
        self.name = name
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.lost: set[str] = set()

    def start(self, snap: HostSnapshot) -> None:
        command = slurmd_command()
        write_gres(snap)
        if command is None:
            log.info("Slurm: gres.conf written; slurmd not started ($GPUSD_SLURMD=off)")
            return
        argv = slurmd_argv(snap, self.controller, command)
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                         preexec_fn=_die_with_parent, start_new_session=True)
        except OSError as exc:
            raise ConfigError(f"cannot start slurmd ({argv[0]}): {exc.strerror}") from None
        finally:
            if out is not subprocess.DEVNULL:
                out.close()  # type: ignore[union-attr]
        log.info("Slurm: slurmd (pid %d) joins %s:%d as dynamic node %s: %s", self.proc.pid, *self.controller,
                 self.name, " ".join(argv[-1:]))

    def watch(self, snap: HostSnapshot) -> None:
        """Drain the node when a GPU is lost, with the reason gpusd saw (once per GPU)."""
        lost = {g.uuid: g for g in snap.gpus if not g.healthy}
        new = [g for u, g in lost.items() if u not in self.lost]
        self.lost = set(lost)
        for g in new:
            reason = _reason(f"gpusd: GPU {g.index} ({g.uuid}) lost: {g.error or 'unhealthy'}")
            ok, out = scontrol("update", f"nodename={self.name}", "state=drain", f"reason={reason}")
            log.warning("Slurm: drained node %s (%s)%s", self.name, reason, "" if ok else f": scontrol: {out}")

    def stop(self, timeout: float = 10.0) -> None:
        """Remove the node from the controller (``scontrol delete``); where jobs still run there, drain
        it instead; then stop slurmd (by its pid)."""
        ok, out = scontrol("delete", f"nodename={self.name}")
        if ok:
            log.info("Slurm: node %s removed from the controller", self.name)
        else:
            ok2, out2 = scontrol("update", f"nodename={self.name}", "state=drain",
                                 "reason=gpusd stopped on this host")
            log.warning("Slurm: could not remove node %s (%s); %s", self.name, out,
                        "drained it" if ok2 else f"could not drain it either ({out2})")
        p, self.proc = self.proc, None
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
