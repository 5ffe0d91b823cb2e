"""The daemon as lease authority: leases asked over a Unix socket (server side).

A daemon running as root serves ``$GPUSD_LEASE_SOCKET`` (default ``/run/gpusd/lease.sock``) in a
directory only it can write; the protocol is in :mod:`gpusd.alloc.authority` and docs/allocation.md.
For each connection it reads one request, learns the client's pid and uid from the kernel
(``SO_PEERCRED``), selects and takes the very same flock leases a client would take itself (same lock
directory, same mutex, same FIFO queue: the two ways never overlap), answers, and keeps the lease's
descriptors until the connection closes.  The lease record it writes is root's and names the client,
so ``gpusd leases`` shows the client as the holder.

When the daemon stops, it hands each lease's descriptors to its client over the connection
(``SCM_RIGHTS``) before closing it: the locks belong to the open files, so the lease survives a
daemon restart and still ends with the client's connection.

Bounds: a request line of at most 16 KiB read within 5 s; at most 256 connections, 64 per uid (a
client refused with ``busy`` takes its lease in the lock directory instead).  The client sends nothing
after its request: the end of the connection (or any further byte) abandons a wait, or releases the
lease.
"""

from __future__ import annotations

import array
import asyncio
import json
import logging
import math
import os
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..errors import ConfigError, GpusdError, NoGpuAvailable, WaitTimeout

log = logging.getLogger(__name__)

MAX_REQUEST = 16384
REQUEST_TIMEOUT = 5.0
MAX_CLIENTS = 256
MAX_PER_UID = 64


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


