"""The daemon as lease authority: leases asked over a Unix socket (server side).

A daemon running as root serves ``$GPUSD_LEASE_SOCKET`` (default ``/run/gpusd/lease.sock``) in a
directory only it can write; the protocol is in :mod:`gpusd.alloc.authority` and docs/allocation.md.
For each connection it reads one request, learns the client's pid and uid from the kernel
(``SO_PEERCRED``), selects and takes the very same flock leases a client would take itself in its own
directory (``<lock dir>/authority``: owned by the daemon, lock files ``0600``, so that no other user
can hold a lock there; the two directories read each other's leases and queue, so the two ways never
overlap: :class:`gpusd.alloc.leases.LeaseStore`), answers, and keeps the lease's descriptors until the
connection closes.  The lease record it writes is root's and names the client
(and the client's job, when it says which: a label only), so ``gpusd leases`` shows the client as
the holder.

A ``choose`` request (``gpusd select``, ``gpusd env``) is answered like a lease request, with the
GPUs a lease would get and no lease; a ``snapshot`` request with the daemon's GPUs (for a client
without a driver library that leases in the lock directory): the connection ends with the answer.

Protocol 1: the client sends nothing after its request; the end of the connection (or any further
byte) abandons a wait, or releases the lease.  Protocol 2 (a request with ``"v": 2``): the connection
that holds a lease also takes further requests, one line each, served one at a time and answered in
order: ``grow`` (more GPUs under the same lease and record) and ``release`` (one GPU back, freed at
once).  Each such line is believed only when the kernel says it was written by the client's own uid
(or root): the socket receives every writer's credentials (``SO_PASSCRED``/``SCM_CREDENTIALS``), so a
process of another user that got hold of the connection cannot change the lease; its lines are
logged and ignored.  A bad request gets an error answer and the lease stays.

The answer that grants a lease carries copies of its descriptors (``SCM_RIGHTS``: every GPU's lock
and the record's, read-only, named in the answer's ``fds``), and so does each grow or release answer:
the locks belong to the open files, which the client co-holds, so no lease dies with the daemon
(``kill -9`` included), and a restarted daemon finds them confirmed by the kernel.  When the
connection ends, the daemon unlocks the open files for every copy (``LOCK_UN``) before closing its
own: the lease still ends with the client's connection.  When the daemon stops, it tells each client
(``{"op": "handover"}``) and closes its copies.  Only one daemon is the authority of a lock directory:
it holds :data:`gpusd.alloc.leases.CLAIM_FILE` locked for its life, and a second one is refused.
A request still waiting in the queue is told ``{"op": "requeue"}`` and its ticket is left; the next
daemon locks again the tickets of waiters that still run (:func:`gpusd.alloc.queue.readopt`) and gives
each back to its process when it asks again (matched by SO_PEERCRED), so it keeps its place
(docs/allocation.md, "Waiting").  Where the daemon records its usage history, each lease granted here
is written down before its client hears of it, and ended when its connection ends (:class:`LeaseHistory`).

Bounds: a request line of at most 16 KiB, the first read within 5 s; at most 256 connections, 64 per
uid (a client refused with ``busy`` takes its lease in the lock directory instead); at most 8 further
requests kept while one is served (more are dropped); a lease of at most 64 devices.
Threads: every connection's I/O is a coroutine on the daemon's event loop (reading with
each writer's credentials, noticing a client that leaves while it waits, the hand-over at stop:
a non-blocking ``sendmsg`` awaited for writability, never a blocking call on the loop); the blocking
work -- flock waits, the selection mutex, lease records, the backend's snapshot -- runs in one
bounded executor.  Not a threaded Unix server beside the loop: the per-connection logic above is
already asynchronous, and a second I/O model for the same sockets would double it.  The executor
has ``MAX_CLIENTS`` workers because a connection runs at most one blocking job at a time (its
requests are served in order) and at most ``MAX_CLIENTS`` connections are admitted, so no job ever
queues behind another client's wait; its threads start only as jobs come (an idle daemon has none).
"""

# Imports inside functions: memory at rest (loaded on request).
from __future__ import annotations

import array
import asyncio
import contextlib
import json
import logging
import os
import socket
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

from .. import inventory
from ..alloc import queue
from ..alloc.authority import peer_credentials, socket_path
from ..alloc.handle import Holder
from ..alloc.leases import Lease, LeaseStore
from ..alloc.lockdir import user_name
from ..alloc.select import Constraints
from ..errors import ConfigError, DiskFull, GpusdError, NoGpuAvailable, to_wire
from .backend import SharedBackend
from .leaseconn import MAX_REQUEST, Conn, writable
from .leasereq import constraints, job_of, parse, priority_of
from .leasereq import version as protocol_version
from .slurmjobs import SlurmJobs, answer

