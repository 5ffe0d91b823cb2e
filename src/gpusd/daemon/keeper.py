"""The keeper: a small process that co-holds the remote leases' lock descriptors (docs/pool.md).

Where no service manager keeps descriptors for the daemon (:mod:`gpusd.daemon.fdstore`), the daemon
starts ``python -m gpusd.daemon.keeper STATE_DIR FD`` in a session of its own, on a listening Unix
socket it made (``STATE_DIR/keeper.sock``, inherited as descriptor ``FD``).  The daemon gives it copies of each
remote lease's lock descriptors; the flocks belong to the open files, so they stay held while either
process holds a copy: a lease outlives the daemon's crash or restart, and a keeper that dies takes
nothing with it while the daemon runs.  A restarted daemon asks for the copies back.

One request per connection, a JSON line (at most 4 KiB) answered by one line; only a peer of the
keeper's own user (``SO_PEERCRED``) is served, each connection within :data:`TIMEOUT`:

* ``{"op": "hold", "name": ID}`` with the descriptors (``SCM_RIGHTS``): hold them as ``ID`` (replacing
  what was held so) — ``ok``;
* ``{"op": "drop", "name": ID}``: close them — ``ok``;
* ``{"op": "list"}``: ``{"names": [...], "pid": PID}``;
* ``{"op": "give", "name": ID}``: ``{"count": N}`` with copies of them (the keeper keeps holding).

It lets go of a lease by itself when the daemon's record of it (``STATE_DIR/remote-leases``,
:mod:`gpusd.daemon.poolstate`) is gone or says it expired (boot-time clock) more than
:data:`GRACE` seconds ago, so a lease no daemon takes back ends on time; and it exits when it holds
nothing (for :data:`IDLE_EXIT` seconds: the next lease often follows).  Imports only the standard
library.
"""

# Imports inside functions: memory at rest (loaded on request).
from __future__ import annotations

import array
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from .poolstate import read_expiry

SOCKET_NAME = "keeper.sock"
# seconds: the bound on every exchange with the keeper, either side
TIMEOUT = 2.0
# seconds past a record's expiry before the keeper lets go (the daemon ends it first)
GRACE = 2.0
# seconds between the keeper's looks at the records
TICK = 1.0
# seconds a keeper holding nothing waits before it exits (a new lease often follows)
IDLE_EXIT = 10.0
MAX_LINE = 4096
# per message (the kernel's SCM_MAX_FD is 253)
MAX_FDS = 250
MAX_NAMES = 4096


def _recv(conn: socket.socket) -> tuple[bytes, list[int]]:
    """One line and the descriptors that came with it (bounded)."""
    data, fds = b"", array.array("i")
    fd_size = array.array("i").itemsize
    while b"\n" not in data and len(data) <= MAX_LINE:
        msg, anc, _flags, _addr = conn.recvmsg(MAX_LINE, socket.CMSG_SPACE(MAX_FDS * fd_size), socket.MSG_CMSG_CLOEXEC)
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(payload[: len(payload) - len(payload) % fd_size])
                fds.extend(got)
        if not msg:
            break
        data += msg
    return data.split(b"\n", 1)[0], list(fds)


