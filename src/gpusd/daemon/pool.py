"""Leases the daemon holds for remote holders: the server side of the pool (docs/pool.md).

``install(app, daemon)`` adds

* ``POST /api/v1/leases`` — take a lease on this machine's GPUs for a holder elsewhere: the very same
  flock leases a local ``gpusd run`` takes (:func:`gpusd.alloc.api.allocate`, same lock directory,
  same machine-wide selection mutex, behind any job queued here), whose descriptors this daemon keeps;
* ``POST /api/v1/leases/{id}/renew`` — the holder's heartbeat: the lease lives ``ttl`` seconds more;
* ``DELETE /api/v1/leases/{id}`` — release;
* ``GET /api/v1/leases`` — the remote leases held here (holder and note are private fields).

Writes need a request signed with the fleet secret (and HTTPS where the daemon serves TLS): the
access rules (:mod:`gpusd.daemon.access`, run on every route) refuse the others before a handler runs.  A lease
whose holder stops renewing ends ``ttl`` seconds (default 30) after its last renewal.  Bounds: a
request body of at most 16 KiB, ``ttl`` between 2 s and 1 h (granted up to ``lease_max_ttl``), no
lease past ``lease_max_lifetime`` after its grant, at most ``lease_max_total`` remote leases in all
and, per holder, ``lease_max_per_holder`` leases and ``lease_max_gpus_per_holder`` GPUs
(:class:`~gpusd.daemon.config.DaemonConfig`, docs/pool.md).  A holder, for these caps, is what the
daemon can check: the request's signing key and the peer address it came from
(:func:`gpusd.daemon.access.holder_of`), never the ``holder`` name the request declares.  The lease
record names the holder (``user``), the note (``command``), the client's address (``remote_from``),
the expiry (``expires``) and, for ``gpusd run --fleet``, the job (``job``), so every view of leases
shows them.

Time: a lease's expiry, TTL and lifetime run on the monotonic clock (:attr:`Held.deadline`); the wall
time in answers and records (``expires``) is computed from what remains, for display only, so a step of
the wall clock expires nothing early and extends nothing.

Restarts: each lease is written down in the state directory (:mod:`gpusd.daemon.poolstate`, its expiry
on the boot-time clock, with the boot id), and copies of its lock descriptors are co-held by something
that outlives the daemon: systemd's file descriptor store (:mod:`gpusd.daemon.fdstore`) where the
daemon runs under it with one, else the keeper process (:mod:`gpusd.daemon.keeper`).  A restarted daemon
takes every lease back (:meth:`Pool.adopt`: same id, same remaining time) before it answers their
renewals; after a reboot the records are dropped and logged.  Every lease that ends without its
holder's release goes through :meth:`Pool.end`.
"""

# Imports inside functions: memory at rest (loaded on request).
from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web

from .. import inventory
from ..alloc.handle import Holder
from ..alloc.leases import LeaseStore
from ..alloc.policy import held_by_user, load
from ..alloc.select import Constraints
from ..errors import ConfigError, DiskFull, GpusdError, IdError, NoGpuAvailable, OverCap, http_answer, to_wire
from ..ids import JobId
from ..sanitize import dumps, json_object
from . import fdstore, poolstate
from .access import can_see_private, holder_of, peer_of, signed_request
from .backend import SharedBackend
from .config import MAX_TTL, MIN_TTL
from .leasereq import request as _request
from .leasesock import slurm_refusal
from .routes import RouteDef, add_routes
from .users import Directory, Refused

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Awaitable, Callable

    from ..model import LeaseInfo
    from .config import DaemonConfig
    from .routes import RouteDef
    from .users import Account

log = logging.getLogger("gpusd.pool")

DEFAULT_TTL = 30.0
MAX_BODY = 16384
MAX_HOLDER = 64
MAX_NOTE = 512
# seconds between expiry checks
CHECK_EVERY = 0.25
# expiry checks (5 s) between looks at whether the keeper still runs
KEEPER_CHECK_EVERY = 20
# A process started under a remote lease after the lease ended (by hand, with the variables of a
# reservation that had expired, after its fence) is stopped: looked for every STALE_EVERY expiry
# checks (about a second) and before every grant, for STALE_WINDOW seconds after the lease ended.
STALE_EVERY = 4
STALE_WINDOW = 900.0
# ended lease ids remembered at most
STALE_KEPT = 1024
# seconds a renewal waits for the leases of a previous run to be taken back
ADOPT_WAIT = 10.0


class PoolDaemon(Protocol):
    @property
    def config(self) -> "DaemonConfig": ...
    @property
    def hostname(self) -> str: ...
    @property
    def node_id(self) -> str: ...
    def publish(self, event: str, data: Any) -> None: ...


@dataclass
class Held:
    """One remote lease: the Selection whose descriptors keep it, and its holder's terms."""

    lease_id: str
    selection: Any
    holder: str
    note: str | None
    remote_from: str | None
    ttl: float
    # wall time of the grant: shown only
    started: float
    # the grant, on the monotonic clock (the lifetime counts from it)
    born: float
    # when it ends unless renewed, on the monotonic clock
    deadline: float
    devices: list[dict[str, Any]] = field(default_factory=list)
    # the fleet run's job id (gpusd run --fleet), named in the record
    job: str | None = None
    # who holds it, as the daemon can check: "user NAME" (a user key), else key and peer
    identity: str = ""
    # the 'holder' name the request declared (shown as such, never as the user)
    claimed: str | None = None
    # when the holder said it stops renewing (its "left", on our clock): shown only
    ends: float | None = None
    # a renewal is rewriting the record (on the executor)
    renewing: bool = False
    # ended meanwhile: the renewal releases when it is done
    release_after: bool = False
    # the keeper (or systemd's store) confirmed its copies of the lock descriptors
    coheld: bool = False
    # the Future of its release (Pool.end)
    finished: Any = None
    # ended without a release: its processes are stopped before its GPUs go (daemon.fence)
    fence: bool = False

    @property
    def expires(self) -> float:
        """The deadline as a wall time, for display (computed from what remains)."""
        return time.time() + (self.deadline - time.monotonic())

    def to_dict(self, hostname: str, node_id: str) -> dict[str, Any]:
        lease = self.selection.lease if self.selection is not None else None
        # 0.4, additive: the fencing token (alloc.epoch)
        epoch = lease.epoch if lease is not None else None
        return {"lease_id": self.lease_id, "host": hostname, "node_id": node_id, "user": self.holder,
                "command": self.note, "claimed": self.claimed, "remote_from": self.remote_from, "ttl": self.ttl,
                "started": self.started, "expires": self.expires, "devices": self.devices, "job": self.job,
                "ends": self.ends, "env": self.selection.env() if self.selection is not None else {}, "epoch": epoch}


