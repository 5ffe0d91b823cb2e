"""Running the daemon as a process: pid file, background start, stop, systemd readiness.

Files in the state directory (``$GPUSD_STATE_DIR``, see :func:`gpusd.identity.state_dir`); the first two
are read, by every reader, through :mod:`gpusd.localdaemon` (whether the daemon runs, and where it serves):

``gpusd.pid``
    The daemon's pid.  The daemon holds an exclusive ``flock`` on it while it runs, so a pid file
    left by a crashed daemon is recognised as stale, and two daemons never share a state directory.
``gpusd.json``
    Where the running daemon serves (port, addresses, session, start time), for ``gpusd status``.
``gpusd.log``
    The log of a daemon started in the background (a foreground daemon logs to stderr, or to
    ``--log-file``): rotated by size while it runs, ``gpusd.log.1`` ... ``.3`` kept (:mod:`.logs`).
``node-id``
    The node id (:func:`gpusd.identity.node_id`).
"""

# Imports inside functions: optional or heavy packages; start-up (gpusd stop imports this module).
from __future__ import annotations

import errno
import fcntl
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from ..alloc.lockdir import replace_file, same_file
from ..errors import DaemonStartFailed, GpusdError, NoDaemon
from ..localdaemon import INFO_FILE, PID_FILE, locked, read_pid, status
from ..sanitize import for_terminal, json_object
from ..wire.aio import load

if TYPE_CHECKING:  # pragma: no cover
    import logging


def _log() -> logging.Logger:
    """This module's logger (``logging`` imported only where the daemon runs: ``gpusd stop`` and the unit's
    text need none of it)."""
    import logging

    return logging.getLogger(__name__)


LOG_FILE = "gpusd.log"


# -- the pid file ----------------------------------------------------------------------------
class PidFile:
    """Held (``flock LOCK_EX``) by the running daemon for its whole life."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / PID_FILE
        self.fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                    pid = read_pid(self.path)
                    raise GpusdError(f"a gpusd daemon is already running with state directory {self.path.parent}"
                                     f"{f' (pid {pid})' if pid else ''}; stop it with "
                                     f"{stop_command(self.path.parent)}") from None
                raise
            # A stopping daemon unlinks the file before it lets go of the lock: a lock won on that
            # unlinked file guards nothing (the next daemon would create and lock a new one).
            if same_file(fd, self.path):
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            self.path.unlink()
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None


def write_info(state_dir: Path, info: dict[str, Any]) -> None:
    path = state_dir / INFO_FILE
    replace_file(path, path.with_name(f".{INFO_FILE}.{os.getpid()}.tmp"), (json.dumps(info, indent=1) + "\n").encode())


# -- readiness -------------------------------------------------------------------------------
def sd_notify(message: str) -> bool:
    """Tell systemd (``Type=notify``) about our state; a no-op outside systemd."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(message.encode())
        return True
    except OSError as exc:
        _log().debug("sd_notify failed: %s", exc)
        return False


# The systemd unit, as shipped in docs/gpusd.service (that file is this text with DEFAULT_EXEC) and as
# ``gpusd start --print-unit`` writes it for the install that runs it.  ProtectSystem=strict makes
# /run read-only: RuntimeDirectory= is what lets the daemon have /run/gpusd for its lease socket (without
# it the daemon is not the lease authority, and every client leases in the shared lock directory).
DEFAULT_EXEC = "/usr/local/bin/gpusd start --foreground"
UNIT = """\
# gpusd: announce this host's GPUs on the LAN and serve their live state (docs/daemon.md).
#   gpusd start --print-unit [options] > /etc/systemd/system/gpusd.service  (ExecStart for this install)
#   systemctl daemon-reload && systemctl enable --now gpusd
[Unit]
Description=gpusd GPU service discovery daemon
Wants=network-online.target
After=network-online.target nvidia-persistenced.service

[Service]
Type=notify
NotifyAccess=main
# Options: --session NAME, --interface eth0 (repeatable), --port 4780, --interval 1, --gpusd-compat
ExecStart={exec_start}
# Optional: GPUSD_TOKEN_FILE=/etc/gpusd/fleet.key (trust on, docs/security.md; and GPUSD_INTERFACES=...) in this file
EnvironmentFile=-/etc/gpusd/env
# The state directory is /var/lib/gpusd (root's default); the node id derives from /etc/machine-id.
Environment=PYTHONUNBUFFERED=1
StateDirectory=gpusd
# /run/gpusd: the lease socket's directory (root's, 0755); kept across a restart so that clients
# holding leases through the socket find it again
RuntimeDirectory=gpusd
RuntimeDirectoryMode=0755
RuntimeDirectoryPreserve=restart
# The daemon sends its goodbye (bye event + mDNS goodbye) on SIGTERM within a second or two.
KillSignal=SIGTERM
# Remote leases (docs/pool.md) outlive a restart: systemd keeps copies of their lock descriptors in the
# service's file descriptor store and hands them to the next daemon (FDSTORE= is set by systemd 254 and
# later; set here for older versions, equal to FileDescriptorStoreMax=). `systemctl stop` empties it.
FileDescriptorStoreMax=4096
Environment=FDSTORE=4096
TimeoutStopSec=20
Restart=on-failure
RestartSec=5
# No NVML / no driver (exit 3): retry later rather than give up after a boot race with the driver
RestartPreventExitStatus=2
# Hardening: the daemon reads NVML and /proc, writes only its state directory, its runtime directory
# and the lease directory
NoNewPrivileges=yes
ProtectSystem=strict
ProtectHome=read-only
ReadWritePaths=/var/lib/gpusd /tmp
PrivateTmp=no

[Install]
WantedBy=multi-user.target
"""


