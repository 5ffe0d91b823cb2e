"""Leases through the local daemon: the client side of the lease socket.

Where a gpusd daemon runs (as root), it is the lease authority of its machine: ``gpusd run`` and
``gpusd.select`` ask it over a Unix socket (``$GPUSD_LEASE_SOCKET``, default
``/run/gpusd/lease.sock``) instead of writing in the shared lock directory themselves.  The daemon
learns who asks from the kernel (``SO_PEERCRED``), takes the very same flock leases on the client's
behalf (so leases through the daemon and leases through the directory never overlap), and keeps them
while the client's connection is open: the lease ends when the last process holding the connection
exits, however it exits.  It passes copies of the lease's lock descriptors with its answer, which the
client keeps (:class:`RemoteLease`), so the lease outlives the daemon.  ``gpusd run`` hands the
connection and those copies to its command, as it hands flock descriptors.

The protocol (one JSON object per line, UTF-8, documented in docs/allocation.md):

    client -> {"op": "lease", "v": 2, "count": 1, "min_free": null, "memory": null, "max_util": null,
               "max_processes": null, "include": null, "exclude": null, "mig": false, "by": "load",
               "shared": false, "topology": "auto", "visible": null, "wait": false, "timeout": null, "command": "...",
               "job": "3f9c0a1b22de"}
    daemon -> {"ok": true, "v": 2, "lease_id": "...", "job": "...", "devices": [{"gpu": {...},
               "mig": null, "free": ..., "total": ..., "util": ...}], "fds": ["GPU-...", "record"]}
           or {"ok": false, "code": "no_gpu", "error": "no_gpu" | "timeout" | "usage" | "busy" | "error",
               "message": "..."}   (code: the error's own, docs/errors.md; error: the 0.2 kind)

The client closes the connection to release the lease.  On ``busy`` (too many requests open) the
client takes its lease in the lock directory instead.  Protocol 2 (both sides said ``"v": 2``): the
connection that holds the lease takes further requests, answered in order, each answer carrying the
request's ``id``:

    client -> {"op": "grow", "id": 1, "count": 2, ...the constraints of a lease request..., "wait": false,
               "timeout": null}
    daemon -> {"ok": true, "id": 1, "op": "grow", "lease_id": "...", "devices": [...the GPUs added...],
               "held": ["GPU-...", ...]}
    client -> {"op": "release", "id": 2, "device": "GPU-..."}
    daemon -> {"ok": true, "id": 2, "op": "release", "lease_id": "...", "held": [...]}
    client -> {"op": "mark", "id": 3, "ended": "timed_out"}    (0.4, additive: how the lease ends, for the
    daemon -> {"ok": true, "id": 3, "op": "mark"}                  history; the client then closes the connection)

A request ``{"op": "choose", ...the fields of a lease request...}`` asks only which GPUs the daemon
would give (``gpusd select``, ``gpusd env``): the answer is a lease's without ``lease_id``, with
``explain`` (why these GPUs: :meth:`gpusd.alloc.placement.Pick.to_dict`), and the
connection ends with it (a daemon from before ``choose`` refuses it as a ``usage`` error: the client
then chooses itself).

With protocol 1 (an older daemon: no ``v`` in its answer) anything sent after the answer releases
the lease, so this client sends nothing more there: :meth:`RemoteLease.grow` refuses instead.

A waiting request whose daemon stops gets ``{"op": "requeue", ...}`` (or the end of the connection,
when the daemon was killed): the client asks the next daemon (:func:`reconnect`, at most
:data:`REQUEUE_WAIT` seconds, else the lock directory) with ``"requeue": true``, and that daemon first
says whether it kept the client's place (``{"op": "requeued", "kept": true}``), matched by the
connection's pid and uid from the kernel, never by the request.

The client uses the socket only when it is a socket owned by root or by the client's own user, and
the process answering is one of those (``SO_PEERCRED`` again); otherwise it falls back to the lock
directory.  ``GPUSD_LEASE_SOCKET=off`` disables the daemon path.
"""

# Imports inside functions: start-up (quick commands import this module).
from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

from ..errors import ConfigError, GpusdError, from_wire
from ..inventory.vendors import DEFAULT_VENDOR, INHERITED_OTHERS
from ..model import GpuInfo, HostSnapshot, MigInstance
from .handle import Holder, LeaseHandle
from .select import Candidate, Constraints

