"""Running slurmd beside the daemon as a dynamic, configless Slurm node (``gpusd start --slurm``,
docs/slurm.md): the slurmd command line from the host's snapshot, the controller's address, and
draining or removing the node when the host goes or a GPU is lost (``scontrol``)."""

from __future__ import annotations

import ctypes
import ipaddress
import json
import logging
import os
import re
import shlex
import signal
import stat as _stat
import subprocess
import threading
from pathlib import Path
from typing import Callable

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

# where gres.conf is written: the cluster's gres.conf includes it
DEFAULT_DIR = "/run/gpusd/slurm"
SCONTROL_TIMEOUT = 15.0


def gres_dir() -> Path:
    return Path(os.environ.get("GPUSD_SLURM_DIR") or DEFAULT_DIR)


def device_prefix() -> str | None:
    """Another prefix for the GPUs' device files in gres.conf: ``$GPUSD_SLURM_DEVICES`` (unset: each
    vendor's own, ``/dev/nvidia`` or ``/dev/dri/renderD``; the number is always the vendor's).  Slurm
    needs them to be character devices."""
    raw = os.environ.get("GPUSD_SLURM_DEVICES")
    if not raw:
        return None
    if not raw.startswith("/") or any(c.isspace() or not c.isprintable() for c in raw):
        raise ConfigError(f"$GPUSD_SLURM_DEVICES must be an absolute path prefix, not {raw[:80]!r}")
    return raw


def slurmd_command() -> list[str] | None:
    """slurmd's command (``$GPUSD_SLURMD``, default ``slurmd``); None: ``off``, start none."""
    raw = os.environ.get("GPUSD_SLURMD", "slurmd").strip()
    if raw.lower() in ("off", "none", "0", ""):
        return None
    return shlex.split(raw)


# beside gres.conf: the UUIDs of the GPUs it lists, in its order
ORDER_FILE = "gres.json"


def _replace(d: Path, name: str, text: str) -> None:
    tmp = d / f".{name}.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, d / name)


def write_gres(snap: HostSnapshot, directory: Path | None = None) -> list[str]:
    """This host's gres.conf lines (no NodeName: the file is the host's own) in ``directory``,
    replaced atomically, and beside it the UUIDs of the GPUs it lists in its order (``gres.json``:
    Slurm's GPU N is the N-th); the directory is made root-only-writable when it does not exist.
    Returns those UUIDs."""
    d = directory or gres_dir()
    d.mkdir(mode=0o755, parents=True, exist_ok=True)
    st = os.lstat(d)

    if not _stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise ConfigError(f"{d} must be a directory of this user that others cannot write")
    order = [g.uuid for g in conf.gres_gpus(snap)]
    lines = conf.gres_lines(snap, with_node=False, device=device_prefix())
    text = "# written by gpusd start --slurm from this host's GPUs (docs/slurm.md)\n" + "".join(
        f"# Slurm's GPU {i} is {u}\n" for i, u in enumerate(order)) + "\n".join(lines) + "\n"
    _replace(d, ORDER_FILE, json.dumps({"format": 1, "gpus": order}) + "\n")
    _replace(d, "gres.conf", text)
    return order


def slurmd_argv(snap: HostSnapshot, controller: tuple[str, int], command: list[str]) -> list[str]:
    """``slurmd -D -Z --conf-server HOST:PORT --conf "Gres=... Feature=..."``: a dynamic node in
    configless mode with the host's GPUs (its CPUs and memory slurmd reads itself)."""
    host, port = controller
    words = [w for w in conf.node_params(snap) if w.startswith(("Gres=", "Feature="))]
    server = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return [*command, "-D", "-Z", "--conf-server", server, "--conf", " ".join(words)]


def scontrol(*args: str, timeout: float = SCONTROL_TIMEOUT, conf: Path | None = None,
             limit: int = 500) -> tuple[bool, str]:
    """Run scontrol; (ok, output).  Its config: ``$SLURM_CONF``, else ``conf`` (:func:`find_conf`),
    else Slurm's own lookup (``/etc/slurm``, slurmd's configless cache in ``/run/slurm/conf``, DNS)."""
    env = None
    if conf is not None and not os.environ.get("SLURM_CONF"):
        env = dict(os.environ, SLURM_CONF=str(conf))
    try:
        r = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=timeout,
                           stdin=subprocess.DEVNULL, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, str(exc)
    return r.returncode == 0, (r.stdout + r.stderr).strip()[:limit]