def unit_word(word: str) -> str:
    """One word of an ExecStart= line, quoted as systemd.service(5) reads it: ``%`` is a specifier and
    ``$`` a variable unless doubled; a word with spaces, quotes or backslashes goes in double quotes."""
    word = word.replace("%", "%%").replace("$", "$$")
    if word and not any(c in word for c in " \t\"'\\;"):
        return word
    return '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'


def unit_text(argv: Sequence[str] | None = None) -> str:
    """The unit with an ExecStart= that runs ``argv`` (default: the shipped one)."""
    return UNIT.format(exec_start=DEFAULT_EXEC if argv is None else " ".join(unit_word(w) for w in argv))


def serving_line(info: dict[str, Any]) -> str:
    """What a daemon serves, as its start line says it: every URL (HTTP and HTTPS, with the pinned
    certificate) and whether it is the lease authority, and why not (then every client leases in the
    shared lock directory: an administrator should know)."""
    urls = [u for u in [*(info.get("urls") or []), *(info.get("tls_urls") or [])] if isinstance(u, str)]
    out = "serving " + (" ".join(urls) or "?")
    if info.get("cert_fp"):
        out += f" (certificate {info.get('cert_fp')})"
    auth = info.get("authority")
    if isinstance(auth, dict):
        out += (f"; lease authority on {auth.get('socket')}" if auth.get("serving") else
                f"; NOT the lease authority ({for_terminal(auth.get('why') or 'unknown', 300)}): clients lease "
                "in the shared lock directory")
    return out


def notify_ready(ready_fd: int | None, info: dict[str, Any]) -> None:
    if ready_fd is not None:
        try:
            os.write(ready_fd, (json.dumps(info) + "\n").encode())
            os.close(ready_fd)
        except OSError:
            pass
    sd_notify(f"READY=1\nSTATUS=serving on port {info.get('port')}\nMAINPID={os.getpid()}")


# -- background start --------------------------------------------------------------------------
def _rotate(log_path: Path) -> None:
    from .logs import limits_from_env, rotate

    max_bytes, backups = limits_from_env()
    rotate(log_path, backups, max_bytes)