class LeaseServer:
    def __init__(self, path: Path, simulate: str | None = None) -> None:
        self.path = path
        self.simulate = simulate
        self.server: asyncio.AbstractServer | None = None
        self.backend: _LockedBackend | None = None
        self.executor = ThreadPoolExecutor(MAX_CLIENTS, thread_name_prefix="gpusd-lease")
        self.clients: dict[int, int] = {}  # uid -> open connections
        self.total = 0
        self.cancels: set[threading.Event] = set()
        self.tasks: set[asyncio.Task[Any]] = set()
        self.writers: set[asyncio.StreamWriter] = set()
        self.held: dict[asyncio.StreamWriter, Any] = {}  # connection -> Selection granted on it

    # -- start/stop ---------------------------------------------------------------------------------
    async def start(self) -> None:
        """Serve the socket; GpusdError when its directory is not safe or the socket cannot be made."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self.executor, self._prepare)
        self.server = await asyncio.start_unix_server(self._client, path=str(self.path), limit=MAX_REQUEST)
        os.chmod(self.path, 0o666)  # the socket bind() just made, in a directory only we can write
        log.info("lease authority on %s", self.path)

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
            import socket

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
        if self.server is not None:
            self.server.close()
            try:
                os.unlink(self.path)
            except OSError:
                pass
            self.server = None
        for cancel in list(self.cancels):
            cancel.set()  # waits end within a second
        for writer, selection in list(self.held.items()):  # the clients keep their leases
            if _hand_over(writer, selection):
                del self.held[writer]
        for writer in list(self.writers):  # every other connection ends
            writer.close()
        tasks = [t for t in self.tasks if t is not asyncio.current_task()]
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
    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        from ..alloc.authority import peer_credentials

        sock = writer.get_extra_info("socket")
        try:
            pid, uid, _ = peer_credentials(sock)
        except OSError:
            writer.close()
            return
        if self.total >= MAX_CLIENTS or self.clients.get(uid, 0) >= MAX_PER_UID:
            await _reply(writer, {"ok": False, "error": "busy", "message": "the gpusd daemon has too many lease "
                                  "requests open (from you or in all); try again later"})
            writer.close()
            return
        self.total += 1
        self.clients[uid] = self.clients.get(uid, 0) + 1
        task = asyncio.current_task()
        if task is not None:
            self.tasks.add(task)
        self.writers.add(writer)
        selection: Any = None
        gone: asyncio.Future[bytes] | None = None
        cancel = threading.Event()
        self.cancels.add(cancel)
        try:
            try:
                line = await asyncio.wait_for(reader.readline(), REQUEST_TIMEOUT)
            except (asyncio.TimeoutError, ValueError, ConnectionError):
                return  # slow, oversized or broken: nothing to answer
            try:
                kwargs = _request(line)
            except ConfigError as exc:
                await _reply(writer, {"ok": False, "error": "usage", "message": str(exc)})
                return
            loop = asyncio.get_running_loop()
            job = loop.run_in_executor(self.executor, self._grant, kwargs, pid, uid, cancel)
            gone = asyncio.ensure_future(reader.read(1))
            await asyncio.wait({job, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not job.done():  # the client went away while waiting
                cancel.set()
            try:
                selection = await job
            except NoGpuAvailable as exc:
                kind = "timeout" if isinstance(exc, WaitTimeout) else "no_gpu"
                await _reply(writer, {"ok": False, "error": kind, "message": str(exc)})
                return
            except ConfigError as exc:
                await _reply(writer, {"ok": False, "error": "usage", "message": str(exc)})
                return
            except GpusdError as exc:
                await _reply(writer, {"ok": False, "error": "error", "message": str(exc)})
                return
            except Exception as exc:  # never lose the daemon over one request
                log.exception("lease request failed")
                await _reply(writer, {"ok": False, "error": "error", "message": f"internal error: {exc!r}"})
                return
            if gone.done():
                return  # granted as the client left: released below
            await _reply(writer, {"ok": True, "lease_id": selection.lease.lease_id, "devices": [
                {"gpu": c.gpu.to_dict(), "mig": c.mig.to_dict() if c.mig else None, "free": c.free,
                 "total": c.total, "util": c.util} for c in selection.devices]})
            log.info("lease %s: %s for pid %d (uid %d)", selection.lease.lease_id,
                     ",".join(selection.uuids), pid, uid)
            self.held[writer] = selection
            await asyncio.wait({gone})  # held until the client closes (or sends anything)
        except ConnectionError:
            pass
        finally:
            cancel.set()  # a wait still running for this client ends (within a second)
            self.cancels.discard(cancel)
            if task is not None:
                self.tasks.discard(task)
            self.writers.discard(writer)
            if gone is not None:
                gone.cancel()
                if gone.done() and not gone.cancelled():
                    gone.exception()  # a reset connection is the normal end: nothing to log
            self.held.pop(writer, None)
            if selection is not None:
                selection.release()  # after a hand-over: only our (closed) copies, see _hand_over
            self.total -= 1
            self.clients[uid] -= 1
            if not self.clients[uid]:
                del self.clients[uid]
            writer.close()

    def _grant(self, kwargs: dict[str, Any], pid: int, uid: int, cancel: threading.Event) -> Any:
        from ..alloc.api import allocate
        from ..alloc.leases import LeaseStore
        from ..alloc.lockdir import user_name
        from ..alloc.select import Constraints

        wait, timeout, command, visible = (kwargs.pop("wait"), kwargs.pop("timeout"), kwargs.pop("command"),
                                           kwargs.pop("visible"))
        c = Constraints.build(**kwargs, within_visible=visible is not None)
        env = {"CUDA_VISIBLE_DEVICES": visible} if visible is not None else {}
        return allocate(c, lease=True, wait=wait, timeout=timeout, store=LeaseStore(), command=command, pid=pid,
                        user=user_name(uid), backend=self.backend, env=env,  # type: ignore[arg-type]
                        cancelled=cancel.is_set)


def _hand_over(writer: asyncio.StreamWriter, selection: Any) -> bool:
    """Pass the lease's descriptors to the client (``SCM_RIGHTS``) and close ours: the kernel keeps
    the locks, which belong to the open files, not to a process.  Sent fds live in the connection
    until the client reads them or closes it, so the lease still ends with the client's connection,
    and a daemon restart does not end it.  False when the client cannot be reached."""
    import socket

    lease = selection.lease
    try:
        raw = writer.get_extra_info("socket")
        sock = socket.socket(fileno=os.dup(raw.fileno()))
    except (OSError, AttributeError):
        return False
    try:
        sock.setblocking(True)
        sock.settimeout(1.0)
        note = json.dumps({"op": "handover", "lease_id": lease.lease_id}).encode() + b"\n"
        sock.sendmsg([note], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", lease.fds).tobytes())])
    except OSError:
        return False
    finally:
        sock.close()
    lease.forget()
    return True


async def _reply(writer: asyncio.StreamWriter, obj: dict[str, Any]) -> None:
    try:
        writer.write(json.dumps(obj, allow_nan=False).encode() + b"\n")
        await writer.drain()
    except (ConnectionError, ValueError):
        pass


def _request(line: bytes) -> dict[str, Any]:
    """Validate a request into keyword arguments for :meth:`Constraints.build` (plus wait, timeout,
    command, visible); ConfigError when it is not one."""
    try:
        d = json.loads(line)
    except (ValueError, RecursionError):
        raise ConfigError("a lease request is one JSON object on one line") from None
    if not isinstance(d, dict) or d.get("op") != "lease":
        raise ConfigError('unknown request (expected {"op": "lease", ...})')

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