def _close(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


# -- the keeper process -------------------------------------------------------------------------
class Keeper:
    def __init__(self, state_dir: Path, listener: socket.socket) -> None:
        self.state_dir = state_dir
        self.listener = listener
        self.held: dict[str, list[int]] = {}

    def _expired(self, name: str, now: float) -> bool:
        """The daemon's record of ``name`` is gone or damaged (released), or it expired more than GRACE
        ago and no process runs under the lease any more: with no daemon to stop a cut-off holder's
        processes (fencing, :mod:`gpusd.daemon.fence`), its GPUs stay held while one of them runs."""
        if not name.startswith("lease-"):
            return True
        expires = read_expiry(self.state_dir, name[6:])
        if expires is None:
            return True
        if expires + GRACE >= now:
            return False
        from .fence import lease_processes

        return not lease_processes(name[6:])

    def sweep(self) -> None:
        now = time.clock_gettime(time.CLOCK_BOOTTIME)
        for name in [n for n in self.held if self._expired(n, now)]:
            _close(self.held.pop(name))

    def serve_one(self, conn: socket.socket) -> None:
        conn.settimeout(TIMEOUT)
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        _pid, uid, _gid = array.array("i", creds)
        line, fds = _recv(conn)
        if uid != os.geteuid():
            _close(fds)
            return
        try:
            req = json.loads(line)
            op, name = req.get("op"), req.get("name")
        except (ValueError, AttributeError, RecursionError):
            _close(fds)
            return
        if op in ("hold", "drop", "give") and (not isinstance(name, str) or not 0 < len(name) <= 128):
            _close(fds)
            return
        if op == "hold" and fds and (name in self.held or len(self.held) < MAX_NAMES):
            _close(self.held.pop(name, []))
            self.held[name] = fds
            conn.sendall(b"ok\n")
            return
        _close(fds)
        if op == "drop":
            _close(self.held.pop(name, []))
            conn.sendall(b"ok\n")
        elif op == "list":
            conn.sendall(json.dumps({"names": sorted(self.held), "pid": os.getpid()}).encode() + b"\n")
        elif op == "give":
            mine = self.held.get(name, [])[:MAX_FDS]
            anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", mine).tobytes())] if mine else []
            conn.sendmsg([json.dumps({"count": len(mine)}).encode() + b"\n"], anc)

    def run(self) -> int:
        # when it last held nothing
        idle_since = time.monotonic()
        last_sweep = 0.0
        while True:
            ready, _, _ = select.select([self.listener], [], [], TICK)
            if ready:
                try:
                    conn, _ = self.listener.accept()
                except OSError:
                    conn = None
                if conn is not None:
                    with conn:
                        try:
                            self.serve_one(conn)
                        except OSError:
                            pass
            if time.monotonic() - last_sweep >= TICK:
                self.sweep()
                last_sweep = time.monotonic()
            if self.held:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since > IDLE_EXIT:
                return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or not args[1].isdigit():
        print("usage: python -m gpusd.daemon.keeper STATE_DIR FD (started by the daemon)", file=sys.stderr)
        return 2
    # the daemon's terminal is not ours
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    listener = socket.socket(fileno=int(args[1]))
    listener.setblocking(False)
    return Keeper(Path(args[0]), listener).run()


# -- the daemon's side ---------------------------------------------------------------------------
class KeeperError(OSError):
    pass


class KeeperClient:
    """The daemon's link to its keeper (every call bounded by :data:`TIMEOUT`; blocking: call it
    off the event loop)."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = Path(state_dir)
        self.path = self.state_dir / SOCKET_NAME
        # the keeper's (it says it)
        self.pid: int | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    def _connect(self) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        s.settimeout(TIMEOUT)
        try:
            s.connect(str(self.path))
            # the credentials of whoever listened: us, or a daemon of ours before (never another user)
            _pid, uid, _gid = array.array("i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            if uid != os.geteuid():
                raise KeeperError(f"{self.path} is served by uid {uid}, not by us")
            return s
        except BaseException:
            s.close()
            raise

    def _ask(self, req: dict[str, object], fds: list[int] | None = None) -> tuple[bytes, list[int]]:
        with self._connect() as s:
            anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
            s.sendmsg([json.dumps(req).encode() + b"\n"], anc)
            line, got = _recv(s)
            if not line:
                _close(got)
                raise KeeperError("the keeper closed the connection")
            return line, got

    def running(self) -> bool:
        """Whether a keeper answers (its pid noted: the listening socket's credentials are the
        daemon's that made it, so the keeper says its own)."""
        try:
            line, _ = self._ask({"op": "list"})
        except OSError:
            return False
        try:
            pid = json.loads(line).get("pid")
        except (ValueError, AttributeError):
            return False
        if type(pid) is int and pid > 1:
            self.pid = pid
        return True

    def start(self) -> None:
        """Start a keeper on a socket made here (any keeper answering there is asked first)."""
        if self.running():
            return
        try:
            # a dead keeper's socket (nothing answers on it)
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            old = os.umask(0o077)
            try:
                listener.bind(str(self.path))
            finally:
                os.umask(old)
            listener.listen(16)
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gpusd.daemon.keeper", str(self.state_dir), str(listener.fileno())],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True, pass_fds=(listener.fileno(),))
            self.pid = self.proc.pid
        finally:
            listener.close()

    def hold(self, name: str, fds: list[int]) -> None:
        line, _ = self._ask({"op": "hold", "name": name}, fds)
        if line != b"ok":
            raise KeeperError(f"the keeper refused to hold {name}")

    def drop(self, name: str) -> None:
        self._ask({"op": "drop", "name": name})

    def names(self) -> list[str]:
        line, _ = self._ask({"op": "list"})
        try:
            names = json.loads(line).get("names")
        except (ValueError, AttributeError):
            return []
        return [n for n in names if isinstance(n, str)] if isinstance(names, list) else []

    def give(self, name: str) -> list[int]:
        _line, fds = self._ask({"op": "give", "name": name})
        return fds

    def kill(self) -> None:
        """End a keeper that did not answer within the bound (its copies close with it).  Only a
        process that is surely it: our child not yet reaped, or a process whose command line is this
        keeper's for this state directory (a pid alone may have been reused)."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
                try:
                    self.proc.wait(TIMEOUT)
                except subprocess.TimeoutExpired:
                    pass
        elif self.pid is not None and self._is_keeper(self.pid):
            try:
                os.kill(self.pid, signal.SIGKILL)
            except OSError:
                pass
        self.proc = self.pid = None

    def _is_keeper(self, pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read(8192).split(b"\0")
            st = os.stat(f"/proc/{pid}")
        except OSError:
            return False
        return st.st_uid == os.geteuid() and b"gpusd.daemon.keeper" in argv and \
            os.fsencode(str(self.state_dir)) in argv

    def reap(self) -> None:
        """Collect a keeper that exited (it was our child)."""
        if self.proc is not None and self.proc.poll() is not None:
            self.proc = None


if __name__ == "__main__":
    sys.exit(main())