log = logging.getLogger(__name__)

REQUEST_TIMEOUT = 5.0
MAX_CLIENTS = 256
MAX_PER_UID = 64
# a lease record names at most this many (gpusd.alloc.leases.MAX_LEASE_DEVICES)
MAX_DEVICES = 64


class _Held:
    """A lease granted on a connection, and what its further requests need."""

    def __init__(self, selection: Any, command: str | None, job: str | None, pid: int, uid: int,
                 priority: int | None = None) -> None:
        self.selection = selection
        self.command, self.job, self.pid, self.uid, self.priority = command, job, pid, uid, priority
        # the lease's descriptors: a join or drop vs the hand-over
        self.lock = threading.Lock()
        # the client holds copies of the lease's descriptors (sent with the grant)
        self.passed = False

    @property
    def lease(self) -> Any:
        return self.selection.lease

    def held(self) -> list[str]:
        return list(self.lease.devices)


class LeaseHistory(Protocol):
    """Where the leases granted here are written down as they begin and end (the usage history:
    :class:`gpusd.daemon.recording.Recording`); called on the executor's threads."""

    def lease_started(self, lease_id: str, user: str | None, uid: int | None, command: str | None,
                      gpus: list[str]) -> None: ...

    def lease_ended(self, lease_id: str) -> None: ...

    def lease_timed_out(self, lease_id: str) -> None: ...