# typing is not imported at run time: start-up time
TYPE_CHECKING = False

if TYPE_CHECKING:
    import socket
    from typing import Any, Callable

    from .placement import Pick

DEFAULT_SOCKET = "/run/gpusd/lease.sock"
PROTOCOL = 2
# the reply carries the chosen GPUs: a few KiB
MAX_LINE = 1 << 20
CONNECT_TIMEOUT = 2.0
# beyond the client's own timeout and the mutex bound
REPLY_SLACK = 30.0
# A daemon that accepted a request but says nothing for this long is asked whether it is alive (a
# second connection, answered by its event loop at once whatever the first waits for); one that does
# not answer that either is hung (stopped, say): the client leases in the lock directory instead.
HUNG_AFTER = 2.0
PROBE_TIMEOUT = 1.0
# a long wait asks again at growing intervals, up to this
PROBE_MAX = 30.0
# how long a change waits for another one on the same lease to end
BUSY_WAIT = 10.0
# answers to other requests skipped while looking for ours
MAX_STRAY = 64
# descriptors a hand-over may carry (a lease has at most 64 devices)
MAX_FDS = 256
# how long a waiter whose daemon stopped looks for the next one before the lock directory
REQUEUE_WAIT = 20.0
REQUEUE_POLL = 0.1
# struct ucred: pid, uid, gid
_CRED = "3i"