def raise_fd_limit() -> tuple[int, int]:
    """Raise this process's soft limit on open files (RLIMIT_NOFILE) to its hard limit: every HTTP
    connection, event stream and fleet peer costs a descriptor, and 1024 (a common soft default) was
    too few under attack.  Returns (old soft limit, new soft limit)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard != soft and (hard == resource.RLIM_INFINITY or hard > soft):
            target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            except (ValueError, OSError):
                # e.g. macOS refuses more than OPEN_MAX
                target = soft
            return soft, target
        return soft, soft
    except (ImportError, OSError, ValueError):
        return -1, -1


def spawn(foreground_args: Sequence[str], state_dir: Path, *, env: dict[str, str] | None = None,
          timeout: float = 30.0, log_path: Path | None = None) -> dict[str, Any]:
    """Start ``gpusd start --foreground <args>`` in the background (own session, output to the log)
    and wait until it is announced.  Returns what the daemon reported (pid, port, addresses)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_path or state_dir / LOG_FILE
    _rotate(log_path)
    r, w = os.pipe()
    env = dict(os.environ if env is None else env)
    argv = [sys.executable, "-m", "gpusd", "start", "--foreground", *foreground_args, "--log-file", str(log_path),
            "--ready-fd", str(w)]
    with open(log_path, "ab", buffering=0) as logf:
        logf.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(argv[1:])}\n".encode())
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, env=env,
                                    pass_fds=(w,), start_new_session=True, close_fds=True)
        finally:
            os.close(w)
    try:
        line = _read_line(r, timeout, proc)
    finally:
        os.close(r)
    if line:
        try:
            return json_object(line)
        except ValueError:
            pass
    code = proc.poll()
    # alive but silent: give up on it
    if code is None:
        proc.terminate()
        try:
            code = proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        raise GpusdError(f"the daemon did not come up within {timeout:.0f} s; see {log_path}")
    raise _failure(code, log_path)


def _read_line(fd: int, timeout: float, proc: subprocess.Popen[bytes]) -> str:
    deadline = time.monotonic() + timeout
    buf = b""
    while b"\n" not in buf:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        ready, _, _ = select.select([fd], [], [], min(remaining, 0.5))
        if not ready:
            continue
        chunk = os.read(fd, 4096)
        # the daemon closed the pipe: it exited
        if not chunk:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
            break
        buf += chunk
    return buf.decode(errors="replace").split("\n", 1)[0]


def _failure(code: int, log_path: Path) -> DaemonStartFailed:
    """The error a failed daemon start reports: its last log line (the daemon's own message)."""
    tail = ""
    try:
        lines = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
        for ln in reversed(lines):
            if not ln.startswith("---"):
                tail = ln.removeprefix("gpusd: ")
                break
    except OSError:
        pass
    # The CLI keeps the daemon's own documented exit code (e.g. 3: no NVML) from ``status``.
    return DaemonStartFailed(f"the daemon failed to start: {tail or f'exit code {code}'} (log: {log_path})", code)


# -- stop ----------------------------------------------------------------------------------------
def stop(state_dir: Path, timeout: float = 10.0, force: bool = False) -> int:
    """SIGTERM the daemon of ``state_dir`` and wait until it is gone (its goodbye sent).  With
    ``force``, SIGKILL it if it does not stop within ``timeout``.  Returns the pid stopped."""
    st = status(state_dir)
    if not st.running or st.pid is None:
        raise NoDaemon(f"no gpusd daemon is running with state directory {state_dir}")
    pid = st.pid
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return pid
    pid_path = state_dir / PID_FILE
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not locked(pid_path):
            return pid
        time.sleep(0.05)
    if force:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return pid
    raise GpusdError(f"the daemon (pid {pid}) did not stop within {timeout:.0f} s; "
                     f"{stop_command(state_dir, force=True)} kills it")


def stop_command(state_dir: Path, force: bool = False) -> str:
    """The command that stops the daemon of ``state_dir``, for hints: it names ``--state-dir`` unless
    the directory is the default one (no ``--state-dir``, no ``$GPUSD_STATE_DIR``), so that it never
    stops another daemon."""
    import shlex

    words = ["gpusd", "stop"]
    # --state-dir is passed on as $GPUSD_STATE_DIR
    if os.environ.get("GPUSD_STATE_DIR"):
        words += ["--state-dir", str(Path(state_dir).resolve())]
    if force:
        words.append("--force")
    return shlex.join(words)


# -- foreground run ------------------------------------------------------------------------------
def limit_malloc_arenas(arenas: int = 1) -> bool:
    """Let every thread of this process allocate from ``arenas`` glibc malloc arenas (``mallopt
    M_ARENA_MAX``), unless ``$MALLOC_ARENA_MAX`` says otherwise.  Call before any thread starts.

    glibc gives each new thread that allocates its own arena, up to eight per core, and an arena
    keeps what it once held: the daemon's worker threads (sampling, history writer, lease server,
    start-up executor) held 1-3 MiB of RSS at rest that way.  Their allocations are few and mostly
    under the GIL, so one arena costs no contention worth measuring.  True when the limit was set."""
    # the operator's choice, already applied by glibc
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        import ctypes

        return bool(ctypes.CDLL("libc.so.6").mallopt(M_ARENA_MAX, arenas))
    except (OSError, AttributeError):
        # not glibc (musl, macOS): nothing to limit
        return False