class LeaseServer:
    def __init__(self, path: Path, simulate: str | None = None, slurm: bool = False,
                 backend: SharedBackend | None = None, claim: int | None = None) -> None:
        """``backend``: the daemon's one backend (daemon/backend.py), which the daemon closes; without
        it (a lease server on its own: tests, benchmarks) the server opens and closes its own.
        ``claim``: the lock directory's authority lock, taken by the daemon as it started
        (:meth:`gpusd.alloc.leases.LeaseStore.claim`; taken here when None), closed at :meth:`stop`."""
        self.path = path
        self.claimed = claim
        self.simulate = simulate
        self.shared = backend
        # Slurm allocates this host's GPUs: leases only for Slurm jobs (docs/slurm.md)
        self.slurm = slurm

        self.slurm_jobs = SlurmJobs()
        self.listener: socket.socket | None = None
        self.accepting: asyncio.Task[None] | None = None
        self.backend: SharedBackend | None = None  # while serving
        self.executor = ThreadPoolExecutor(MAX_CLIENTS, thread_name_prefix="gpusd-lease")
        # uid -> open connections
        self.clients: dict[int, int] = {}
        self.total = 0
        self.cancels: set[threading.Event] = set()
        self.tasks: set[asyncio.Task[Any]] = set()
        # connection -> the lease granted on it
        self.held: dict[Conn, _Held] = {}
        # set by the daemon that records its usage history
        self.history: LeaseHistory | None = None
        # the daemon's bookings (daemon/bookings.py): a booker's request takes its hold
        self.bookings: Any = None
        # the authority's own lock directory (LeaseStore.authority), once prepared
        self.store: Any = None
        self.stopping = False
        # the kept tickets were closed (stop() is done with them)
        self.stopped = False
        # waiters' places a previous daemon left (gpusd.alloc.queue.readopt), by (pid, uid), until they ask again
        self.places: dict[tuple[int, int], Any] = {}
        self.expiring: asyncio.Task[None] | None = None
        # the requests waiting in the queue, on the executor
        self.waits: set[asyncio.Future[Any]] = set()
        # tickets of the waits that ended as we stop: left for the next daemon
        self.kept: list[Any] = []
        self.kept_lock = threading.Lock()

    # -- start/stop ---------------------------------------------------------------------------------
    async def start(self) -> None:
        """Serve the socket; GpusdError when its directory is not safe or the socket cannot be made."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self.executor, self._prepare)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(str(self.path))
            # the socket bind() just made, in a directory only we can write
            os.chmod(self.path, 0o666)
            sock.listen(128)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self.listener = sock
        self.accepting = asyncio.ensure_future(self._accept(sock))

        # this process's other leases (remote ones, moves) are taken there too
        LeaseStore.serving(self.store)
        log.info("lease authority on %s (leases in %s)", self.path, self.store.dir)
        if self.places:
            log.info("keeping the places of %d waiter(s) of the previous daemon for %gs", len(self.places),
                     _queue().READOPT_GRACE)
            self.expiring = asyncio.ensure_future(self._expire_places())

    async def _expire_places(self) -> None:
        """Give up the places nobody came back for: the waiter ended, or the grace passed (a place at
        the head of the queue holds up everyone behind it, so not for long)."""
        while self.places:
            await asyncio.sleep(PLACE_CHECK)
            now = time.monotonic()
            for key, place in list(self.places.items()):
                if now >= place.until or not place.alive():
                    del self.places[key]
                    place.ticket.close()

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
                # out of descriptors, say: try again, not in a busy loop
                await asyncio.sleep(0.1)
                continue
            task = asyncio.ensure_future(self._client(conn))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    def _prepare(self) -> None:
        # first: a refused second authority touches nothing
        if os.geteuid() == 0 and self.claimed is None:
            self.claimed = LeaseStore.authority().claim()
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
                # a previous daemon's socket, nobody behind it
                os.unlink(self.path)
            else:
                raise GpusdError(f"another gpusd daemon already serves leases on {self.path}")
            finally:
                probe.close()
        if os.geteuid() == 0:
            store = LeaseStore.authority()
            # before prepare(), which removes the tickets left unlocked
            self.places = _queue().readopt(store)
            # a directory only we can write, lock files only we can open
            store.prepare()
        else:
            # other users' clients would not trust our directory: we lease where they do
            store = LeaseStore()
        self.store = store
        if self.shared is not None:
            self.backend = self.shared
        else:
            own = SharedBackend(lambda: inventory.open_backend(self.simulate))
            own.open()
            self.backend = own

    async def stop(self) -> None:
        # waits that end now keep their tickets for the next daemon (keep_place)
        self.stopping = True
        if self.store is not None and LeaseStore.for_daemon() is self.store:
            LeaseStore.serving(None)
        if self.expiring is not None:
            self.expiring.cancel()
            self.expiring = None
        # not asked for: the next daemon's
        self.kept.extend(place.ticket for place in self.places.values())
        self.places.clear()
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
            # waits end within a second
            cancel.set()
        # Nothing here blocks the event loop: the lease's lock is polled, the descriptors
        # are sent without blocking, the rest runs on the executor.  The clients keep their leases:
        # those that hold the descriptors already (sent with the grant) are told, and ours closed,
        # whether the note reaches them or not; the others get them now.  One that does not read its
        # answers (deaf) gets no wait, and comes last, so that it cannot hold up everyone else's.
        loop = asyncio.get_running_loop()
        for conn, held in sorted(self.held.items(), key=lambda item: item[0].deaf):
            # a join or drop takes milliseconds
            if not await _acquire(held.lock, 2.0):
                continue
            try:
                handed = await _hand_over(conn.sock, held.lease, 0.0 if conn.deaf or held.passed else 1.0,
                                          rights=not held.passed)
                if held.passed and not handed:
                    # the client's copies keep the lease; it learns of the stop at its next change
                    held.lease.forget()
                    handed = True
            finally:
                held.lock.release()
            if handed:
                del self.held[conn]
        # Slurm jobs' leases end with the daemon (docs/slurm.md)
        with contextlib.suppress(RuntimeError):
            await loop.run_in_executor(self.executor, self.slurm_jobs.close)
        tasks = [t for t in self.tasks if t is not asyncio.current_task()]
        # every connection ends (a lease not handed over is released)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        # the cancelled waits leave their tickets for the next daemon: before it starts
        if self.waits:
            await asyncio.wait(list(self.waits), timeout=5)
        # Unlocked only now, when no wait of ours looks at the queue any more: a look would take a
        # ticket nobody holds for a dead waiter's, and remove it.
        with self.kept_lock:
            kept, self.kept = self.kept, []
            self.stopped = True
        for ticket in kept:
            ticket.close(keep=True)
        if self.backend is not None:
            backend, self.backend = self.backend, None
            # the daemon's own is the daemon's to close
            if backend is not self.shared:
                with contextlib.suppress(Exception):
                    await loop.run_in_executor(self.executor, backend.close)
        self.executor.shutdown(wait=False, cancel_futures=True)
        # the last thing: the next authority may start now
        if self.claimed is not None:
            claimed, self.claimed = self.claimed, None
            with contextlib.suppress(OSError):
                os.close(claimed)

    # -- one client ---------------------------------------------------------------------------------
    async def _client(self, sock: socket.socket) -> None:
        conn = Conn(sock)
        try:
            pid, uid, _ = peer_credentials(sock)
        except OSError:
            conn.close()
            return
        if self.total >= MAX_CLIENTS or self.clients.get(uid, 0) >= MAX_PER_UID:
            await conn.send({"ok": False, "code": "busy", "error": "busy", "message": "the gpusd daemon has too many "
                             "lease requests open (from you or in all); try again later"})
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
                # slow: nothing to answer
                return
            if got is None:
                return
            if got[0] is None:
                await conn.send(_TOO_LONG)
                # read the rest of it (a little): closing on unread bytes would reset the connection
                try:
                    await asyncio.wait_for(conn.readline(), 1.0)
                except asyncio.TimeoutError:
                    pass
                return
            try:
                req = parse(got[0])
                # the GPUs, for a client without a driver library
                if req.get("op") == "snapshot":
                    version = protocol_version(req)
                    try:
                        snap = await asyncio.get_running_loop().run_in_executor(self.executor, self._snapshot)
                    except Exception as exc:
                        await conn.send(_failure(exc))
                        return
                    await conn.send({"ok": True, "v": version, "op": "snapshot", "snapshot": snap})
                    return
                # gpusd slurm prolog/epilog (daemon/slurmjobs.py)
                if req.get("op") == "slurm":
                    await conn.send(await self._slurm(req, uid))
                    return
                if self.slurm and req.get("op", "lease") == "lease":
                    await conn.send(to_wire(NoGpuAvailable(slurm_refusal(req.get("count", 1)))))
                    return
                # which GPUs a lease would get, taking none
                choice = req.get("op") == "choose"
                kwargs = constraints(req, op="choose" if choice else "lease")
                version = protocol_version(req)
                job = job_of(req)
                priority = priority_of(req)
            except ConfigError as exc:
                await conn.send(to_wire(exc))
                return
            command = kwargs["command"]
            loop = asyncio.get_running_loop()
            place = self._place(pid, uid) if kwargs["wait"] else None
            # it waited at a daemon that stopped: did we keep its place?
            if req.get("requeue") is True:
                await conn.send({"op": "requeued", "kept": place is not None})
                log.info("pid %d (uid %d) waits again%s", pid, uid, " in its place" if place is not None else "")
            if conn.gone():
                log.info("pid %d (uid %d) left before its request could be served: dropped", pid, uid)
                return
            if choice:
                choosing = self._waiting(loop.run_in_executor(self.executor, self._grant, kwargs, pid, uid, None,
                                                              cancel, priority, False, None, place), kwargs)
                if await conn.watch(choosing, any_data_ends=True):
                    # the client went away while waiting
                    cancel.set()
                try:
                    chosen = await choosing
                except Exception as exc:
                    await self._refused(conn, exc)
                    return
                if not conn.eof:
                    await conn.send({"ok": True, "v": version, "op": "choose",
                                     **({"simulated": True} if self.simulate else {}),
                                     "devices": [_candidate(c) for c in chosen.devices],
                                     "explain": chosen.pick.to_dict() if chosen.pick is not None else None})
                return
            # a booking of this user held now: its GPUs go to this request
            if self.bookings is not None:
                for gone in self.bookings.hand_over(user_name(uid)):
                    await self.bookings.released(gone)
            granting = self._waiting(loop.run_in_executor(self.executor, self._grant, kwargs, pid, uid, job, cancel,
                                                          priority, True, None, place), kwargs)
            if await conn.watch(granting, any_data_ends=True):
                # the client went away (or spoke) while waiting: abandoned
                cancel.set()
            try:
                selection = await granting
            except Exception as exc:
                await self._refused(conn, exc)
                return
            held = _Held(selection, command, job, pid, uid, priority)
            if conn.eof or conn.pending():
                # granted as the client left (or spoke: abandoned): released below
                return
            fds, names = self._passing(held, list(selection.lease.devices))
            answer = {"ok": True, "v": version, "lease_id": selection.lease.lease_id, "job": job,
                      "devices": [_candidate(c) for c in selection.devices],
                      "epoch": selection.lease.epoch, "epochs": selection.lease.epochs(),
                      **({"simulated": True} if self.simulate else {}),  # 0.4, additive
                      **({"fds": names} if names else {})}
            # The client co-holds the lease's open files from now on: a daemon killed now loses no lease.
            # (even if the answer fails half-way: the release unlocks every copy)
            held.passed = bool(fds)
            await conn.send(answer, fds)
            log.info("lease %s: %s for pid %d (uid %d)%s", selection.lease.lease_id, ",".join(selection.uuids),
                     pid, uid, f" job {job}" if job else "")
            self.held[conn] = held
            if version < 2:
                await conn.watch(asyncio.get_running_loop().create_future(), any_data_ends=True)
                # protocol 1: held until the client closes (or sends anything)
                return
            await self._serve(conn, held, cancel)
        except asyncio.CancelledError:
            pass  # the daemon stops
        finally:
            # a wait still running for this client ends (within a second)
            cancel.set()
            self.cancels.discard(cancel)
            self.held.pop(conn, None)
            # after a hand-over: only our (closed) copies, see _hand_over
            if held is not None:
                await self._release(held)
            self.total -= 1
            self.clients[uid] -= 1
            if not self.clients[uid]:
                del self.clients[uid]
            conn.close()

    def _waiting(self, job: asyncio.Future[Any], kwargs: dict[str, Any]) -> asyncio.Future[Any]:
        """``job``, kept in :attr:`waits` while it runs when it may wait in the queue."""
        if kwargs["wait"]:
            self.waits.add(job)
            job.add_done_callback(self.waits.discard)
            # a wait we stop may end after its connection did: its error is nobody's to read
            job.add_done_callback(lambda f: f.cancelled() or f.exception())
        return job

    def _place(self, pid: int, uid: int) -> Any:
        """The ticket of the place a previous daemon kept for process ``pid`` of ``uid`` (the kernel's
        word, SO_PEERCRED), taken from :attr:`places`; None when there is none (or it is not that process)."""
        place = self.places.pop((pid, uid), None)
        if place is None:
            return None
        if not place.alive():
            place.ticket.close()
            return None
        return place.ticket

    async def _refused(self, conn: Conn, exc: BaseException) -> None:
        """Answer a request that ended without GPUs; a wait that ended because we stop is told so
        instead: the client asks the next daemon, which keeps its place (the ticket stays)."""
        if self.stopping:
            await conn.send({"op": "requeue", "message": "the gpusd daemon is stopping: ask the next one, "
                             "which keeps this request's place in the queue"})
            return
        await conn.send(_failure(exc))

    async def _serve(self, conn: Conn, held: _Held, cancel: threading.Event) -> None:
        """Protocol 2: further requests on the connection that holds the lease, until it ends."""
        loop = asyncio.get_running_loop()
        lease_id = held.lease.lease_id
        while True:
            got = await conn.readline()
            if got is None:
                # the end of the connection: the lease ends
                return
            line, writer = got
            if writer is None or writer not in (held.uid, 0):
                log.warning("lease %s: ignored a request on the connection of uid %d written by uid %s", lease_id,
                            held.uid, writer if writer is not None else "unknown")
                # not its user's: neither obeyed nor answered (an answer would go to the holder)
                continue
            if line is None:
                await conn.send({**_TOO_LONG, "id": None})
                continue
            try:
                req = parse(line)
                rid = req.get("id")
                if rid is not None and (type(rid) is not int or not 0 <= rid < 2**53):
                    raise ConfigError("bad 'id' in the request")
            except ConfigError as exc:
                await conn.send({**to_wire(exc), "id": None})
                continue
            op = req.get("op")
            fds: list[int] = []
            names: list[str] = []
            try:
                if op == "grow":
                    kwargs = constraints(req, op="grow")
                    if len(held.held()) + kwargs["count"] > MAX_DEVICES:
                        raise ConfigError(f"a lease holds at most {MAX_DEVICES} GPUs")
                    growing = loop.run_in_executor(self.executor, self._grow, held, kwargs, cancel)
                    if await conn.watch(growing, any_data_ends=False):
                        cancel.set()
                        try:
                            # joined or not, the lease ends with the connection
                            await growing
                        except Exception:
                            pass
                        return
                    added = await growing
                    log.info("lease %s: grown by %s for pid %d (uid %d)", lease_id, ",".join(c.uuid for c in added),
                             held.pid, held.uid)
                    answer = {"ok": True, "op": "grow", "lease_id": lease_id,
                              "devices": [_candidate(c) for c in added], "held": held.held(),
                              "epochs": held.selection.lease.epochs()}
                    fds, names = self._passing(held, [c.uuid for c in added])
                elif op == "release":
                    device = req.get("device")
                    if not isinstance(device, str) or not 0 < len(device) <= 128:
                        raise ConfigError("bad 'device' in the request (a GPU UUID of this lease)")
                    await loop.run_in_executor(self.executor, self._drop, held, device)
                    log.info("lease %s: released %s for pid %d (uid %d)", lease_id, device, held.pid, held.uid)
                    answer = {"ok": True, "op": "release", "lease_id": lease_id, "held": held.held()}
                    # the record was rewritten: its new lock
                    fds, names = self._passing(held, [])
                elif op == "mark":
                    if req.get("ended") != "timed_out":
                        raise ConfigError("bad 'ended' in the request (timed_out)")
                    if self.history is not None:
                        self.history.lease_timed_out(lease_id)
                    log.info("lease %s: its job's time limit ran out (pid %d, uid %d)", lease_id, held.pid, held.uid)
                    answer = {"ok": True, "op": "mark"}
                else:
                    raise ConfigError(f"unknown request {str(op)[:32]!r} on a connection that holds a lease "
                                      "(expected grow, release or mark)")
            except Exception as exc:
                answer, fds, names = _failure(exc), [], []
            answer["id"] = rid
            if names:
                answer["fds"] = names
            await conn.send(answer, fds)

    async def _release(self, held: _Held) -> None:
        """End ``held``'s lease, on the executor (its lock may be held there by a join, a moment)."""
        def release() -> None:
            with held.lock:
                # handed over as we stopped: it goes on without us
                handed = held.lease.released
                # the client's copies of the descriptors must not outlive its connection: unlocked for all
                held.lease.release(unlock=held.passed)
                held.selection.release()
            if self.history is not None and not handed:
                self.history.lease_ended(held.lease.lease_id)

        try:
            job = asyncio.get_running_loop().run_in_executor(self.executor, release)
        except RuntimeError:
            # the executor is shut down already: the daemon is gone, release here
            release()
            return
        try:
            await asyncio.shield(job)
        except asyncio.CancelledError:
            # the daemon stops meanwhile: the release still runs (shielded)...
            # ...unless the executor dropped it unstarted: then here, never lost
            if job.cancelled():
                release()

    # -- the work, in the executor's threads --------------------------------------------------------
    async def _slurm(self, req: dict[str, Any], uid: int) -> dict[str, Any]:
        """A Slurm job's lease begins or ends (daemon/slurmjobs.py); root only."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, self.slurm_answer, req, uid)

    def slurm_answer(self, req: dict[str, Any], uid: int) -> dict[str, Any]:
        """The answer to a ``{"op": "slurm"}`` request from ``uid`` (in a thread; never raises)."""
        def grant(kwargs: dict[str, Any], pid: int, job_uid: int) -> Any:
            job = str(req.get("slurm_job"))
            return self._grant(kwargs, pid, job_uid, None, threading.Event(), extra={"slurm_job": job})

        try:
            backend = self.backend
            if backend is None:
                raise GpusdError("the lease authority is stopping")
            return answer(req, uid, self.slurm_jobs, lambda: backend.snapshot(detail=False), grant)
        except Exception as exc:
            return _failure(exc)

    def _grant(self, kwargs: dict[str, Any], pid: int, uid: int, job: str | None, cancel: threading.Event,
               priority: int | None = None, lease: bool = True, extra: dict[str, Any] | None = None,
               place: Any = None) -> Any:
        from ..alloc.api import LeaseRequest, allocate
        kwargs = dict(kwargs)
        wait, timeout, command, visible = (kwargs.pop("wait"), kwargs.pop("timeout"), kwargs.pop("command"),
                                           kwargs.pop("visible"))
        c = Constraints.build(**kwargs, within_visible=visible is not None)
        # the client's inherited device lists
        env = dict(visible) if visible is not None else {}
        # priority believed for uid
        who = Holder(pid=pid, user=user_name(uid), uid=uid, command=command, job=job,
                     slurm_job=(extra or {}).get("slurm_job"))
        try:
            sel = allocate(LeaseRequest(c, lease=lease, wait=wait, timeout=timeout, holder=who, env=env,
                                        priority=priority, cancelled=cancel.is_set, place=place,
                                        keep_place=self._keep),
                           store=self._store(), backend=self.backend)  # type: ignore[arg-type]
            if lease and self.history is not None and sel.lease is not None:
                self.history.lease_started(sel.lease.lease_id, who.user, uid, command, list(sel.uuids))
            return sel
        finally:
            # refused before it waited
            if place is not None and not place.closed and not self._keep(place):
                place.close()

    def _keep(self, ticket: Any) -> bool:
        """Keep the ticket of a wait that ends as we stop, for the next daemon (True); it is closed,
        unlocked but not removed, once every wait has ended (:meth:`stop`)."""
        with self.kept_lock:
            if not self.stopping:
                return False
            # too late for stop() to close it: leave it now
            if self.stopped:
                ticket.close(keep=True)
            else:
                self.kept.append(ticket)
            return True

    def _snapshot(self) -> dict[str, Any]:
        """The GPUs as allocation reads them (utilisation since the last lease ended on each)."""
        if self.backend is None:
            raise GpusdError("the lease authority is stopping")
        d: dict[str, Any] = self.backend.snapshot(util_since=self._store().release_times(), detail=False).to_dict()
        # what selection reads: pids and memory, not who runs what
        for g in d.get("gpus") or []:
            for p in g.get("processes") or []:
                p["user"] = p["command"] = None
        return d

    def _grow(self, held: _Held, kwargs: dict[str, Any], cancel: threading.Event) -> list[Any]:
        """More GPUs under ``held``'s lease: chosen and leased like any request (same queue, same
        mutex), then joined to the lease's record."""
        from ..alloc.api import LeaseRequest, allocate
        kwargs = dict(kwargs)
        wait, timeout, visible = kwargs.pop("wait"), kwargs.pop("timeout"), kwargs.pop("visible")
        kwargs.pop("command")
        lease = held.lease
        kwargs["shared"] = lease.shared  # one record, one mode
        # a shared GPU is not taken twice
        kwargs["exclude"] = [*(kwargs["exclude"] or []), *lease.devices]
        c = Constraints.build(**kwargs, within_visible=visible is not None)
        # the client's inherited device lists
        env = dict(visible) if visible is not None else {}
        store = self._store()
        who = Holder(pid=held.pid, user=user_name(held.uid), uid=held.uid, command=held.command, job=held.job)
        sel = allocate(LeaseRequest(c, wait=wait, timeout=timeout, holder=who, env=env, priority=held.priority,
                                    cancelled=cancel.is_set),
                       store=store, backend=self.backend)  # type: ignore[arg-type]
        try:
            extra = sel.lease
            # taken in the lock directory (store given): always a Lease
            if not isinstance(extra, Lease):
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

    def _passing(self, held: _Held, devices: list[str]) -> tuple[list[int], list[str]]:
        """The descriptors of ``held``'s lease to pass to its client with an answer (``SCM_RIGHTS``), and
        their names for the answer's ``fds``: the locks of ``devices`` (named by UUID) and the
        record's (``"record"``).  Only from the authority's own directory, whose descriptors are
        read-only (gpusd.alloc.lockdir.open_lock_file): nothing to pass elsewhere."""
        if not (self.store is not None and self.store.private):
            return [], []
        # No lock: the connection's requests are served one at a time, and this runs on the loop
        # between them (where the stop's hand-over runs too).
        named: tuple[list[int], list[str]] = held.lease.named_fds(devices)
        return named

    def _store(self) -> Any:
        """Where this authority takes leases: its own directory (never the world-openable files)."""
        return self.store if self.store is not None else (LeaseStore.authority() if os.geteuid() == 0
                                                          else LeaseStore())

    def _drop(self, held: _Held, device: str) -> None:
        store = self._store()
        with store.mutex(), held.lock:
            if held.lease.released:
                raise GpusdError("the lease has ended")
            if device not in held.lease.devices:
                raise ConfigError(f"this lease does not hold {device!r}")
            if len(held.lease.devices) == 1:
                raise ConfigError("a lease keeps at least one GPU: close the connection to end it")
            # the client's copy of its lock is unlocked too
            store.drop(held.lease, device, unlock=held.passed)
        held.selection.devices = [c for c in held.selection.devices if c.uuid != device]