class Pool:
    """The remote leases of one daemon (``daemon.pool``)."""

    def __init__(self, daemon: PoolDaemon) -> None:
        self.daemon = daemon
        self.held: dict[str, Held] = {}
        self.executor = ThreadPoolExecutor(4, thread_name_prefix="gpusd-pool")
        # the daemon's SharedBackend, on the first grant
        self.backend: Any = None
        # one this pool opened itself (no daemon's to use): closed with it
        self._own_backend: Any = None
        # requests being granted (counted against lease_max_total)
        self.pending = 0
        # identity -> (requests, GPUs) being granted
        self.pending_of: dict[str, tuple[int, int]] = {}
        self.task: asyncio.Task[None] | None = None
        # expiry checks made (tests count them rather than time them)
        self.checks = 0
        # the keeper's and the fd store's exchanges, in order, one at a time (each bounded)
        self.keeping = ThreadPoolExecutor(1, thread_name_prefix="gpusd-keep")
        state_dir = getattr(daemon, "state_dir", None)
        self.state_dir: Path | None = Path(state_dir) if state_dir is not None else None
        self.fdstore = fdstore.available()
        # gpusd.daemon.keeper.KeeperClient, once a lease needs one
        self.keeper: Any = None
        # taking back a previous run's leases
        self.adoption: asyncio.Future[None] | None = None
        # a stopping daemon leaves its leases to the keeper/store (the process sets it)
        self.keep_on_stop = False
        self.loop: asyncio.AbstractEventLoop | None = None
        # leases ended without a release, held until their processes are gone
        self.fencing: dict[str, Held] = {}
        # lease id -> when it ended (monotonic): see STALE_WINDOW
        self.ended_ids: dict[str, float] = {}
        self.sweeping = False

        self.users = Directory(getattr(daemon.config, "users_file", None))

    # -- the work, on the executor ------------------------------------------------------------------
    def _grant(self, kwargs: dict[str, Any], holder: str, note: str | None, remote_from: str | None,
               expires: float, job: str | None = None, booking: bool = False) -> Any:
        from ..alloc.api import LeaseRequest, allocate
        # the daemon's one backend (daemon/backend.py); a bare Pool opens its own
        if self.backend is None:
            shared = getattr(self.daemon, "inventory", None)
            if shared is None:
                shared = SharedBackend(lambda: inventory.open_backend(self.daemon.config.simulate))
                shared.open()
                self._own_backend = shared
            self.backend = shared
        c = Constraints.build(**kwargs, within_visible=False)
        who = Holder(pid=os.getpid(), user=holder, command=note, remote_from=remote_from, expires=expires, job=job)
        return allocate(LeaseRequest(c, env={}, holder=who, booking=booking), store=LeaseStore.for_daemon(),
                        backend=self.backend)

    def _grant_held(self, held: Held, kwargs: dict[str, Any], booking: bool = False) -> Any:
        """Grant ``held``'s lease (on the executor), fill in what the grant says, write it down
        (``booking``: a booking's hold, daemon/bookings.py)."""
        # never grant while a process of an ended lease runs here
        if self.ended_ids:
            self.stop_stale()
        sel = self._grant(kwargs, held.holder, held.note, held.remote_from,
                          time.time() + (held.deadline - time.monotonic()), held.job, booking)
        held.lease_id, held.selection = sel.lease.lease_id, sel
        epochs = sel.lease.epochs() if sel.lease is not None else {}
        held.devices = [{"index": c.gpu.index, "label": c.label, "uuid": c.uuid, "name": c.gpu.name,
                         # 0.4, additive: this GPU's fencing token
                         "epoch": epochs.get(c.uuid),
                         "memory_total": c.total, "memory_free": c.free, "utilization_gpu": c.util,
                         "vendor": c.gpu.vendor, "vendor_index": c.gpu.device_index,  # 0.3, additive
                         # 0.3, additive: launch --bind-cpus
                         "local_cpus": c.gpu.local_cpus}
                        for c in sel.devices]
        self._write_down(held, held.deadline - time.monotonic())
        # the usage history: written before the answer
        history = getattr(self.daemon, "recording", None)
        if history is not None:
            history.lease_started(held.lease_id, held.holder, None, held.note, list(sel.uuids))
        return sel

    def _renew(self, held: Held, deadline: float, ttl: float, ends: float | None = None) -> None:
        # the record's 'expires' and 'ends' are for display: wall times (what remains of the lease; when its
        # holder says it stops renewing, so that listings show how long a reservation lasts, not its TTL).
        # What remains is read here, not when the request came: the executor may run this much later.
        remaining = deadline - time.monotonic()
        # under the mutex of its store
        held.selection.lease.update(expires=time.time() + remaining, ends=ends)
        self._write_down(held, remaining, ttl)

    # -- outliving the daemon (poolstate, keeper, fdstore) -------------------------------------------
    def _write_down(self, held: Held, remaining: float, ttl: float | None = None) -> None:
        """Record ``held`` in the state directory and give its lock descriptors' copies to the
        co-holder (on :attr:`keeping`, in order).  Call where the lease's descriptors cannot change
        meanwhile (the executor call that granted or rewrote it)."""
        if self.state_dir is None:
            return
        lease = held.selection.lease
        now_boot = poolstate.boottime()
        data = {"lease_id": held.lease_id, "boot_id": poolstate.boot_id() or "", "holder": held.holder,
                "note": held.note, "remote_from": held.remote_from, "ttl": ttl if ttl is not None else held.ttl,
                "started": held.started, "born_boot": now_boot - (time.monotonic() - held.born),
                "expires_boot": now_boot + remaining, "devices": held.devices, "job": held.job,
                "identity": held.identity, "claimed": held.claimed, "ends": held.ends,
                "env": held.selection.env(), "store": str(lease.path.parent), "record": lease.record}
        if not poolstate.write(self.state_dir, held.lease_id, data):
            return
        copies: list[int] = []
        try:
            for fd in lease.fds:
                # numbers that cannot be reused under the other thread
                copies.append(os.dup(fd))
        except OSError as exc:
            # out of descriptors: the lease holds, it just would not outlive us
            log.warning("remote lease %s will not outlive this daemon: %s", held.lease_id, exc)
            for fd in copies:
                os.close(fd)
            return
        self.keeping.submit(self._co_hold, held, copies)

    def _co_hold(self, held: Held, copies: list[int]) -> None:
        """Hand ``copies`` of ``held``'s descriptors to the co-holder (then close ours of them)."""
        name = f"lease-{held.lease_id}"
        try:
            if self.fdstore:
                # the copies of its last record's lock go with the rest
                fdstore.remove(name)
                held.coheld = fdstore.store(name, copies)
                return
            keeper = self._keeper()
            try:
                keeper.hold(name, copies)
            except OSError as exc:
                # dead or hung: a fresh one, handed every lease again
                log.warning("the lease keeper did not take %s (%s): starting another", held.lease_id, exc)
                keeper.kill()
                keeper.start()
                keeper.hold(name, copies)
                for other in list(self.held.values()):
                    if other is not held and other.coheld and not other.renewing:
                        self._co_hold_again(other)
            held.coheld = True
        except OSError as exc:
            held.coheld = False
            log.warning("remote lease %s will not outlive this daemon: %s", held.lease_id, exc)
        finally:
            for fd in copies:
                os.close(fd)

    def _co_hold_again(self, held: Held) -> None:
        try:
            copies = [os.dup(fd) for fd in held.selection.lease.fds]
        except OSError:
            return
        try:
            self._keeper().hold(f"lease-{held.lease_id}", copies)
        except OSError:
            held.coheld = False
        finally:
            for fd in copies:
                os.close(fd)

    def _keeper(self) -> Any:
        from .keeper import KeeperClient

        assert self.state_dir is not None
        if self.keeper is None:
            self.keeper = KeeperClient(self.state_dir)
        self.keeper.reap()
        # one that died meanwhile fails the hold, which starts another
        if self.keeper.pid is None:
            self.keeper.start()
        return self.keeper

    def _check_keeper(self) -> None:
        """A keeper that died is replaced and handed every lease again (on :attr:`keeping`): until
        then the leases would not outlive this daemon."""
        if self.fdstore or self.keeper is None or not any(h.coheld for h in list(self.held.values())):
            return
        self.keeper.reap()
        if self.keeper.running():
            return
        log.warning("the lease keeper is gone: starting another")
        # gone: nothing to stop
        self.keeper.proc = self.keeper.pid = None
        try:
            self.keeper.start()
        except OSError as exc:
            log.warning("cannot start the lease keeper: %s", exc)
            return
        for held in list(self.held.values()):
            if not held.renewing:
                self._co_hold_again(held)

    def _let_go(self, lease_id: str) -> None:
        """The co-holder closes its copies (bounded; a keeper that does not answer is stopped)."""
        name = f"lease-{lease_id}"
        if self.fdstore:
            fdstore.remove(name)
        elif self.keeper is not None:
            try:
                self.keeper.drop(name)
            except OSError as exc:
                log.warning("the lease keeper did not let go of %s (%s): stopping it", lease_id, exc)
                # its copies close with it; the other leases are handed to the next
                self.keeper.kill()
                for other in list(self.held.values()):
                    if other.coheld and not other.renewing:
                        self._co_hold_again(other)
            self.keeper.reap()

    def _finish(self, held: Held) -> None:
        """Release ``held`` for good (on :attr:`keeping`): its record, the co-holder's copies, ours."""
        if self.state_dir is not None:
            poolstate.remove(self.state_dir, held.lease_id)
            self._let_go(held.lease_id)
        history = getattr(self.daemon, "recording", None)
        if history is not None:
            # its holder released it, or it expired: it ends now
            history.lease_ended(held.lease_id)
        # a fence (self.fencing) first: the look below leaves its processes to it
        self._release_or_fence(held)
        self.ended_ids[held.lease_id] = time.monotonic()
        while len(self.ended_ids) > STALE_KEPT:
            del self.ended_ids[next(iter(self.ended_ids))]

    # -- taking back a previous run's leases ----------------------------------------------------------
    def _kept(self) -> dict[str, list[int]]:
        """Descriptors kept for us: systemd's (at start) and the keeper's, by lease id."""
        out: dict[str, list[int]] = {}
        for name, fds in fdstore.listen_fds().items():
            if name.startswith("lease-"):
                out.setdefault(name[6:], []).extend(fds)
            else:
                for fd in fds:
                    os.close(fd)
        if self.state_dir is None or not (self.state_dir / "keeper.sock").exists():
            return out
        from .keeper import KeeperClient

        keeper = KeeperClient(self.state_dir)
        if not keeper.running():
            return out
        self.keeper = keeper
        try:
            for name in keeper.names():
                if name.startswith("lease-"):
                    out.setdefault(name[6:], []).extend(keeper.give(name))
        except OSError as exc:
            log.warning("the lease keeper did not hand its leases back: %s", exc)
        return out

    def _drop_kept(self, lease_id: str, fds: list[int]) -> None:
        for fd in fds:
            os.close(fd)
        if self.state_dir is not None:
            poolstate.remove(self.state_dir, lease_id)
        self._let_go(lease_id)

    def _adopt(self) -> list[Held]:
        """Take back the leases a previous run of this daemon wrote down (on :attr:`keeping`)."""
        if self.state_dir is None:
            return []
        records = poolstate.load(self.state_dir)
        kept = self._kept() if records or self.fdstore or (self.state_dir / "keeper.sock").exists() else {}
        boot = poolstate.boot_id()
        stores = {str(s.dir): s for s in (LeaseStore(), LeaseStore.authority())}
        out: list[Held] = []
        for lease_id, d in records.items():
            fds = kept.pop(lease_id, [])
            remaining = float(d["expires_boot"]) - poolstate.boottime()
            store = stores.get(d["store"])
            # A lease that expired while the daemon was down is taken back all the same and ends at once,
            # through the expiry (fencing): its holder's processes may still run on its GPUs.
            why = ("it was granted before this machine rebooted" if d["boot_id"] != boot else
                   "its lock descriptors were not kept" if not fds else
                   "it was taken in another lock directory" if store is None else None)
            if why is not None:
                log.warning("remote lease %s of %s dropped: %s", lease_id, d["holder"], why)
                self._drop_kept(lease_id, fds)
                continue
            assert store is not None
            holder = Holder(pid=os.getpid(), user=d["holder"], command=d["note"], remote_from=d["remote_from"],
                            job=d["job"])
            lease = store.adopt(lease_id, d["record"], fds, holder, pid=os.getpid(),
                                expires=time.time() + max(0.0, remaining))
            if lease is None:
                self._drop_kept(lease_id, [])
                continue
            # the time taking it back took counts
            remaining = float(d["expires_boot"]) - poolstate.boottime()
            now = time.monotonic()
            held = Held(lease_id, poolstate.Adopted(lease, d["env"]), d["holder"], d["note"], d["remote_from"],
                        float(d["ttl"]), float(d["started"]), now - (poolstate.boottime() - float(d["born_boot"])),
                        now + remaining, list(d["devices"]), d["job"], d["identity"], d["claimed"], d["ends"])
            self._write_down(held, max(0.0, remaining))
            out.append(held)
            log.info("took back remote lease %s of %s (%s)", lease_id, held.holder,
                     f"{remaining:.1f}s left" if remaining > 0 else "expired while the daemon was down: ends now")
        # copies of leases nobody wrote down (ended meanwhile)
        for lease_id, fds in kept.items():
            self._drop_kept(lease_id, fds)
        return out

    async def adopt(self) -> None:
        """Take back the previous run's leases; renewals wait for this (at most :data:`ADOPT_WAIT`)."""
        try:
            for held in await asyncio.get_running_loop().run_in_executor(self.keeping, self._adopt):
                self.held[held.lease_id] = held
        except Exception as exc:  # noqa: BLE001 - a bad state directory must not stop the daemon
            log.warning("cannot take back the remote leases of the previous run: %s", exc)

    async def _adopted(self) -> None:
        if self.adoption is not None and not self.adoption.done():
            await asyncio.wait({self.adoption}, timeout=ADOPT_WAIT)

    # -- requests -----------------------------------------------------------------------------------
    def _bounds(self, identity: str, count: int) -> str | None:
        """Why a lease of ``count`` GPUs for ``identity`` goes beyond the policy now (None: it does not)."""
        cfg = self.daemon.config
        if len(self.held) + self.pending >= cfg.lease_max_total:
            return f"this daemon holds {cfg.lease_max_total} remote leases already; try again later"
        mine = [h for h in self.held.values() if h.identity == identity]
        asking, gpus = self.pending_of.get(identity, (0, 0))
        if len(mine) + asking >= cfg.lease_max_per_holder:
            return (f"this client ({identity}) holds {cfg.lease_max_per_holder} leases here already "
                    "(a holder is the signing key and the address, not the 'holder' name)")
        cap = cfg.lease_max_gpus_per_holder
        held = sum(len(h.devices) for h in mine) + gpus
        if cap is not None and held + count > cap:
            return (f"this client ({identity}) would hold {held + count} GPUs here; the policy allows "
                    f"{cap} per holder")
        return None

    async def _fleet_cap(self, user: str, count: int) -> str | None:
        """Why ``user`` may not take ``count`` GPUs more by the fleet-wide cap of the policy file
        (``fleet_max_gpus_per_user``): GPUs its leases hold here (the lock directory) and on every other
        verified host, as this daemon's fleet view last saw them.  The view lags by the propagation
        window (docs/allocation.md, measured in BENCHMARKS.md): a burst to many hosts at once may
        exceed the cap by what the others granted within it."""
        policy = load()
        if policy.fleet_max_gpus_per_user is None:
            return None
        fleet = getattr(self.daemon, "fleet", None)
        counted = self.fleet_held(fleet, user)
        if fleet is not None and getattr(fleet, "client", None) is None:
            fleet.touch()
            # auto mode: the view starts on first use
            await fleet.ensure_started()
            counted = self.fleet_held(fleet, user)
        try:
            here = await asyncio.get_running_loop().run_in_executor(self.executor, LeaseStore().leases)
        except GpusdError:
            here = []
        counted += held_by_user(here).get(user, 0)
        return policy.refusal(user, count, {}, {user: counted})

    async def _over_fleet_cap(self, held: Held) -> str | None:
        """Why ``held`` is not renewed by the fleet-wide cap (None: it is): its user's leases on the
        whole fleet (this host's lock directory, every other verified host of the fleet view) are
        ranked oldest first (grant time, then lease id: every daemon ranks them alike), and a lease
        whose GPUs go beyond ``fleet_max_gpus_per_user`` in that order is one of the newest above the
        cap.  So what a simultaneous burst won lasts until the hosts' views show it (the propagation
        window) and the lease's current term ends (docs/pool.md, "Bounds")."""
        cap = load().fleet_max_gpus_per_user
        if cap is None:
            return None
        user = held.holder
        # (node, lease id) -> [started, GPUs]
        leases: dict[tuple[str, str], list[Any]] = {}
        try:
            here = await asyncio.get_running_loop().run_in_executor(self.executor, LeaseStore().leases)
        except GpusdError:
            here = []
        own = self.daemon.node_id
        for le in here:
            if le.user == user and not le.unleased:
                # (the record's grant time: what the other hosts see)
                _count_lease(leases, own, le)
        fleet = getattr(self.daemon, "fleet", None)
        if fleet is not None and getattr(fleet, "client", None) is not None:
            fleet.touch()
            for h in fleet.client.hosts:
                if h.verified is not True or h.snapshot is None or h.node_id == own:
                    continue
                for g in h.snapshot.gpus:
                    for le in g.leases:
                        if le.user == user:
                            _count_lease(leases, str(h.node_id), le)
        total, ahead = 0, 0
        mine = (own, held.lease_id)
        for key, (_started, gpus, _seen) in sorted(leases.items(), key=lambda kv: (kv[1][0], kv[0][1], kv[0][0])):
            total += gpus
            if key == mine:
                ahead = total
        if ahead <= cap:
            return None
        left = max(0.0, held.expires - time.time())
        return (f"{user} holds {total} GPUs on the fleet and the policy allows fleet_max_gpus_per_user {cap}: "
                f"the newest leases above the cap are not renewed; {held.lease_id} ends in {left:.0f}s")

    def fleet_held(self, fleet: Any, user: str) -> int:
        """GPUs ``user`` holds on the other verified hosts of the fleet view."""
        if fleet is None or getattr(fleet, "client", None) is None:
            return 0
        fleet.touch()
        n = 0
        for h in fleet.client.hosts:
            if h.verified is not True or h.snapshot is None or h.node_id == self.daemon.node_id:
                continue
            n += sum(1 for g in h.snapshot.gpus for le in g.leases if le.user == user)
        return n

    def _expiry(self, born: float, now: float, ttl: float) -> float:
        """``now + ttl``, never past the lease's lifetime (``lease_max_lifetime`` after ``born``); all
        three on the monotonic clock."""
        return min(now + ttl, born + float(self.daemon.config.lease_max_lifetime))

    async def create(self, body: dict[str, Any], remote_from: str | None,
                     identity: str | None = None, account: Account | None = None) -> tuple[int, dict[str, Any]]:
        # Slurm allocates this host's GPUs (docs/slurm.md)
        if getattr(self.daemon.config, "slurm", False):
            return http_answer(NoGpuAvailable(slurm_refusal(body.get("count", 1))), "slurm")
        claimed, note, ttl = _terms(body)
        ttl = min(ttl, float(self.daemon.config.lease_max_ttl))
        # the previous run's leases first: they count against the caps and GPUs
        await self._adopted()
        # the lease's user is who the daemon can tell: the account of the user's key, else the fleet
        # member at that address -- never the 'holder' name the request declares
        holder = account.name if account is not None else f"fleet@{peer_of(remote_from)}"
        identity = _identity(account, identity or f"address {remote_from}")
        job = body.get("job")
        if job is not None and not JobId.is_valid(job):
            return http_answer(IdError(f"'job' must be a gpusd job id ({JobId.rule})"))
        try:
            kwargs = _request(json.dumps({**body, "op": "lease", "wait": False, "timeout": None}).encode())
        except ConfigError as exc:
            return http_answer(exc)
        for k in ("wait", "timeout", "command", "visible"):
            kwargs.pop(k, None)
        count = int(kwargs.get("count") or 1)
        why = self._bounds(identity, count) or await self._fleet_cap(holder, count)
        if why is not None:
            return http_answer(OverCap(why))
        # a booking of theirs held now: its GPUs go to this request
        booked = getattr(self.daemon, "bookings", None)
        for gone in booked.hand_over(holder) if booked is not None and account is not None else []:
            await self.ended(gone)
        now = time.monotonic()
        self.pending += 1
        asking, gpus = self.pending_of.get(identity, (0, 0))
        self.pending_of[identity] = (asking + 1, gpus + count)
        held = Held("", None, holder, note, remote_from, ttl, time.time(), now, self._expiry(now, now, ttl),
                    [], job, identity, claimed)
        try:
            sel = await asyncio.get_running_loop().run_in_executor(
                self.executor, self._grant_held, held, kwargs)
        except GpusdError as exc:
            # its status and reason are its class's (errors.py, docs/errors.md)
            return http_answer(exc)
        finally:
            self.pending -= 1
            asking, gpus = self.pending_of.pop(identity, (1, count))
            if asking > 1:
                self.pending_of[identity] = (asking - 1, gpus - count)
        self.held[held.lease_id] = held
        log.info("remote lease %s: %s for %s from %s (ttl %gs)", held.lease_id, ",".join(sel.uuids), holder,
                 remote_from, ttl)
        out = held.to_dict(self.daemon.hostname, self.daemon.node_id)
        self.daemon.publish("lease_granted", {"leases": [_event(out)]})
        return 201, out

    def refusal(self, lease_id: str, identity: str | None, account: Account | None,
                verb: str) -> tuple[int, dict[str, Any]] | None:
        """Why the requester may not ``verb`` the lease (None: it may): only its owner, or root of this host."""
        held = self.held.get(lease_id)
        if held is None:
            return 404, {"error": f"no remote lease {lease_id[:32]!r} here (released, or expired)"}
        if identity is None or (account is not None and account.is_root):
            # identity None: a caller inside the daemon
            return None
        if _identity(account, identity) == held.identity:
            return None
        return 403, {"error": f"the lease {held.lease_id} is {held.holder}'s: only {held.holder} (or root on "
                              f"{self.daemon.hostname}) may {verb} it", "reason": "not_owner"}

    async def renew(self, lease_id: str, body: dict[str, Any], identity: str | None = None,
                    account: Account | None = None) -> tuple[int, dict[str, Any]]:
        await self._adopted()
        refused = self.refusal(lease_id, identity, account, "renew")
        if refused is not None:
            return refused
        held = self.held[lease_id]
        over = await self._over_fleet_cap(held)
        if over is not None:
            return http_answer(OverCap(over), "fleet_cap")
        ttl = held.ttl
        if body.get("ttl") is not None:
            ttl = min(_ttl(body.get("ttl")), float(self.daemon.config.lease_max_ttl))
        now = time.monotonic()
        # never past the lease's lifetime
        deadline = self._expiry(held.born, now, ttl)
        if held.renewing:
            return 409, {"error": "a renewal of this lease is already in progress", "reason": "busy"}
        held.renewing = True
        ends = _ends(body.get("left"), held.ends)
        stale: str | None = None
        try:
            await asyncio.get_running_loop().run_in_executor(self.executor, self._renew, held, deadline, ttl,
                                                             ends)
        except DiskFull as exc:
            # The renewal counts: the kernel's locks are the lease (the record's expiry is for display), and
            # a full disk must cost no holder its GPUs.  Its record stays stale until the disk has room; a
            # daemon that restarted meanwhile would take it back by that older expiry (docs/pool.md).
            log.warning("remote lease %s renewed, its record not rewritten: %s", lease_id, exc)
            stale = str(exc)
        except (GpusdError, OSError) as exc:
            log.warning("cannot renew remote lease %s: %s", lease_id, exc)
            # a renewal that failed is this daemon's failure, whatever the error was
            return GpusdError.http_status, {**to_wire(exc, http=True), "error": f"cannot renew: {exc}"}
        finally:
            held.renewing = False
            # ended while its record was being rewritten: release now
            if held.release_after:
                self.keeping.submit(self._finish, held)
        if self.held.get(lease_id) is not held:
            return 404, {"error": f"no remote lease {lease_id[:32]!r} here (released, or expired)"}
        held.ttl, held.deadline, held.ends = ttl, deadline, ends
        out = held.to_dict(self.daemon.hostname, self.daemon.node_id)
        return 200, ({**out, "warning": stale, "reason": "disk_full"} if stale is not None else out)

    def end(self, lease_id: str, why: str) -> Held | None:
        """End a remote lease (its holder's release, its expiry, the idle policy): forgotten at once,
        released by :meth:`_finish` on :attr:`keeping` (its record, the co-holder's copies, then ours:
        the flocks drop as the last copy closes).  :meth:`ended` waits for that."""
        held = self.held.pop(lease_id, None)
        if held is None:
            return None
        # no release: its holder may still run here (daemon.fence)
        held.fence = why == "expired"
        if held.renewing:
            # never under a rewrite of its record: the renewal releases it
            held.release_after = True
        else:
            held.finished = self.keeping.submit(self._finish, held)
        log.info("remote lease %s of %s %s", lease_id, held.holder, why)
        self.daemon.publish("lease_expired" if why == "expired" else "lease_ended",
                            {"leases": [_event(held.to_dict(self.daemon.hostname, self.daemon.node_id))],
                             "reason": why})
        return held

    def _release_or_fence(self, held: Held) -> None:
        """Release ``held``'s GPUs: at once, or, for a lease that ended without a release, once its
        processes on this host are gone (:mod:`gpusd.daemon.fence`); the locks stay held till then."""
        loop = self.loop
        if not held.fence or loop is None or held.selection is None:
            held.selection.release()
            return
        from .fence import Fence, gpu_pids

        self.fencing[held.lease_id] = held

        def on_loop(fn: Any, *args: Any) -> None:
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:
                # the daemon has stopped: its locks went with it
                pass

        def done(pids: list[int]) -> None:
            on_loop(self._fenced, held, pids)

        def report(pids: list[int]) -> None:
            on_loop(self.daemon.publish, "lease_fence_stuck", {
                "leases": [_event(held.to_dict(self.daemon.hostname, self.daemon.node_id))],
                "reason": "a process of the lease still shows on its GPUs", "pids": pids[:64]})

        Fence(held.lease_id, list(held.selection.uuids), gpu_pids(self.backend), done, report).start()

    def _fenced(self, held: Held, pids: list[int] | None = None) -> None:
        if self.fencing.pop(held.lease_id, None) is None:
            # released already (the daemon stopped)
            return
        lease = _event(held.to_dict(self.daemon.hostname, self.daemon.node_id))
        held.selection.release()
        if pids is None:
            return
        log.info("remote lease %s: its processes are gone, its GPUs %s are free", held.lease_id,
                 ",".join(held.selection.uuids))
        # when the GPUs of a lease that expired are free again (docs/pool.md, "Fencing")
        self.daemon.publish("lease_fenced", {"leases": [lease], "reason": "its processes are gone",
                                             "pids": pids[:64]})

    def listing(self) -> list[dict[str, Any]]:
        return [h.to_dict(self.daemon.hostname, self.daemon.node_id) for h in self.held.values()]

    # -- the idle-release hook (gpusd.usage.idle.Releaser) ------------------------------------------
    def release(self, lease: LeaseInfo, reason: str) -> bool:
        """Release an idle remote reservation (the history's idle policy); False for other leases."""
        if lease.lease_id not in self.held:
            return False
        return self.end(lease.lease_id, f"released: {reason}"[:200]) is not None

    async def ended(self, held: Held) -> None:
        """Wait (bounded) until :meth:`end`'s release of ``held`` is done: its GPUs are free."""
        if held.finished is not None:
            await asyncio.wait({asyncio.wrap_future(held.finished)}, timeout=10.0)

    # -- expiry -------------------------------------------------------------------------------------
    async def expire_loop(self) -> None:
        self.loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(CHECK_EVERY)
            # never the wall clock: a step of it must not end (or keep) leases
            now = time.monotonic()
            for lease_id in [k for k, h in self.held.items() if h.deadline <= now]:
                self.end(lease_id, "expired")
            self.checks += 1
            if self.checks % KEEPER_CHECK_EVERY == 0 and self.keeper is not None:
                self.keeping.submit(self._check_keeper)
            if self.checks % STALE_EVERY == 0 and self.ended_ids and not self.sweeping:
                self.sweeping = True
                threading.Thread(target=self._sweep, name="gpusd-stale-leases", daemon=True).start()

    def _sweep(self) -> None:
        try:
            self.stop_stale()
        finally:
            self.sweeping = False

    def stop_stale(self) -> None:
        """Stop the processes that run under a remote lease of this host that has ended (fencing: its
        GPUs may be granted again), each said in the log and on the event stream."""
        from .fence import stop_stale

        cutoff = time.monotonic() - STALE_WINDOW
        for lease_id in [k for k, t in list(self.ended_ids.items()) if t < cutoff]:
            self.ended_ids.pop(lease_id, None)
        # a fence gives its own grace
        ids = [k for k in list(self.ended_ids) if k not in self.fencing]
        if not ids:
            return
        stopped = stop_stale(ids)
        for pid, lease_id in stopped.items():
            log.warning("process %d ran under remote lease %s, which had ended: stopped", pid, lease_id)
        if stopped and self.loop is not None:
            try:
                self.loop.call_soon_threadsafe(self.daemon.publish, "lease_stale_stopped", {
                    "reason": "a process ran under a remote lease that had ended",
                    "pids": sorted(stopped)[:64], "leases": sorted(set(stopped.values()))[:64]})
            except RuntimeError:
                # the daemon has stopped
                pass

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
        if self.adoption is not None:
            await asyncio.wait({self.adoption}, timeout=ADOPT_WAIT)
        loop = asyncio.get_running_loop()
        # a restart: the keeper (or systemd's store) keeps what it co-holds
        if self.keep_on_stop:
            await asyncio.wait({loop.run_in_executor(self.keeping, lambda: None)}, timeout=5.0)
            for lease_id, held in list(self.held.items()):
                if held.coheld and not held.renewing:
                    del self.held[lease_id]
                    held.selection.lease.forget()
                    log.info("remote lease %s left to %s as the daemon stops", lease_id,
                             "systemd's descriptor store" if self.fdstore else "the keeper")
        ending = [h for h in (self.end(k, "ended: the daemon stops") for k in list(self.held)) if h is not None]
        for held in ending:
            await self.ended(held)
        # the daemon stops: its locks go with it anyway
        for fenced in list(self.fencing.values()):
            self._fenced(fenced)
        self.keeping.shutdown(wait=False)
        self.executor.shutdown(wait=False, cancel_futures=True)
        # never the daemon's: the daemon closes that one last
        if self._own_backend is not None:
            try:
                self._own_backend.close()
            except Exception:  # noqa: BLE001
                pass


