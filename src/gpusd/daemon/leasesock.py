"""The daemon as lease authority: leases asked over a Unix socket (server side).

A daemon running as root serves ``$GPUSD_LEASE_SOCKET`` (default ``/run/gpusd/lease.sock``) in a
directory only it can write; the protocol is in :mod:`gpusd.alloc.authority` and docs/allocation.md.
For each connection it reads one request, learns the client's pid and uid from the kernel
(``SO_PEERCRED``), selects and takes the very same flock leases a client would take itself (same lock
directory, same mutex, same queue: the two ways never overlap), answers, and keeps the lease's
descriptors until the connection closes.  The lease record it writes is root's and names the client
(and the client's job, when it says which: a label only), so ``gpusd leases`` shows the client as
the holder.

Protocol 1: the client sends nothing after its request; the end of the connection (or any further
byte) abandons a wait, or releases the lease.  Protocol 2 (a request with ``"v": 2``): the connection
that holds a lease also takes further requests, one line each, served one at a time and answered in
order: ``grow`` (more GPUs under the same lease and record) and ``release`` (one GPU back, freed at
once).  Each such line is believed only when the kernel says it was written by the client's own uid
(or root): the socket receives every writer's credentials (``SO_PASSCRED``/``SCM_CREDENTIALS``), so a
process of another user that got hold of the connection cannot change the lease; its lines are
logged and ignored.  A bad request gets an error answer and the lease stays.

When the daemon stops, it hands each lease's descriptors (grown GPUs included) to its client over the
connection (``SCM_RIGHTS``) before closing it: the locks belong to the open files, so the lease
survives a daemon restart and still ends with the client's connection.

Bounds: a request line of at most 16 KiB, the first read within 5 s; at most 256 connections, 64 per
uid (a client refused with ``busy`` takes its lease in the lock directory instead); at most 8 further
requests kept while one is served (more are dropped); a lease of at most 64 devices.
"""

from __future__ import annotations

import array
import asyncio
import json
import logging
import math
import os
import re
import socket
import stat
import struct
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..errors import ConfigError, GpusdError, NoGpuAvailable, WaitTimeout

log = logging.getLogger(__name__)

MAX_REQUEST = 16384
REQUEST_TIMEOUT = 5.0
SEND_TIMEOUT = 10.0
MAX_CLIENTS = 256
MAX_PER_UID = 64
MAX_AHEAD = 8  # further requests read (and kept) while one is served
MAX_WRITERS = 16  # processes sharing a connection whose unfinished lines are kept apart
MAX_DEVICES = 64  # a lease record names at most this many (gpusd.alloc.leases.MAX_LEASE_DEVICES)
PROTOCOL = 2  # the highest version this daemon speaks (docs/allocation.md)
JOB_ID = re.compile(r"^[0-9a-f]{12}$")
_CRED = struct.Struct("3i")
_ANCILLARY = socket.CMSG_SPACE(_CRED.size) + socket.CMSG_SPACE(16 * 4)