# seconds between looks at the kept places (their waiters alive, the grace)
PLACE_CHECK = 0.5


def _queue() -> Any:
    return queue


def slurm_refusal(count: Any = 1) -> str:
    """The refusal of a gpusd lease on a Slurm node, with the Slurm command for the same GPU count."""
    n = count if type(count) is int and 0 < count <= 1024 else 1
    return ("this host's GPUs are allocated by Slurm (its gpusd daemon runs with --slurm): ask Slurm for "
            f"them, e.g. srun --gres=gpu:{n} -- CMD, or salloc --gres=gpu:{n} for a shell (docs/slurm.md)")


SLURM_REFUSAL = slurm_refusal()

_TOO_LONG = to_wire(ConfigError(f"a request is one line of at most {MAX_REQUEST} bytes"))


def _candidate(c: Any) -> dict[str, Any]:
    return {"gpu": c.gpu.to_dict(), "mig": c.mig.to_dict() if c.mig else None, "free": c.free, "total": c.total,
            "util": c.util}


def _failure(exc: BaseException) -> dict[str, Any]:
    """The answer for a request that failed (never a traceback to the client; logged if unexpected)."""
    if isinstance(exc, GpusdError):
        return to_wire(exc)  # docs/errors.md
    # a write no one expected to fail: say why
    if isinstance(exc, OSError) and DiskFull.caused(exc):
        where = os.path.dirname(os.fsdecode(exc.filename)) if exc.filename else "the daemon's directories"
        return to_wire(DiskFull.of(where, exc))
    # never lose the daemon over one request
    log.error("lease request failed", exc_info=exc)
    return to_wire(GpusdError(f"internal error: {exc!r}"[:300]))