def _identity(account: Account | None, fallback: str) -> str:
    """Who a request is, for the caps and for ownership: the user of a verified key, else ``fallback``
    (the fleet signature's key id and the peer address, :func:`gpusd.daemon.access.holder_of`)."""
    return f"user {account.name}" if account is not None else fallback


def _count_lease(leases: dict[tuple[str, str], list[Any]], node: str, le: Any) -> None:
    """Count one GPU of the lease record ``le`` on ``node`` (a lease spanning several GPUs has a
    record per GPU), with its grant time (none known: ranked newest)."""
    key = (node, str(le.lease_id))
    when = float(le.started) if isinstance(le.started, (int, float)) else float("inf")
    entry = leases.setdefault(key, [when, 0, set()])
    device = le.device or str(entry[1])
    if device not in entry[2]:
        entry[2].add(device)
        entry[1] += 1
    entry[0] = min(entry[0], when)


def _event(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k not in ("env", "claimed")}


def _ends(left: object, before: float | None) -> float | None:
    """The holder's ``left`` (seconds it means to keep renewing; informational, for listings) as a time
    on this daemon's clock; anything but a number from 0 to 20 years is ignored."""
    if type(left) in (int, float) and 0 <= left <= 20 * 365 * 86400:  # type: ignore[operator]
        return time.time() + float(left)  # type: ignore[arg-type]
    return before