def socket_path() -> Path | None:
    """Where the daemon's lease socket is (None: the daemon path is turned off)."""
    raw = os.environ.get("GPUSD_LEASE_SOCKET")
    if raw is not None and raw.strip().lower() in ("", "off", "none", "0"):
        return None
    return Path(raw or DEFAULT_SOCKET)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end, from the kernel."""
    import socket
    import struct

    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize(_CRED))
    pid, uid, gid = struct.unpack(_CRED, raw)
    return pid, uid, gid


def connect(path: Path | None = None) -> socket.socket | None:
    """A connection to a trustworthy lease authority, or None (no daemon: use the lock directory)."""
    path = path or socket_path()
    if path is None:
        return None
    me = os.geteuid()
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid not in (0, me):
        # not the daemon's: someone else's file is never trusted with a lease
        return None
    # only where a daemon serves leases
    import socket

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(CONNECT_TIMEOUT)
        sock.connect(str(path))
        _, uid, _ = peer_credentials(sock)
        if uid not in (0, me):
            raise OSError("the lease socket is served by another user")
    except OSError:
        sock.close()
        return None
    return sock


class RemoteLease(LeaseHandle):
    """A lease the daemon holds for us while :attr:`sock` is open (a :class:`LeaseHandle`, like
    :class:`gpusd.alloc.leases.Lease`).

    The daemon passes copies of the lease's lock descriptors with its answers (``SCM_RIGHTS``, named
    in the answer's ``fds``: a device's UUID, ``"record"``); they are kept here (:attr:`fds`), so
    that the kernel keeps the lease if the daemon dies (``kill -9``) or stops; it still ends with
    our connection (the daemon then unlocks every copy).  With protocol 2 it can grow and give GPUs
    back (:meth:`grow`, :meth:`give_back`), one change at a time, while the daemon that granted it
    runs.  The record is the daemon's: it wrote what the request said (:attr:`holder`)."""

    def __init__(self, lease_id: str, devices: list[str], shared: bool, memory: int | None,
                 sock: socket.socket, version: int = 1, reader: _Lines | None = None,
                 holder: Holder | None = None) -> None:
        self.lease_id, self.devices, self.shared, self.memory, self.sock = lease_id, devices, shared, memory, sock
        self.holder = holder or Holder()
        self.version = version
        self.released = False
        self.handed_over = False
        self.reader = reader or _Lines(sock)
        self.lock = threading.Lock()
        self.next_id = 1
        # each GPU's epoch, as the daemon's answers said (alloc.epoch)
        self.epoch_of: dict[str, int] = {}
        # the lease's descriptors the daemon passed, by name
        self.kept: dict[str, int] = {}

    def epochs(self) -> dict[str, int]:
        return {d: e for d, e in self.epoch_of.items() if d in self.devices}

    def took(self, answer: dict[str, Any]) -> None:
        """Keep the epochs a grant (or grow) answer names: positive 64-bit numbers of our GPUs."""
        raw = answer.get("epochs")
        if isinstance(raw, dict):
            for k, v in list(raw.items())[:64]:
                if isinstance(k, str) and type(v) is int and 0 < v < 2**63:
                    self.epoch_of[k] = v

    def absorb(self, reply: dict[str, Any]) -> None:
        """Keep the descriptors that came with ``reply`` under the names its ``fds`` gives them (a
        newer copy of one replaces the older: the record rewritten).  Descriptors without a name (a
        hand-over from an older daemon) stay in the reader, kept too."""
        names = reply.get("fds")
        if not isinstance(names, list) or not names:
            return
        got = self.reader.fds[:len(names)]
        del self.reader.fds[:len(got)]
        for name, fd in zip(names, got):
            key = name[:128] if isinstance(name, str) else f"#{fd}"
            old = self.kept.pop(key, None)
            if old is not None:
                _close(old)
            self.kept[key] = fd

    @property
    def fds(self) -> list[int]:
        """What keeps the lease alive: handed to ``gpusd run``'s command like flock descriptors."""
        return [] if self.released else [self.sock.fileno(), *self.kept.values(), *self.reader.fds]

    def release(self) -> None:
        if not self.released:
            self.released = True
            # Our copies of the locks first, then the connection (the daemon unlocks every copy anyway)
            for fd in [*self.kept.values(), *self.reader.fds]:
                _close(fd)
            self.kept, self.reader.fds = {}, []
            # the daemon sees the end of the connection and releases
            self.sock.close()

    def grow(self, c: Constraints, *, wait: bool = False, timeout: float | None = None) -> list[Candidate]:
        """``c.count`` more GPUs (chosen with ``c``) under this lease; raises what a lease request
        would raise (NoGpuAvailable, WaitTimeout, ConfigError, GpusdError)."""
        answer = self._ask(dict(request(c), op="grow", wait=wait, timeout=timeout), wait, timeout)
        try:
            chosen = _candidates(answer)
        except ValueError as exc:
            raise GpusdError(f"the gpusd daemon's lease socket answered something unreadable ({exc})") from None
        self.devices.extend(x.uuid for x in chosen)
        self.took(answer)
        return chosen

    def give_back(self, uuid: str) -> None:
        """Give one GPU of this lease back: the daemon frees it at once (and its record stops naming it)."""
        answer = self._ask({"op": "release", "device": uuid}, False, None)
        gone = self.kept.pop(uuid, None)
        # unlocked by the daemon already: our copy is only a descriptor now
        if gone is not None:
            _close(gone)
        held = answer.get("held")
        if isinstance(held, list) and all(isinstance(x, str) for x in held):
            self.devices = list(held)
        elif uuid in self.devices:
            self.devices.remove(uuid)

    def mark(self, how: str) -> None:
        """Tell the daemon how this lease ends before it does (``timed_out``: its job's ``--time`` ran
        out), for the history; GpusdError where the daemon cannot (an older one refuses the request)."""
        self._ask({"op": "mark", "ended": how}, False, None)

    def update(self, **changes: Any) -> None:
        """The daemon keeps this lease's record, as the request described the holder; only what it
        says already can be "changed" (GpusdError otherwise: the lease socket has no such request)."""
        if self.released:
            raise GpusdError("the lease has ended")
        differ = sorted(k for k, v in changes.items() if getattr(self.holder, k, object()) != v)
        if differ:
            raise GpusdError(f"the gpusd daemon keeps this lease's record: {', '.join(differ)[:200]} cannot change")

    def _ask(self, req: dict[str, Any], wait: bool, timeout: float | None) -> dict[str, Any]:
        import json

        from .lockdir import mutex_timeout

        if self.released:
            raise GpusdError("the lease has ended")
        if self.version < 2:
            raise GpusdError("the gpusd daemon holding this lease is older than this gpusd (lease protocol "
                             f"{self.version}): restart it to grow or shrink leases through it")
        if self.handed_over:
            raise GpusdError("the gpusd daemon stopped and handed this lease over: it lasts until the job ends, "
                             "but can no longer grow or shrink")
        if not self.lock.acquire(timeout=BUSY_WAIT):
            raise GpusdError("another change of this lease is in progress (a grow waiting for GPUs?); try again "
                             "when it is done")
        try:
            rid, self.next_id = self.next_id, self.next_id + 1
            try:
                self.sock.settimeout(None if (wait and timeout is None) else
                                     (timeout or 0.0) + mutex_timeout() + REPLY_SLACK)
                try:
                    self.sock.sendall(json.dumps({**req, "id": rid}).encode() + b"\n")
                except (BrokenPipeError, ConnectionResetError):
                    # the daemon closed its end: it stopped
                    self.handed_over = True
                    raise GpusdError("the gpusd daemon that held this lease stopped (it handed the lease over: "
                                     "it lasts until the job ends, but can no longer grow or shrink)") from None
                for _ in range(MAX_STRAY):
                    try:
                        reply = _decode(self.reader.readline())
                    except _Closed:
                        if not self.kept:
                            raise
                        # killed, say: we hold the descriptors, the kernel the lease
                        self.handed_over = True
                        raise GpusdError("the gpusd daemon that granted this lease is gone: the lease lasts until "
                                         "the job ends, but can no longer grow or shrink") from None
                    self.absorb(reply)
                    if reply.get("op") == "handover":
                        self.handed_over = True
                        raise GpusdError("the gpusd daemon stopped and handed this lease over: it lasts until the "
                                         "job ends, but can no longer grow or shrink")
                    if reply.get("id") == rid:
                        break
                else:
                    raise OSError("no answer to our request")
            except (OSError, ValueError) as exc:
                raise GpusdError(f"the gpusd daemon's lease socket failed: {exc}") from None
            finally:
                try:
                    self.sock.settimeout(None)
                except OSError:
                    pass
            _check(reply)
            return reply
        finally:
            self.lock.release()

    def __enter__(self) -> RemoteLease:
        return self

    # a dropped Selection must not keep its GPUs
    def __del__(self) -> None:
        try:
            self.release()
        except Exception:
            pass