async def _acquire(lock: threading.Lock, timeout: float) -> bool:
    """``lock`` (a thread's lock) within ``timeout`` seconds, polled: the event loop never waits on it."""
    deadline = time.monotonic() + timeout
    while not lock.acquire(blocking=False):
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.005)
    return True


async def _hand_over(sock: socket.socket, lease: Any, timeout: float = 1.0, rights: bool = True) -> bool:
    """Tell the client the daemon stops (``{"op": "handover"}``), with the lease's descriptors
    (``SCM_RIGHTS``) unless it holds them already (``rights`` False: they came with the grant), and
    close ours: the kernel keeps the locks, which belong to the open files, not to a process.  Sent
    fds live in the connection until the client reads them or closes it, so the lease still ends with
    the client's connection, and a daemon restart does not end it.  False when the client cannot be
    reached within ``timeout`` seconds (0: only if its socket takes the note at once).  Never blocks
    the event loop: the socket is non-blocking and the loop waits for it to be writable."""
    loop = asyncio.get_running_loop()
    try:
        dup = socket.socket(fileno=os.dup(sock.fileno()))
    except OSError:
        return False
    deadline = loop.time() + timeout
    try:
        dup.setblocking(False)
        note = json.dumps({"op": "handover", "lease_id": lease.lease_id}).encode() + b"\n"
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", lease.fds).tobytes())] if rights else []
        while True:
            try:
                sent = dup.sendmsg([note], ancillary)
                break
            except (BlockingIOError, InterruptedError):
                if not await writable(loop, dup, deadline - loop.time()):
                    return False
        # the descriptors went with the first bytes: the rest of the line follows
        if sent < len(note):
            await asyncio.wait_for(loop.sock_sendall(dup, note[sent:]), max(0.05, deadline - loop.time()))
    except (OSError, asyncio.TimeoutError):
        return False
    finally:
        dup.close()
    lease.forget()
    return True