def _ttl(v: object) -> float:
    if type(v) not in (int, float) or not MIN_TTL <= v <= MAX_TTL:  # type: ignore[operator]
        raise ConfigError(f"'ttl' must be a number of seconds between {MIN_TTL:g} and {MAX_TTL:g}")
    return float(v)  # type: ignore[arg-type]


def _terms(body: dict[str, Any]) -> tuple[str, str | None, float]:
    holder, note = body.get("holder"), body.get("note")
    if not isinstance(holder, str) or not 0 < len(holder) <= MAX_HOLDER or not holder.isprintable():
        raise ConfigError(f"'holder' must be a printable name of 1 to {MAX_HOLDER} characters")
    if note is not None and (not isinstance(note, str) or len(note) > MAX_NOTE):
        raise ConfigError(f"'note' must be a string of at most {MAX_NOTE} characters")
    ttl = _ttl(body["ttl"]) if body.get("ttl") is not None else DEFAULT_TTL
    return holder, note, ttl


async def signer_of(request: web.Request, pool: Pool | None, daemon: PoolDaemon
                ) -> tuple[Account | None, web.Response | None]:
    """The account whose SSH key signed this write (docs/security.md "Identity"): (None, None)
    without a user signature where the daemon takes such writes, (None, refusal) otherwise."""
    from ..wire.sshsig import HEADER, SshSigError, read_header, verify
    def answer(status: int, data: object) -> web.Response:
        return web.Response(text=dumps(data, separators=(",", ":")), status=status,
                            content_type="application/json", headers={"Cache-Control": "no-store"})

    value = request.headers.get(HEADER)
    if value is None:
        if daemon.config.require_user_key:
            return None, answer(401, {"error": "this daemon takes remote writes signed with the user's SSH key: "
                                               "load your key into ssh-agent ($SSH_AUTH_SOCK) or pass --identity "
                                               "FILE (docs/security.md)", "reason": "user_key"})
        return None, None
    base = getattr(signed_request(request), "base", None)
    if not isinstance(base, bytes):
        return None, answer(401, {"error": "a user signature needs the fleet signature it signs",
                                  "reason": "user_key"})
    try:
        blob = verify(read_header(value), base)
    except SshSigError as exc:
        return None, answer(401, {"error": f"user signature refused: {exc}", "reason": "user_key"})
    # the account the signer acts as, covered by the signature its key made (gpusd 0.4; None before)
    covered = getattr(getattr(signed_request(request), "result", None), "covered_components", None) or {}
    named = covered.get('"gpusd-user"')
    users = pool.users if pool is not None else Directory(None)
    try:
        account = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(
            pool.executor if pool is not None else None, users.who, blob, request.remote, daemon.hostname,
            named if isinstance(named, str) else None), 10.0)
    except Refused as exc:
        return None, answer(403, {"error": str(exc), "reason": "unknown_key"})
    except asyncio.TimeoutError:
        return None, answer(503, {"error": "reading the accounts' authorized_keys took too long"})
    return account, None