class _LockedBackend:
    """The inventory backend shared by the request threads, one snapshot at a time."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.lock = threading.Lock()

    def snapshot(self, util_since: Any = None, detail: bool = True) -> Any:
        with self.lock:
            return self.backend.snapshot(util_since=util_since, detail=detail)

    def close(self) -> None:
        with self.lock:
            self.backend.close()


class _Conn:
    """One client connection, read line by line with the uid of whoever wrote each line.

    The kernel attaches the writer's credentials to every message (``SO_PASSCRED``) and never glues
    two writers' bytes into one read, so each writer's bytes are gathered into lines of their own: a
    process that shares the connection cannot corrupt the holder's requests with half a line.  A
    writer is ``None`` for bytes without credentials (where SO_PASSCRED could not be set)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        sock.setblocking(False)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        except OSError:
            pass  # then no line has credentials, and none after the first request is believed
        self.partial: dict[tuple[int, int] | None, bytearray] = {}  # writer (pid, uid) -> its unfinished line
        self.skipping: set[tuple[int, int] | None] = set()  # writers inside an over-long line
        self.lines: deque[tuple[bytes | None, int | None]] = deque()  # (line or None: too long, writer's uid)
        self.eof = False
        self.deaf = False  # an answer could not be sent: the client does not read; answer no more
        self.closed = False
        # The loop watching the socket for input, and the future that the watch resolves.
        self.watched: tuple[asyncio.AbstractEventLoop, asyncio.Future[None]] | None = None

    async def _recv(self) -> bool:
        """Read what is there (waiting for it); False at the end of the connection."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                data, ancillary, _flags, _addr = self.sock.recvmsg(65536, _ANCILLARY)
                break
            except (BlockingIOError, InterruptedError):
                ready: asyncio.Future[None] = loop.create_future()
                loop.add_reader(self.sock.fileno(), _resolve, ready)
                self.watched = loop, ready
                try:
                    await ready
                finally:
                    self._unwatch(ready)  # unless that was done already (and the socket watched anew)
            except OSError:
                data, ancillary = b"", []
                break
        writer: tuple[int, int] | None = None
        for level, kind, payload in ancillary:
            if level != socket.SOL_SOCKET:
                continue
            if kind == socket.SCM_CREDENTIALS and len(payload) >= _CRED.size:
                # The pid is 0 for a writer in a pid namespace we cannot see; the uid is always the
                # writer's as the kernel maps it to ours (65534 when unmapped or unknown, never root).
                pid, uid, _gid = _CRED.unpack(payload[:_CRED.size])
                writer = (pid, uid)
            elif kind == socket.SCM_RIGHTS:  # nobody passes us descriptors: close what came
                fds = array.array("i")
                fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
                for fd in fds:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
        if not data:
            self.eof = True
            return False
        self._gather(data, writer)
        return True

    def _gather(self, data: bytes, writer: tuple[int, int] | None) -> None:
        uid = writer[1] if writer is not None else None
        while data:
            at = data.find(b"\n")
            if writer in self.skipping:
                if at < 0:
                    return
                self.skipping.discard(writer)
                data = data[at + 1:]
                continue
            buf = self.partial.get(writer)
            if buf is None:
                if len(self.partial) >= MAX_WRITERS:  # bounded: the oldest unfinished line goes
                    oldest = next(iter(self.partial))
                    del self.partial[oldest]
                    self.skipping.add(oldest)
                buf = self.partial[writer] = bytearray()
            if at < 0:
                buf += data
                if len(buf) > MAX_REQUEST:
                    del self.partial[writer]
                    self.skipping.add(writer)
                    self.lines.append((None, uid))
                return
            buf += data[:at + 1]
            data = data[at + 1:]
            del self.partial[writer]
            self.lines.append((bytes(buf) if len(buf) <= MAX_REQUEST + 1 else None, uid))

    async def readline(self) -> tuple[bytes | None, int | None] | None:
        """The next line (None: it was over :data:`MAX_REQUEST` bytes) and its writer's uid; None at
        the end of the connection."""
        while not self.lines:
            if self.eof or not await self._recv():
                return None
        return self.lines.popleft()

    def pending(self) -> bool:
        return bool(self.lines) or any(self.partial.values())

    async def watch(self, fut: asyncio.Future[Any], any_data_ends: bool) -> bool:
        """Wait for ``fut``; True when the client left meanwhile (or, with ``any_data_ends``, sent
        anything: protocol 1's "abandon").  Requests that arrive are kept for later, at most
        :data:`MAX_AHEAD` of them (more are dropped, logged: the end of the connection must still be
        seen)."""
        while not fut.done():
            if self.eof or (any_data_ends and self.pending()):
                return True
            while len(self.lines) > MAX_AHEAD:
                self.lines.pop()
                log.warning("lease socket: more than %d requests sent ahead of an answer: one dropped", MAX_AHEAD)
            reading = asyncio.ensure_future(self._recv())
            try:
                await asyncio.wait({fut, reading}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not reading.done():
                    reading.cancel()
                    self._unwatch()  # now, not when the cancelled read next runs
            if not reading.done() or reading.cancelled():
                break
            if not reading.result():
                return True
        return self.eof or (any_data_ends and self.pending())

    async def send(self, obj: dict[str, Any]) -> None:
        if self.deaf or self.closed:
            return
        loop = asyncio.get_running_loop()
        try:
            data = json.dumps(obj, allow_nan=False).encode() + b"\n"
            await asyncio.wait_for(loop.sock_sendall(self.sock, data), SEND_TIMEOUT)
        except (OSError, ValueError, asyncio.TimeoutError):
            self.deaf = True  # it does not read: its lease stays, its answers stop

    def _unwatch(self, ready: asyncio.Future[None] | None = None) -> None:
        """Stop watching the socket (before it is closed: its number may be reused at once); with
        ``ready``, only that watch."""
        if self.watched is None or (ready is not None and self.watched[1] is not ready):
            return
        loop, self.watched = self.watched[0], None
        loop.remove_reader(self.sock.fileno())

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._unwatch()
            self.sock.close()


class _Held:
    """A lease granted on a connection, and what its further requests need."""

    def __init__(self, selection: Any, command: str | None, job: str | None, pid: int, uid: int,
                 priority: int | None = None) -> None:
        self.selection = selection
        self.command, self.job, self.pid, self.uid, self.priority = command, job, pid, uid, priority
        self.lock = threading.Lock()  # the lease's descriptors: a join or drop vs the hand-over

    @property
    def lease(self) -> Any:
        return self.selection.lease

    def held(self) -> list[str]:
        return list(self.lease.devices)


class LeaseServer:
    def __init__(self, path: Path, simulate: str | None = None) -> None:
        self.path = path
        self.simulate = simulate
        self.listener: socket.socket | None = None
        self.accepting: asyncio.Task[None] | None = None
        self.backend: _LockedBackend | None = None
        self.executor = ThreadPoolExecutor(MAX_CLIENTS, thread_name_prefix="gpusd-lease")
        self.clients: dict[int, int] = {}  # uid -> open connections
        self.total = 0
        self.cancels: set[threading.Event] = set()
        self.tasks: set[asyncio.Task[Any]] = set()
        self.held: dict[_Conn, _Held] = {}  # connection -> the lease granted on it

    # -- start/stop ---------------------------------------------------------------------------------
    async def start(self) -> None:
        """Serve the socket; GpusdError when its directory is not safe or the socket cannot be made."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self.executor, self._prepare)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(str(self.path))
            os.chmod(self.path, 0o666)  # the socket bind() just made, in a directory only we can write
            sock.listen(128)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self.listener = sock
        self.accepting = asyncio.ensure_future(self._accept(sock))
        log.info("lease authority on %s", self.path)

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(listener)
            except asyncio.CancelledError:
                raise
            except OSError as exc:
                if listener.fileno() < 0:
                    return
                log.warning("lease socket: accept failed: %s", exc)
                await asyncio.sleep(0.1)  # out of descriptors, say: try again, not in a busy loop
                continue
            task = asyncio.ensure_future(self._client(conn))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    def _prepare(self) -> None:
        from ..inventory import open_backend

        d = self.path.parent
        me = os.geteuid()
        try:
            d.mkdir(mode=0o755, parents=True, exist_ok=True)
            st = os.lstat(d)
        except OSError as exc:
            raise GpusdError(f"cannot make the lease socket's directory {d}: {exc.strerror}") from None
        if not stat.S_ISDIR(st.st_mode) or st.st_uid not in (0, me) or st.st_mode & 0o022:
            raise GpusdError(f"not serving leases on {self.path}: its directory must be a real directory owned by "
                             "root or the daemon's user and writable by nobody else")
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            pass
        else:
            if not stat.S_ISSOCK(st.st_mode):
                raise GpusdError(f"not serving leases on {self.path}: something else is there")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            probe.settimeout(1.0)
            try:
                probe.connect(str(self.path))
            except OSError:
                os.unlink(self.path)  # a previous daemon's socket, nobody behind it
            else:
                raise GpusdError(f"another gpusd daemon already serves leases on {self.path}")
            finally:
                probe.close()
        self.backend = _LockedBackend(open_backend(self.simulate))

    async def stop(self) -> None:
        if self.accepting is not None:
            self.accepting.cancel()
            self.accepting = None
        if self.listener is not None:
            self.listener.close()
            try:
                os.unlink(self.path)
            except OSError:
                pass
            self.listener = None
        for cancel in list(self.cancels):
            cancel.set()  # waits end within a second
        for conn, held in list(self.held.items()):  # the clients keep their leases
            if not held.lock.acquire(timeout=2.0):  # a join or drop takes milliseconds
                continue
            try:
                handed = _hand_over(conn.sock, held.lease)
            finally:
                held.lock.release()
            if handed:
                del self.held[conn]
        tasks = [t for t in self.tasks if t is not asyncio.current_task()]
        for t in tasks:  # every connection ends (a lease not handed over is released)
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        self.executor.shutdown(wait=False, cancel_futures=True)
        if self.backend is not None:
            backend, self.backend = self.backend, None
            try:
                backend.close()
            except Exception:
                pass

    # -- one client ---------------------------------------------------------------------------------
    async def _client(self, sock: socket.socket) -> None:
        from ..alloc.authority import peer_credentials

        conn = _Conn(sock)
        try:
            pid, uid, _ = peer_credentials(sock)
        except OSError:
            conn.close()
            return
        if self.total >= MAX_CLIENTS or self.clients.get(uid, 0) >= MAX_PER_UID:
            await conn.send({"ok": False, "error": "busy", "message": "the gpusd daemon has too many lease "
                             "requests open (from you or in all); try again later"})
            conn.close()
            return
        self.total += 1
        self.clients[uid] = self.clients.get(uid, 0) + 1
        held: _Held | None = None
        cancel = threading.Event()
        self.cancels.add(cancel)
        try:
            try:
                got = await asyncio.wait_for(conn.readline(), REQUEST_TIMEOUT)
            except asyncio.TimeoutError:
                return  # slow: nothing to answer
            if got is None:
                return
            if got[0] is None:
                await conn.send(_TOO_LONG)
                try:  # read the rest of it (a little): closing on unread bytes would reset the connection
                    await asyncio.wait_for(conn.readline(), 1.0)
                except asyncio.TimeoutError:
                    pass
                return
            try:
                req = _parse(got[0])
                kwargs = _constraints(req)
                version = _version(req)
                job = _job(req)
                priority = _priority(req)
            except ConfigError as exc:
                await conn.send({"ok": False, "error": "usage", "message": str(exc)})
                return
            command = kwargs["command"]
            loop = asyncio.get_running_loop()
            granting = loop.run_in_executor(self.executor, self._grant, kwargs, pid, uid, job, cancel, priority)
            if await conn.watch(granting, any_data_ends=True):
                cancel.set()  # the client went away (or spoke) while waiting: abandoned
            try:
                selection = await granting
            except Exception as exc:
                await conn.send(_failure(exc))
                return
            held = _Held(selection, command, job, pid, uid, priority)
            if conn.eof or conn.pending():
                return  # granted as the client left (or spoke: abandoned): released below
            await conn.send({"ok": True, "v": version, "lease_id": selection.lease.lease_id, "job": job,
                             "devices": [_candidate(c) for c in selection.devices]})
            log.info("lease %s: %s for pid %d (uid %d)%s", selection.lease.lease_id, ",".join(selection.uuids),
                     pid, uid, f" job {job}" if job else "")
            self.held[conn] = held
            if version < 2:
                await conn.watch(asyncio.get_running_loop().create_future(), any_data_ends=True)
                return  # protocol 1: held until the client closes (or sends anything)
            await self._serve(conn, held, cancel)
        except asyncio.CancelledError:
            pass  # the daemon stops
        finally:
            cancel.set()  # a wait still running for this client ends (within a second)
            self.cancels.discard(cancel)
            self.held.pop(conn, None)
            if held is not None:
                with held.lock:
                    held.selection.release()  # after a hand-over: only our (closed) copies, see _hand_over
            self.total -= 1
            self.clients[uid] -= 1
            if not self.clients[uid]:
                del self.clients[uid]
            conn.close()

    async def _serve(self, conn: _Conn, held: _Held, cancel: threading.Event) -> None:
        """Protocol 2: further requests on the connection that holds the lease, until it ends."""
        loop = asyncio.get_running_loop()
        lease_id = held.lease.lease_id
        while True:
            got = await conn.readline()
            if got is None:
                return  # the end of the connection: the lease ends
            line, writer = got
            if writer is None or writer not in (held.uid, 0):
                log.warning("lease %s: ignored a request on the connection of uid %d written by uid %s", lease_id,
                            held.uid, writer if writer is not None else "unknown")
                continue  # not its user's: neither obeyed nor answered (an answer would go to the holder)
            if line is None:
                await conn.send({**_TOO_LONG, "id": None})
                continue
            try:
                req = _parse(line)
                rid = req.get("id")
                if rid is not None and (type(rid) is not int or not 0 <= rid < 2**53):
                    raise ConfigError("bad 'id' in the request")
            except ConfigError as exc:
                await conn.send({"ok": False, "error": "usage", "id": None, "message": str(exc)})
                continue
            op = req.get("op")
            try:
                if op == "grow":
                    kwargs = _constraints(req, op="grow")
                    if len(held.held()) + kwargs["count"] > MAX_DEVICES:
                        raise ConfigError(f"a lease holds at most {MAX_DEVICES} GPUs")
                    growing = loop.run_in_executor(self.executor, self._grow, held, kwargs, cancel)
                    if await conn.watch(growing, any_data_ends=False):
                        cancel.set()
                        try:
                            await growing  # joined or not, the lease ends with the connection
                        except Exception:
                            pass
                        return
                    added = await growing
                    log.info("lease %s: grown by %s for pid %d (uid %d)", lease_id, ",".join(c.uuid for c in added),
                             held.pid, held.uid)
                    answer = {"ok": True, "op": "grow", "lease_id": lease_id,
                              "devices": [_candidate(c) for c in added], "held": held.held()}
                elif op == "release":
                    device = req.get("device")
                    if not isinstance(device, str) or not 0 < len(device) <= 128:
                        raise ConfigError("bad 'device' in the request (a GPU UUID of this lease)")
                    await loop.run_in_executor(self.executor, self._drop, held, device)
                    log.info("lease %s: released %s for pid %d (uid %d)", lease_id, device, held.pid, held.uid)
                    answer = {"ok": True, "op": "release", "lease_id": lease_id, "held": held.held()}
                else:
                    raise ConfigError(f"unknown request {str(op)[:32]!r} on a connection that holds a lease "
                                      "(expected grow or release)")
            except Exception as exc:
                answer = _failure(exc)
            answer["id"] = rid
            await conn.send(answer)

    # -- the work, in the executor's threads --------------------------------------------------------
    def _grant(self, kwargs: dict[str, Any], pid: int, uid: int, job: str | None, cancel: threading.Event,
               priority: int | None = None) -> Any:
        from ..alloc.api import allocate
        from ..alloc.leases import LeaseStore
        from ..alloc.lockdir import user_name
        from ..alloc.select import Constraints

        kwargs = dict(kwargs)
        wait, timeout, command, visible = (kwargs.pop("wait"), kwargs.pop("timeout"), kwargs.pop("command"),
                                           kwargs.pop("visible"))
        c = Constraints.build(**kwargs, within_visible=visible is not None)
        env = {"CUDA_VISIBLE_DEVICES": visible} if visible is not None else {}
        return allocate(c, lease=True, wait=wait, timeout=timeout, store=LeaseStore(), command=command, pid=pid,
                        user=user_name(uid), backend=self.backend, env=env,  # type: ignore[arg-type]
                        cancelled=cancel.is_set, job=job, priority=priority, uid=uid)  # believed for uid

    def _grow(self, held: _Held, kwargs: dict[str, Any], cancel: threading.Event) -> list[Any]:
        """More GPUs under ``held``'s lease: chosen and leased like any request (same queue, same
        mutex), then joined to the lease's record."""
        from ..alloc.api import allocate
        from ..alloc.leases import Lease, LeaseStore
        from ..alloc.lockdir import user_name
        from ..alloc.select import Constraints

        kwargs = dict(kwargs)
        wait, timeout, visible = kwargs.pop("wait"), kwargs.pop("timeout"), kwargs.pop("visible")
        kwargs.pop("command")
        lease = held.lease
        kwargs["shared"] = lease.shared  # one record, one mode
        kwargs["exclude"] = [*(kwargs["exclude"] or []), *lease.devices]  # a shared GPU is not taken twice
        c = Constraints.build(**kwargs, within_visible=visible is not None)
        env = {"CUDA_VISIBLE_DEVICES": visible} if visible is not None else {}
        store = LeaseStore()
        sel = allocate(c, lease=True, wait=wait, timeout=timeout, store=store, command=held.command, pid=held.pid,
                       user=user_name(held.uid), backend=self.backend, env=env,  # type: ignore[arg-type]
                       cancelled=cancel.is_set, job=held.job, priority=held.priority, uid=held.uid)
        try:
            extra = sel.lease
            if not isinstance(extra, Lease):  # taken in the lock directory (store given): always a Lease
                raise GpusdError("no lease was taken")
            with store.mutex(), held.lock:
                if lease.released:
                    raise GpusdError("the lease ended meanwhile")
                store.join(lease, extra)
        except BaseException:
            sel.release()
            raise
        held.selection.devices.extend(sel.devices)
        return list(sel.devices)

    def _drop(self, held: _Held, device: str) -> None:
        from ..alloc.leases import LeaseStore

        store = LeaseStore()
        with store.mutex(), held.lock:
            if held.lease.released:
                raise GpusdError("the lease has ended")
            if device not in held.lease.devices:
                raise ConfigError(f"this lease does not hold {device!r}")
            if len(held.lease.devices) == 1:
                raise ConfigError("a lease keeps at least one GPU: close the connection to end it")
            store.drop(held.lease, device)
        held.selection.devices = [c for c in held.selection.devices if c.uuid != device]


_TOO_LONG = {"ok": False, "error": "usage", "message": f"a request is one line of at most {MAX_REQUEST} bytes"}


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _candidate(c: Any) -> dict[str, Any]:
    return {"gpu": c.gpu.to_dict(), "mig": c.mig.to_dict() if c.mig else None, "free": c.free, "total": c.total,
            "util": c.util}


def _failure(exc: BaseException) -> dict[str, Any]:
    """The answer for a request that failed (never a traceback to the client; logged if unexpected)."""
    if isinstance(exc, NoGpuAvailable):
        return {"ok": False, "error": "timeout" if isinstance(exc, WaitTimeout) else "no_gpu", "message": str(exc)}
    if isinstance(exc, ConfigError):
        return {"ok": False, "error": "usage", "message": str(exc)}
    if isinstance(exc, GpusdError):
        return {"ok": False, "error": "error", "message": str(exc)}
    log.error("lease request failed", exc_info=exc)  # never lose the daemon over one request
    return {"ok": False, "error": "error", "message": f"internal error: {exc!r}"[:300]}


def _hand_over(sock: socket.socket, lease: Any) -> bool:
    """Pass the lease's descriptors to the client (``SCM_RIGHTS``) and close ours: the kernel keeps
    the locks, which belong to the open files, not to a process.  Sent fds live in the connection
    until the client reads them or closes it, so the lease still ends with the client's connection,
    and a daemon restart does not end it.  False when the client cannot be reached."""
    try:
        dup = socket.socket(fileno=os.dup(sock.fileno()))
    except OSError:
        return False
    try:
        dup.setblocking(True)
        dup.settimeout(1.0)
        note = json.dumps({"op": "handover", "lease_id": lease.lease_id}).encode() + b"\n"
        dup.sendmsg([note], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", lease.fds).tobytes())])
    except OSError:
        return False
    finally:
        dup.close()
    lease.forget()
    return True


def _parse(line: bytes) -> dict[str, Any]:
    try:
        d = json.loads(line)
    except (ValueError, RecursionError):
        raise ConfigError("a request is one JSON object on one line") from None
    if not isinstance(d, dict):
        raise ConfigError("a request is one JSON object on one line")
    return d


def _version(d: dict[str, Any]) -> int:
    """The protocol both sides speak: the client's ``v`` (1 when absent), at most ours."""
    v = d.get("v", 1)
    if type(v) is not int or v < 1:
        raise ConfigError("bad 'v' in the lease request")
    return min(v, PROTOCOL)


def _job(d: dict[str, Any]) -> str | None:
    """The client's job id (12 hex digits), a label for the lease record; believed as nothing more."""
    job = d.get("job")
    if job is None:
        return None
    if not isinstance(job, str) or not JOB_ID.match(job):
        raise ConfigError("bad 'job' in the lease request (a job id is 12 hex digits)")
    return job


def _priority(d: dict[str, Any]) -> int | None:
    """The client's priority (0 low .. 3 urgent, docs/jobs.md): a claim, believed up to the priority
    policy's bound for the client's uid where it is used (``allocate(uid=...)``)."""
    level = d.get("priority")
    if level is None:
        return None
    if type(level) is not int or not 0 <= level <= 3:
        raise ConfigError("bad 'priority' in the lease request (0 low, 1 normal, 2 high, 3 urgent)")
    return level


def _request(line: bytes) -> dict[str, Any]:
    """Validate a lease request into keyword arguments for :meth:`Constraints.build` (plus wait,
    timeout, command, visible); ConfigError when it is not one."""
    return _constraints(_parse(line))


def _constraints(d: dict[str, Any], op: str = "lease") -> dict[str, Any]:
    """:func:`_request` of a parsed request (``op`` ``lease``, or ``grow`` on a held connection)."""
    if d.get("op") != op:
        raise ConfigError(f'unknown request (expected {{"op": "{op}", ...}})')

    def opt(key: str, types: tuple[type, ...]) -> Any:
        v = d.get(key)
        if v is None:
            return None
        if type(v) not in types or (isinstance(v, float) and not math.isfinite(v)):
            raise ConfigError(f"bad {key!r} in the lease request")
        return v

    def ids(key: str) -> list[str] | None:
        v = d.get(key)
        if v is None:
            return None
        if not isinstance(v, list) or len(v) > 64 or not all(isinstance(x, str) and len(x) <= 128 for x in v):
            raise ConfigError(f"bad {key!r} in the lease request")
        return v

    count = d.get("count", 1)
    if type(count) is not int or not 0 < count <= 256:
        raise ConfigError("bad 'count' in the lease request")
    timeout = opt("timeout", (int, float))
    if timeout is not None and not 0 <= timeout <= 10**7:
        raise ConfigError("bad 'timeout' in the lease request")
    by = opt("by", (str,)) or "load"
    command, visible = opt("command", (str,)), opt("visible", (str,))
    return {
        "count": count, "min_free": opt("min_free", (int, float)), "memory": opt("memory", (int,)),
        "max_util": opt("max_util", (int, float)), "max_processes": opt("max_processes", (int,)),
        "include": ids("include"), "exclude": ids("exclude"), "mig": d.get("mig") is True, "by": by[:16],
        "shared": d.get("shared") is True, "wait": d.get("wait") is True, "timeout": timeout,
        "command": command[:1024] if command else None, "visible": visible[:1024] if visible is not None else None,
    }


async def start_lease_server(simulate: str | None = None) -> LeaseServer | None:
    """Serve leases where this daemon can be the authority; None (logged) where it cannot."""
    from ..alloc.authority import socket_path

    path = socket_path()
    if path is None:
        return None
    server = LeaseServer(path, simulate)
    try:
        await server.start()
    except (GpusdError, OSError) as exc:
        log.info("not the lease authority (clients use the lock directory): %s", exc)
        await server.stop()
        return None
    return server