async def start_lease_server(simulate: str | None = None, slurm: bool = False,
                             backend: SharedBackend | None = None, claim: int | None = None) -> LeaseServer | None:
    """Serve leases where this daemon can be the authority; None (logged) where it cannot.
    ``claim``: see :class:`LeaseServer` (the server owns it from here: closed when it cannot serve)."""
    return (await start_authority(simulate, slurm, backend, claim))[0]


async def start_authority(simulate: str | None = None, slurm: bool = False, backend: SharedBackend | None = None,
                          claim: int | None = None) -> tuple[LeaseServer | None, str | None]:
    """(the lease server, None) where this daemon is the lease authority, else (None, why not): the
    daemon says so on its start line, in ``gpusd status`` and ``GET /api/v1/host``, because every
    client then leases in the shared lock directory, where the daemon's guarantees do not hold.
    ``claim``: the lock directory's authority lock (:class:`LeaseServer` owns it from here)."""
    path = socket_path()
    if path is None:
        log.info("not the lease authority: $GPUSD_LEASE_SOCKET turns it off")
        if claim is not None:
            os.close(claim)
        return None, "turned off ($GPUSD_LEASE_SOCKET=off)"
    server = LeaseServer(path, simulate, slurm, backend, claim)
    try:
        await server.start()
    except (GpusdError, OSError) as exc:
        why = f"cannot serve {path}: {getattr(exc, 'strerror', None) or exc}"
        # root's daemon is meant to be the authority (a warning); another user's never can be
        log.log(logging.WARNING if os.geteuid() == 0 else logging.INFO,
                "not the lease authority (clients lease in the shared lock directory): %s", why)
        await server.stop()
        return None, why
    return server, None