class _Lines:
    """Lines from the daemon, and any descriptors that come with them (a hand-over: kept, since
    closing them would end the lease)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""
        self.fds: list[int] = []

    def readline(self) -> bytes:
        import socket

        while b"\n" not in self.buf:
            data, fds, _flags, _addr = socket.recv_fds(self.sock, 65536, MAX_FDS, socket.MSG_CMSG_CLOEXEC)
            self.fds.extend(fds)
            if not data:
                raise _Closed("the daemon closed the connection")
            self.buf += data
            if len(self.buf) > MAX_LINE:
                raise OSError("reply too long")
        line, self.buf = self.buf.split(b"\n", 1)
        return line + b"\n"


class _Closed(OSError):
    """The daemon closed the connection (it stopped, or was killed)."""


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


class AuthorityBusy(Exception):
    """The daemon has too many requests open: take the lease in the lock directory instead."""


class AuthorityHung(Exception):
    """The daemon accepted the request but does not answer, nor a second connection (it is stopped or
    hung): the request was abandoned (its connection closed, so a daemon that resumes drops it) and
    the lease is taken in the lock directory instead.  The message says so, in one line."""


def _stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (SIGSTOP) or traced, as /proc says (False when it cannot tell)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read(4096)
        return raw[raw.rindex(b")") + 2:][:1] in (b"T", b"t")
    except (OSError, ValueError):
        return False


def _alive(sock: socket.socket) -> bool:
    """Whether the daemon behind ``sock`` still answers: a second connection to the same socket gets
    an answer within :data:`PROBE_TIMEOUT` (any line: a daemon answers a request it does not know at
    once, from its event loop, whatever else it is doing)."""
    import socket

    try:
        pid, _, _ = peer_credentials(sock)
        path = sock.getpeername()
    except OSError:
        return False
    if pid > 0 and _stopped(pid):
        return False
    if not isinstance(path, str) or not path:
        # cannot ask again: believe it
        return True
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        probe.settimeout(PROBE_TIMEOUT)
        probe.connect(path)
        probe.sendall(b'{"op": "ping", "v": 2}\n')
        return bool(probe.recv(1))
    except OSError:
        return False
    finally:
        probe.close()


class DaemonGone(Exception):
    """The daemon ended a waiting request's connection without an answer (it stopped, or died): the
    waiter asks the next daemon (:func:`reconnect`), which keeps its place, or the lock directory."""


def say(message: str) -> None:
    """One line on stderr: what happened to a wait that the caller would otherwise not know."""
    import sys

    print(f"gpusd: {message}", file=sys.stderr, flush=True)


def reconnect(bound: float, cancelled: Callable[[], bool] | None = None) -> socket.socket | None:
    """A connection to the next lease authority within ``bound`` seconds (the daemon restarting), or
    None (none came, or ``cancelled()``)."""
    import time

    end = time.monotonic() + bound
    while True:
        sock = connect()
        if sock is not None:
            return sock
        if (cancelled is not None and cancelled()) or time.monotonic() >= end:
            return None
        time.sleep(min(REQUEUE_POLL, max(0.0, end - time.monotonic())))


def request(c: Constraints) -> dict[str, Any]:
    """The constraints as the protocol carries them (``visible``: this process's inherited
    ``CUDA_VISIBLE_DEVICES``, which the daemon cannot see)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if c.within_visible else None
    # the other vendors' inherited device lists (added in 0.4: an older daemon ignores the key)
    others = {k: os.environ[k] for k in INHERITED_OTHERS if k in os.environ} if c.within_visible else {}
    return {"op": "lease", "v": PROTOCOL, "count": c.count, "min_free": c.min_free, "memory": c.memory,
            "max_util": c.max_util, "max_processes": c.max_processes,
            "include": list(c.include) if c.include is not None else None,
            "exclude": list(c.exclude) if c.exclude is not None else None,
            "mig": c.mig, "by": c.by, "shared": c.shared, "topology": c.topology, "visible": visible,
            # older daemons ignore it
            **({"vendor": c.vendor} if c.vendor is not None else {}),
            # backfill; older daemons ignore it
            **({"time_limit": c.time_limit} if c.time_limit is not None else {}),
            **({"visible_vars": others} if others else {})}