def install(app: web.Application, daemon: PoolDaemon) -> Pool:
    pool = Pool(daemon)

    async def lifecycle(app: web.Application) -> Any:
        # before any renewal is answered
        pool.adoption = asyncio.ensure_future(pool.adopt())
        pool.task = asyncio.ensure_future(pool.expire_loop())
        yield
        await pool.close()

    app.cleanup_ctx.append(lifecycle)
    add_routes(app, routes(pool))
    return pool


def routes(pool: Pool) -> list[RouteDef]:
    """The remote leases' route table; the handlers use ``pool`` and the :class:`PoolDaemon` it
    reads the daemon through, nothing else of the daemon."""

    daemon = pool.daemon

    def answer(status: int, data: object) -> web.Response:
        return web.Response(text=dumps(data, separators=(",", ":")), status=status,
                            content_type="application/json", headers={"Cache-Control": "no-store"})

    async def body_of(request: web.Request) -> dict[str, Any]:
        if request.content_length is not None and request.content_length > MAX_BODY:
            raise ConfigError(f"a lease request is at most {MAX_BODY} bytes")
        # bounded by the app's client_max_size (the access rules may have read it)
        raw = await request.read()
        if len(raw) > MAX_BODY:
            raise ConfigError(f"a lease request is at most {MAX_BODY} bytes")
        if not raw.strip():
            return {}
        try:
            return json_object(raw)
        except ValueError:
            raise ConfigError("a lease request is a JSON object") from None

    async def who(request: web.Request) -> tuple[Account | None, web.Response | None]:
        return await signer_of(request, pool, daemon)

    async def with_body(request: web.Request, act: Callable[[dict[str, Any], str | None, Account | None],
                                                             Awaitable[tuple[int, dict[str, Any]]]]) -> web.Response:
        """A signed write with a JSON body: who sent it, its body, then ``act(body, holder, account)``."""
        account, refused = await who(request)
        if refused is not None:
            return refused
        try:
            status, data = await act(await body_of(request), holder_of(request), account)
        except ConfigError as exc:
            return answer(*http_answer(exc))
        return answer(status, data)

    async def create(request: web.Request) -> web.Response:
        return await with_body(request, lambda body, holder, account: pool.create(body, request.remote, holder,
                                                                                  account))

    async def renew(request: web.Request) -> web.Response:
        lease_id = request.match_info["id"][:64]
        return await with_body(request, lambda body, holder, account: pool.renew(lease_id, body, holder, account))

    async def delete(request: web.Request) -> web.Response:
        account, refused = await who(request)
        if refused is not None:
            return refused
        await pool._adopted()
        denied = pool.refusal(request.match_info["id"][:64], holder_of(request), account, "release")
        if denied is not None:
            return answer(*denied)
        held = pool.end(request.match_info["id"][:64], "released by its holder")
        if held is None:
            return answer(404, {"error": "no such remote lease here (released, or expired)"})
        # the GPUs are free when the answer says so
        await pool.ended(held)
        return answer(200, {"released": held.lease_id})

    async def listing(request: web.Request) -> web.Response:
        leases = pool.listing()
        if not can_see_private(request):
            for d in leases:
                d["user"] = d["command"] = d["claimed"] = None
                d["env"] = {k: v for k, v in d["env"].items() if k != "GPUSD_LEASE"}
        return answer(200, {"host": daemon.hostname, "node_id": daemon.node_id, "leases": leases})

    return [RouteDef("POST", "/api/v1/leases", create),
            RouteDef("GET", "/api/v1/leases", listing),
            RouteDef("POST", "/api/v1/leases/{id}/renew", renew),
            RouteDef("DELETE", "/api/v1/leases/{id}", delete)]