M_ARENA_MAX = -8  # glibc's malloc.h


def _claim_authority(config: Any) -> int | None:
    """The lock directory's authority lock, where this daemon is to be its lease authority (root,
    leases on, a lease socket): :meth:`gpusd.alloc.leases.LeaseStore.claim`, which raises GpusdError
    (one line, naming the first daemon) while another daemon holds it, whatever socket either serves:
    a second daemon on one lock directory is refused and touches nothing.  Daemons that are not to be
    the authority say so (``GPUSD_LEASE_SOCKET=off``, as ``gpusd demo``'s do).  None elsewhere."""
    if not config.leases or os.geteuid() != 0:
        return None
    from ..alloc.authority import socket_path

    path = socket_path()
    if path is None:
        return None
    from ..alloc.leases import LeaseStore

    return LeaseStore.authority().claim()


def run_foreground(config: Any, ready_fd: int | None = None) -> int:
    """Run the daemon in this process until SIGTERM/SIGINT.  Returns the exit code."""
    # before the first thread (daemon memory at rest)
    limit_malloc_arenas()
    old, new = raise_fd_limit()
    if new != old:
        _log().info("open-file limit raised from %d to %d", old, new)
    # here: reading the status (gpusd list, status) needs none of it
    import asyncio

    # before the daemon's modules import it: without the CA store in a gpusd process (gpusd.wire.aio)
    load()
    return asyncio.run(_main(config, ready_fd))


async def _main(config: Any, ready_fd: int | None) -> int:
    import asyncio

    from .service import Daemon

    state_dir = Path(config.state_dir) if config.state_dir else None
    daemon = Daemon(config)
    # a stop may be a restart: the remote leases stay with their co-holder, which ends them at their
    # expiry unless the next daemon takes them back (docs/pool.md, "Failure cases")
    daemon.pool.keep_on_stop = True
    pid = PidFile(daemon.state_dir)
    pid.acquire()
    # before anything starts: a second lease authority on one lock directory is refused untouched
    try:
        daemon.authority_claim = _claim_authority(config)
    except BaseException:
        pid.release()
        raise
    loop = asyncio.get_running_loop()
    stop_event = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_event.set)
    loop.add_signal_handler(signal.SIGHUP, lambda: _log().info("SIGHUP ignored (restart to reconfigure)"))
    try:
        start = asyncio.ensure_future(daemon.start())
        stopper = asyncio.ensure_future(stop_event.wait())
        await asyncio.wait({start, stopper}, return_when=asyncio.FIRST_COMPLETED)
        # asked to stop while starting
        if not start.done():
            start.cancel()
            await asyncio.gather(start, return_exceptions=True)
            await daemon.stop()
            return 0
        stopper.cancel()
        # raises GpusdError when the start failed
        start.result()
        info = {
            "pid": os.getpid(),
            "port": daemon.port,
            "tls_port": daemon.tls_port,
            "cert_fp": daemon.cert_fp,
            "addresses": daemon.addresses,
            "urls": daemon.urls,
            # added in 0.4: every port served is on the start line
            "tls_urls": daemon.tls_urls,
            # added in 0.4: the lease authority, or why not
            "authority": daemon.authority,
            "interfaces": daemon.interfaces,
            "session": config.session,
            "hostname": daemon.hostname,
            "node_id": daemon.node_id,
            "service": daemon.announcer.info.name if daemon.announcer and daemon.announcer.info else None,
            "started": daemon.started_at,
            "state_dir": str(state_dir or daemon.state_dir),
            "simulated": bool(daemon.snapshot and daemon.snapshot.simulated),
            "options": config.options(),
        }
        write_info(daemon.state_dir, info)
        notify_ready(ready_fd, info)
        _log().info("gpusd daemon ready: pid %d, %s", os.getpid(), serving_line(info))
        await stop_event.wait()
        sd_notify("STOPPING=1")
        _log().info("stopping")
        await asyncio.wait_for(daemon.stop(), 15)
        return 0
    except BaseException:
        try:
            await asyncio.wait_for(daemon.stop(), 10)
        except Exception:
            pass
        raise
    finally:
        try:
            (daemon.state_dir / INFO_FILE).unlink()
        except OSError:
            pass
        pid.release()