def lease_through(sock: socket.socket, c: Constraints, *, wait: bool, timeout: float | None,
                  holder: Holder, priority: int | None = None,
                  requeue: bool = False) -> tuple[list[Candidate], RemoteLease]:
    """Ask the daemon for a lease for ``holder`` (this process: its ``command``, and the gpusd job
    ``job``, a :class:`gpusd.ids.JobId`, named in the lease's record); raises what a local allocation would raise.
    ``requeue``: we waited at a daemon that stopped (the daemon then says whether it kept our place,
    and we say so on stderr); with ``wait``, :class:`DaemonGone` when this one stops too."""
    job = holder.job
    req = dict(request(c), wait=wait, timeout=timeout, command=holder.command)
    if job is not None:
        from ..ids import JobId

        req["job"] = JobId.parse(job)
    if priority is not None:
        # the daemon believes it up to the policy's bound for our uid
        req["priority"] = priority
    if requeue:
        req["requeue"] = True
    reader = _Lines(sock)
    line = _answer(sock, reader, req, wait, timeout)
    try:
        reply = _decode(line)
        if reply.get("ok") is not True and reply.get("error") == "busy":
            raise AuthorityBusy()
        _check(reply)
        chosen = _candidates(reply)
        lease_id = reply.get("lease_id")
        if not isinstance(lease_id, str) or not chosen:
            raise ValueError("no lease")
    except ValueError as exc:
        sock.close()
        raise GpusdError(f"the gpusd daemon's lease socket answered something unreadable ({exc})") from None
    except BaseException:
        sock.close()
        raise
    v = reply.get("v")
    # an older daemon says nothing: protocol 1
    version = v if type(v) is int and v >= 1 else 1
    lease = RemoteLease(lease_id, [x.uuid for x in chosen], c.shared, c.memory, sock, min(version, PROTOCOL),
                        reader, holder)
    lease.took(reply)
    # the lease's descriptors came with the answer: ours to keep from now on
    lease.absorb(reply)
    _note_simulated(reply)
    return chosen, lease