# -- finding the controller's config the way a configless slurmd does ------------------------------
# in the daemon's state directory: its copy of slurmd's configless cache
CACHE = "slurm-conf"
# where slurmd keeps what the controller sent (below its root)
RUN_CACHE = "run/slurm/conf"
_MAX_CONF = 1 << 20


def _copy_cache(src: Path, dest: Path) -> bool:
    """Copy the regular files of slurmd's configless cache ``src`` into ``dest`` (this daemon's own,
    root-only directory); False when ``src`` has no slurm.conf."""
    try:
        names = sorted(os.listdir(src))[:32]
    except OSError:
        return False
    if "slurm.conf" not in names:
        return False
    dest.mkdir(mode=0o700, parents=True, exist_ok=True)
    for name in names:
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}\.conf", name):
            continue
        try:
            fd = os.open(src / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        with os.fdopen(fd, "rb") as f:
            if not _stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                continue
            data = f.read(_MAX_CONF)
        tmp = dest / f".{name}.{os.getpid()}"
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(out, "wb") as f:
            f.write(data)
        os.replace(tmp, dest / name)
    return (dest / "slurm.conf").is_file()


def find_conf(cache_dir: Path | None, slurmd_pid: int | None = None) -> Path | None:
    """A slurm.conf for scontrol where ``$SLURM_CONF`` names none, found as a configless slurmd finds
    its own: the cache of the slurmd this daemon started (seen through ``/proc/PID/root``: it may run
    in its own mount namespace), copied into ``cache_dir`` for the next start; else the host's
    ``/run/slurm/conf``; else that copy, from a slurmd of an earlier start.  None: Slurm's own lookup."""
    if os.environ.get("SLURM_CONF"):
        return None
    if slurmd_pid is not None and cache_dir is not None:
        if _copy_cache(Path(f"/proc/{slurmd_pid}/root") / RUN_CACHE, cache_dir):
            return cache_dir / "slurm.conf"
    host = Path("/") / RUN_CACHE / "slurm.conf"
    if host.is_file():
        return host
    if cache_dir is not None and (cache_dir / "slurm.conf").is_file():
        return cache_dir / "slurm.conf"
    return None


# a job in these states still has its GPUs here (COMPLETING: its epilog has not ended the lease yet)
RUNNING_STATES = ("RUNNING", "CONFIGURING", "SUSPENDED", "COMPLETING")


def job_state(job: str, conf: Path | None = None) -> bool | None:
    """Whether the controller says Slurm job ``job`` still runs here: True, False (ended, or unknown to
    the controller), None (the controller cannot be asked: nobody can tell)."""
    ok, out = scontrol("show", "job", "-o", job, conf=conf)
    if not ok:
        return False if "Invalid job id" in out else None
    state = next((w.split("=", 1)[1] for w in out.split() if w.startswith("JobState=")), "")
    if not state:
        return None
    return state in RUNNING_STATES


def job_running(job: str) -> bool:
    """Whether the controller says Slurm job ``job`` still runs (False when it cannot tell)."""
    return job_state(job) is True


def _reason(text: str) -> str:
    """A drain reason scontrol takes as one argument: printable, no quotes, bounded."""
    return "".join(c if c.isprintable() and c not in "\"'\\" else " " for c in text)[:200]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    """slurmd ends when the daemon does, however it ends (PR_SET_PDEATHSIG): the controller then
    sees the node not responding and marks it DOWN."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


# seconds between tries to drain or resume a node the controller does not know yet
DRAIN_EVERY = 2.0
# ... for at most about two minutes (a slurmd registers within seconds)
DRAIN_TRIES = 60
# every drain reason gpusd writes starts with it: only those it may lift
GPUSD_REASON = "gpusd"


class SlurmNode:
    """slurmd beside the daemon, for one host: started by :meth:`start`, drained on a lost GPU,
    removed from the controller and stopped by :meth:`stop`."""

    def __init__(self, controller: tuple[str, int], name: str, log_path: Path | None = None,
                 cache_dir: Path | None = None) -> None:
        self.controller = controller
        self.name = name
        self.log_path = log_path
        # where the controller's config is kept for scontrol (find_conf)
        self.cache_dir = cache_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.lost: set[str] = set()
        # the UUIDs gres.conf lists: Slurm's GPU N is order[N]
        self.order: list[str] = []
        self.stopping = threading.Event()
        self._drain_lock = threading.Lock()

    def conf(self) -> Path | None:
        """The slurm.conf scontrol is to read (None: ``$SLURM_CONF`` or Slurm's own lookup)."""
        return find_conf(self.cache_dir, self.proc.pid if self.proc is not None and self.proc.poll() is None
                         else None)

    def scontrol(self, *args: str, limit: int = 500) -> tuple[bool, str]:
        return scontrol(*args, conf=self.conf(), limit=limit)

    def start(self, snap: HostSnapshot) -> None:
        command = slurmd_command()
        self.order = write_gres(snap)
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

    def info(self) -> dict[str, str] | None:
        """``scontrol show node`` of this node as key -> value (None: the controller does not know it, or
        cannot be asked)."""
        ok, out = self.scontrol("show", "node", "-o", self.name, limit=8192)  # Reason= comes late
        if not ok:
            return None
        fields: dict[str, str] = {}
        for w in out.split():
            k, sep, v = w.partition("=")
            if sep and k not in fields:
                fields[k] = v
        return fields if fields.get("NodeName") == self.name else None

    def _until_done(self, what: str, attempt: Callable[[], tuple[bool, str]]) -> bool:
        """``attempt()`` until it succeeds: every DRAIN_EVERY s, at most DRAIN_TRIES times (the node
        registers with the controller a while after slurmd starts), or until the node stops."""
        for n in range(DRAIN_TRIES):
            ok, out = attempt()
            if ok:
                return True
            if n == 0:
                log.info("Slurm: cannot %s node %s yet (%s); trying again every %gs", what, self.name, out[:200],
                         DRAIN_EVERY)
            if self.stopping.wait(DRAIN_EVERY):
                return False
        log.error("Slurm: gave up trying to %s node %s after %d tries: %s", what, self.name, DRAIN_TRIES, out[:200])
        return False

    def watch(self, snap: HostSnapshot) -> None:
        """Drain the node when a GPU is lost, with the reason gpusd saw (once per GPU; tried again until
        the controller knows the node: a lost GPU at start drains the node as soon as it registered)."""
        with self._drain_lock:
            lost = {g.uuid: g for g in snap.gpus if not g.healthy}
            new = [g for u, g in lost.items() if u not in self.lost]
            self.lost = set(lost)
        for g in new:
            reason = _reason(f"{GPUSD_REASON}: GPU {g.index} ({g.uuid}) lost: {g.error or 'unhealthy'}")
            done = self._until_done("drain", lambda reason=reason: self.scontrol(  # type: ignore[misc]
                "update", f"nodename={self.name}", "state=drain", f"reason={reason}"))
            if done:
                log.warning("Slurm: drained node %s (%s)", self.name, reason)

    def resume_if_ours(self) -> bool:
        """Every GPU is there: lift a drain gpusd set (a GPU lost, the daemon stopped with jobs running)
        once the node has registered; a drain anyone else set (the admin, Slurm's own) stays."""
        def attempt() -> tuple[bool, str]:
            fields = self.info()
            if fields is None or "UNKNOWN" in fields.get("State", "") or "NOT_RESPONDING" in fields.get("State", ""):
                return False, "not registered yet"
            if "DRAIN" not in fields.get("State", "") or not fields.get("Reason", "").startswith(GPUSD_REASON):
                return True, ""
            ok, out = self.scontrol("update", f"nodename={self.name}", "state=resume")
            if ok:
                log.info("Slurm: every GPU is here: node %s resumed (it was drained: %s)", self.name,
                         fields.get("Reason", "")[:200])
            return ok, out

        return self._until_done("resume", attempt)

    def stop(self, timeout: float = 10.0) -> None:
        """Remove the node from the controller (``scontrol delete``); where jobs still run there, drain
        it instead; then stop slurmd (by its pid)."""
        self.stopping.set()
        ok, out = self.scontrol("delete", f"nodename={self.name}")
        if ok:
            log.info("Slurm: node %s removed from the controller", self.name)
        else:
            ok2, out2 = self.scontrol("update", f"nodename={self.name}", "state=drain",
                                      f"reason={GPUSD_REASON} stopped on this host")
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