def choose_through(sock: socket.socket, c: Constraints, *, wait: bool, timeout: float | None,
                   command: str | None = None, priority: int | None = None,
                   requeue: bool = False) -> tuple[list[Candidate], Pick | None]:
    """Ask the daemon which GPUs it would give for ``c``, taking no lease (``gpusd select``, ``env``,
    ``gpusd.select(lease=False)``): its inventory (real or simulated), the leases of the lock
    directory, the same queue with ``wait``.  Raises what a local choice would raise;
    :class:`AuthorityBusy` where the daemon is busy or too old to answer a choice (choose here then).
    With the chosen devices comes the daemon's reason for them (``explain``), when it gives one."""
    from .placement import Pick

    req = dict(request(c), op="choose", wait=wait, timeout=timeout, command=command)
    if priority is not None:
        req["priority"] = priority
    if requeue:
        req["requeue"] = True
    try:
        line = _answer(sock, _Lines(sock), req, wait, timeout)
    finally:
        # a choice holds nothing
        sock.close()
    try:
        reply = _decode(line)
        if reply.get("ok") is not True and (reply.get("error") == "busy" or (
                reply.get("error") == "usage" and "unknown request" in str(reply.get("message")))):
            # a daemon from before "choose" answers a usage error
            raise AuthorityBusy()
        _check(reply)
        chosen = _candidates(reply)
        if not chosen:
            raise ValueError("no devices")
    except ValueError as exc:
        raise GpusdError(f"the gpusd daemon's lease socket answered something unreadable ({exc})") from None
    _note_simulated(reply)
    return chosen, Pick.from_dict(reply.get("explain"), chosen)


def _note_simulated(reply: dict[str, Any]) -> None:
    """One line where the local daemon answered with simulated GPUs that this process did not ask for
    (no ``--simulate``, no ``$GPUSD_SIMULATE``): they are not GPUs a job can use."""
    if reply.get("simulated") is True and not os.environ.get("GPUSD_SIMULATE"):
        say("these are the local gpusd daemon's SIMULATED GPUs (it was started with --simulate): no real GPU "
            "was chosen")


class DaemonInventory:
    """The daemon's GPUs read over the lease socket (``{"op": "snapshot"}``): the inventory backend
    (:class:`gpusd.inventory.Backend`) of a process on a host where the daemon reads the GPUs and
    this process cannot (no driver library here: the daemon's GPUs are simulated, or only it may
    load the driver), so that leases it takes in the lock directory (``gpusd run --preemptible``,
    growing such a job) choose among the daemon's GPUs.  Each :meth:`snapshot` asks again."""

    backend = "daemon"

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        first = self.snapshot()
        self.hostname, self.node_id = first.hostname, first.node_id
        self.vendors = tuple(dict.fromkeys(g.vendor for g in first.gpus)) or (DEFAULT_VENDOR,)  # inventory.backend

    def snapshot(self, util_since: Any = None, detail: bool = True) -> HostSnapshot:
        from ..errors import BackendUnavailable

        sock = connect(self.path)
        if sock is None:
            raise BackendUnavailable("the gpusd daemon's lease socket does not answer")
        try:
            line = _send(sock, _Lines(sock), {"op": "snapshot", "v": PROTOCOL}, False, None)
        except AuthorityHung as exc:
            raise BackendUnavailable(str(exc)) from None
        finally:
            sock.close()
        try:
            reply = _decode(line)
            _check(reply)
            data = reply.get("snapshot")
            if not isinstance(data, dict):
                raise ValueError("no snapshot")
            return HostSnapshot.from_dict(data)
        except (ValueError, TypeError, KeyError, ConfigError) as exc:
            # ConfigError: a daemon without "snapshot"
            raise BackendUnavailable(f"the gpusd daemon did not give its GPUs ({exc})") from None

    def close(self) -> None:
        pass

    def __enter__(self) -> DaemonInventory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def daemon_inventory() -> DaemonInventory | None:
    """:class:`DaemonInventory` where a daemon serves the lease socket and gives its GPUs, else None."""
    from ..errors import BackendUnavailable

    if socket_path() is None:
        return None
    try:
        return DaemonInventory()
    except (BackendUnavailable, GpusdError):
        return None


def _send(sock: socket.socket, reader: _Lines, req: dict[str, Any], wait: bool, timeout: float | None) -> bytes:
    """Send one request line, read the answer line (the socket is closed when that fails;
    :class:`DaemonGone` when the daemon ended a wait without answering)."""
    # here: without a daemon's socket, this module is imported but never talks
    import json

    try:
        # a request line fits the socket's buffer: a send that blocks is a hang
        sock.settimeout(HUNG_AFTER)
        sock.sendall(json.dumps(req).encode() + b"\n")
    except BrokenPipeError:
        # answered before it read us (busy), or gone: what it said (or its end) is read below
        pass
    except OSError as exc:
        sock.close()
        raise GpusdError(f"the gpusd daemon's lease socket failed: {exc}") from None
    return _read(sock, reader, wait, timeout)


def _read(sock: socket.socket, reader: _Lines, wait: bool, timeout: float | None) -> bytes:
    """The next answer line.  Silence past :data:`HUNG_AFTER` is checked: a daemon that is stopped or
    hung costs the client a few seconds (:class:`AuthorityHung`), a slow or waiting one is waited for;
    a daemon that ends a wait without answering (it stops, or died) is :class:`DaemonGone`."""
    import time

    from .lockdir import mutex_timeout

    limit = None if (wait and timeout is None) else (timeout or 0.0) + mutex_timeout() + REPLY_SLACK
    start = time.monotonic()
    gap = HUNG_AFTER
    try:
        while True:
            left = None if limit is None else limit - (time.monotonic() - start)
            if left is not None and left <= 0:
                raise TimeoutError("timed out")
            sock.settimeout(gap if left is None else max(0.001, min(gap, left)))
            try:
                line = reader.readline()
                break
            except TimeoutError:
                if left is not None and left <= gap:
                    raise
                # Silence: a wait, a slow answer, or a daemon that is stopped or hung.  Only the last
                # must not cost the client more than a few seconds (docs/allocation.md, "A hung daemon").
                if not _alive(sock):
                    pid = _peer_pid(sock)
                    sock.close()
                    raise AuthorityHung(f"the gpusd daemon{f' (pid {pid})' if pid else ''} accepted the request "
                                        f"but has not answered for {time.monotonic() - start:.0f}s (stopped or "
                                        "hung)") from None
                gap = min(gap * 2, PROBE_MAX)
        sock.settimeout(None)
    except OSError as exc:
        sock.close()
        if wait and isinstance(exc, (_Closed, ConnectionResetError)):
            raise DaemonGone() from None
        raise GpusdError(f"the gpusd daemon's lease socket failed: {exc}") from None
    return line


def _peer_pid(sock: socket.socket) -> int:
    try:
        return peer_credentials(sock)[0]
    except OSError:
        return 0


def _answer(sock: socket.socket, reader: _Lines, req: dict[str, Any], wait: bool, timeout: float | None) -> bytes:
    """:func:`_send`, then the answer past the notes about the queue a waiter may get first: that a
    stopping daemon ends our wait (:class:`DaemonGone`), or whether the next one kept our place."""
    line = _send(sock, reader, req, wait, timeout)
    for _ in range(MAX_STRAY):
        try:
            note = _decode(line)
        except ValueError:
            # the caller says what is wrong with it
            return line
        op = note.get("op")
        # the daemon stops: it keeps our place for the next one
        if wait and op == "requeue":
            sock.close()
            raise DaemonGone()
        if op != "requeued" or not req.get("requeue"):
            return line
        say("the gpusd daemon restarted while this job waited: queued there again, "
            + ("in its place" if note.get("kept") is True else
               "behind the jobs queued there (the daemon did not know this job's place)"))
        line = _read(sock, reader, wait, timeout)
    sock.close()
    raise GpusdError("the gpusd daemon's lease socket sent too many notes")


def _decode(line: bytes) -> dict[str, Any]:
    from ..sanitize import json_object

    try:
        return json_object(line)
    except ValueError as exc:
        raise ValueError(f"an answer that is {exc}") from None


def _check(reply: dict[str, Any]) -> None:
    """Raise what a refusal means (its code, or a 0.2 daemon's kind; the message sanitised)."""
    if reply.get("ok") is True:
        return
    raise from_wire(reply)


def _candidates(reply: dict[str, Any]) -> list[Candidate]:
    try:
        return [Candidate(GpuInfo.from_dict(d["gpu"]), MigInstance.from_dict(d["mig"]) if d.get("mig") else None,
                          _int(d.get("free")), _int(d.get("total")), _num(d.get("util")))
                for d in reply["devices"]]
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(str(exc)) from None


def _int(v: object) -> int | None:
    return v if type(v) is int else None


def _num(v: object) -> float | None:
    return float(v) if type(v) in (int, float) else None  # type: ignore[arg-type]
