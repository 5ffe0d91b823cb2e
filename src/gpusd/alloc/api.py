"""The in-process allocation API: ``gpusd.select(...)`` and the :class:`Selection` it returns.

>>> import gpusd
>>> with gpusd.select(count=2, min_free="20GiB") as sel:   # least-loaded GPUs, leased
...     sel.apply()                                          # CUDA_VISIBLE_DEVICES + CUDA_DEVICE_ORDER
...     import torch                                         # sees exactly those two GPUs
"""

# Imports inside functions: start-up (quick commands import this module).
from __future__ import annotations

import os
import time

from ..errors import ConfigError, GpusdError, NoGpuAvailable, WaitTimeout
from ..inventory import Backend
from ..inventory.vendors import Visible, visible_env
from ..model import GpuInfo, LeaseInfo
from ..record import field, record, replace

# its name here stays importable
from .backend import shared_backend as shared_backend
from .env import apply_visible
from .handle import Holder, LeaseHandle
from .leases import LeaseStore
from .select import Candidate, Constraints, constraint_keywords, explain, never

# typing is not imported at run time: start-up time
TYPE_CHECKING = False

if TYPE_CHECKING:
    from typing import Any, Callable, Iterable

    from ..model import HostSnapshot
    from . import queue
    from .placement import Pick

class Selection:
    """GPUs chosen for a job, with the lease that keeps them its own (when one was taken)."""

    def __init__(self, chosen: list[Candidate], lease: LeaseHandle | None, use_uuid: bool = False,
                 pick: Pick | None = None) -> None:
        self.devices = chosen
        self.lease = lease
        self.use_uuid = use_uuid
        # why these devices (None: not told, e.g. by a daemon's lease answer)
        self.pick = pick

    @property
    def gpus(self) -> list[GpuInfo]:
        """The chosen GPUs, with the fields selection reads (memory, utilisation, processes, MIG);
        ``gpusd.local_snapshot()`` has temperature, power and process owners too."""
        return [c.gpu for c in self.devices]

    @property
    def indices(self) -> list[int | str]:
        """NVML indices (nvidia-smi's); ``"gpu:slice"`` for MIG slices."""
        return [c.gpu.index if c.mig is None else c.label for c in self.devices]

    @property
    def uuids(self) -> list[str]:
        return [c.uuid for c in self.devices]

    @property
    def visible(self) -> list[Visible]:
        """The devices as their vendors' runtimes number them (:mod:`gpusd.inventory.vendors`)."""
        return [Visible.of(c.gpu, c.uuid, c.mig is not None) for c in self.devices]

    def env(self, use_uuid: bool | None = None) -> dict[str, str]:
        """The visibility variables for these devices (plus ``GPUSD_LEASE``): ``CUDA_DEVICE_ORDER`` and
        ``CUDA_VISIBLE_DEVICES`` for NVIDIA GPUs, ``ROCR_VISIBLE_DEVICES`` for AMD, ``ZE_AFFINITY_MASK``
        for Intel."""
        use = self.use_uuid if use_uuid is None else use_uuid
        variables = visible_env(self.visible, use_uuid=use)
        if self.lease is not None:
            variables["GPUSD_LEASE"] = self.lease.lease_id
            if self.lease.epoch is not None:
                variables["GPUSD_LEASE_EPOCH"] = str(self.lease.epoch)
        return variables

    def apply(self, use_uuid: bool | None = None) -> dict[str, str]:
        """Set the variables in ``os.environ`` (and remove those of the chosen vendors that would mask
        again, e.g. an inherited ``HIP_VISIBLE_DEVICES`` beside ``ROCR_VISIBLE_DEVICES``); warns if
        CUDA is already initialised (too late)."""
        use = self.use_uuid if use_uuid is None else use_uuid
        variables = apply_visible(self.visible, use_uuid=use)
        if self.lease is not None:
            variables["GPUSD_LEASE"] = self.lease.lease_id
            os.environ["GPUSD_LEASE"] = self.lease.lease_id
            if self.lease.epoch is not None:
                variables["GPUSD_LEASE_EPOCH"] = os.environ["GPUSD_LEASE_EPOCH"] = str(self.lease.epoch)
        return variables

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()

    def __enter__(self) -> Selection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        held = f" lease={self.lease.lease_id}" if self.lease else ""
        return f"<Selection {self.indices}{held}>"

    def to_dict(self) -> dict[str, Any]:
        return {
            "devices": [
                {"index": c.gpu.index, "label": c.label, "uuid": c.uuid, "name": c.gpu.name,
                 "mig_profile": c.mig.profile if c.mig else None, "memory_free": c.free,
                 "memory_total": c.total, "utilization_gpu": c.util}
                for c in self.devices
            ],
            "lease": self.lease.lease_id if self.lease else None,
            "env": self.env(),
            "explain": self.pick.to_dict() if self.pick is not None else None,
        }


class _NotHead(Exception):
    """Someone joined the queue ahead of us (a higher class) while we were its head."""


@record(frozen=True)
class LeaseRequest:
    """What :func:`allocate` is asked: GPUs satisfying ``constraints``, leased (``lease``) or only
    chosen, for ``holder`` (default: this process).  ``wait``: queue (by priority class, then first
    come first served), for ``timeout`` seconds at most (None: for ever), looking again at the latest
    every ``poll`` seconds.  ``env``: the job's ``CUDA_VISIBLE_DEVICES`` when it is not this
    process's; ``simulate``: the simulated GPUs to choose among.  ``priority`` is believed up to what
    the priority policy allows ``holder.uid`` (default: this process's user); ``resume`` marks a
    preempted job (it keeps its place in its class from when its process started).  ``cancelled``
    stops a wait (the daemon's client went away); ``when_blocked`` is called, outside the mutex,
    each time the job at the head of the queue finds nothing qualifying (a job preempts there);
    ``queued`` is called once, outside the mutex, as soon as the wait's ticket is in the queue (a
    preempted job gives its GPUs back then, keeping its place ahead of those who queue meanwhile;
    ``gpusd run`` gives its start slot back).  ``place``: the lease authority's only — a waiter's
    place its previous daemon left (:class:`gpusd.alloc.queue.Place`'s ticket), waited with instead
    of a new ticket; ``keep_place`` is offered the ticket of a wait that ends unserved, and keeps it
    (True: the caller's now, to leave for the next daemon as this one stops) or not."""

    constraints: Constraints
    lease: bool = True
    wait: bool = False
    timeout: float | None = None
    poll: float = 1.0
    simulate: str | None = None
    holder: Holder = field(default_factory=Holder)
    env: dict[str, str] | None = None
    priority: int | None = None
    resume: bool = False
    cancelled: Callable[[], bool] | None = None
    when_blocked: Callable[[], object] | None = None
    queued: Callable[[], object] | None = None
    place: queue.Ticket | None = None
    keep_place: Callable[[queue.Ticket], bool] | None = None
    # a booking's hold from its start (gpusd.daemon.bookings): its GPUs are no waiter's to take (the
    # booking keeps them off), so it does not queue behind them
    booking: bool = False


def _attempt(backend: Backend, store: LeaseStore, req: LeaseRequest, level: int, ticket: queue.Ticket | None = None,
             deadline: float | None = None) -> Selection:
    """One look: choose for ``req`` (of believed priority ``level``) and, for a lease, take it."""
    c, holder = req.constraints, req.holder
    snap, confirm = _pick_snapshot(backend, store.release_times(), c.count > 1)
    if not req.lease:
        why = explain(snap, c, store.leases(), req.env, confirm)
        return Selection(why.chosen, None, pick=why)
    # a lease: the queue, the fair-use caps and the priority classes (imported here: select and env take none)
    from . import policy as _policy
    from . import queue
    from .leases import current_user
    from .priority import priority_name

    with store.mutex(deadline):
        if ticket is None:
            queued = [] if req.booking else queue.ahead_of_newcomer(store, level)
            if queued:
                raise NoGpuAvailable(f"{len(queued)} job(s) are waiting for GPUs ahead of this one (priority "
                                     f"{priority_name(level)}; first come, first served within a priority); "
                                     "use --wait to queue")
        elif queue.ahead_of(store, ticket) is not None:
            raise _NotHead()
        held = store.leases(cleanup=True)
        user = holder.user or current_user()
        # the fair-use caps (alloc/policy.py)
        _policy.check(user, c.count, held)
        # GPUs booked ahead (gpusd reserve --at) go only to requests done before the booking starts
        from . import bookings as _bookings

        # bookings are wall-clock times (docs/pool.md, "Clocks")
        now = time.time()
        blocking = _bookings.in_the_way(_bookings.current(), user, c.time_limit, now)
        if blocking:
            c = replace(c, exclude=[*(c.exclude or []), *{u for b in blocking for u in b.devices}])
        try:
            return _take(snap, c, req, store, held, holder, confirm)
        except NoGpuAvailable as exc:
            if not blocking or isinstance(exc, _policy.OverCap):
                raise
            raise NoGpuAvailable(f"{exc}; {_bookings.refusal(blocking, c.time_limit, now)}") from None


def _pick_snapshot(backend: Backend, util_since: dict[str, float],
                   pairs: bool) -> tuple[HostSnapshot, Callable[[GpuInfo], bool] | None]:
    """The snapshot a pick weighs, and how to read a GPU's process lists it left unread
    (:meth:`gpusd.inventory.base.VendorBackend.pick_snapshot`: the chosen GPUs' lists only; not part
    of the Backend protocol, so a backend without it reads them all)."""
    later = getattr(backend, "pick_snapshot", None)
    if later is None:
        return backend.snapshot(util_since=util_since, detail=False), None
    result: tuple[HostSnapshot, Callable[[GpuInfo], bool]] = later(util_since, pairs)
    return result


def _take(snap: HostSnapshot, c: Constraints, req: LeaseRequest, store: LeaseStore, held: list[LeaseInfo],
          holder: Holder, confirm: Callable[[GpuInfo], bool] | None = None) -> Selection:
    """Choose and lock, under the selection mutex (the caller's)."""
    # A GPU whose lock turns out to be held (by a process that bypassed the mutex, a lease the other
    # store published at the same moment, a lock nothing here could see) costs that GPU only: the
    # choice is made again without it, at most once per GPU, so one stuck GPU never fails every request.
    store.refused = None
    for _ in range(len(snap.gpus) + 1):
        try:
            why = explain(snap, c, held, req.env, confirm)
        except NoGpuAvailable:
            if store.refused is None:
                raise
            # nothing else qualifies: the refusal is the reason
            break
        chosen = why.chosen
        memory = c.memory
        if memory is None and isinstance(c.min_free, float):
            totals = [x.total for x in chosen if x.total]
            memory = int(c.min_free * min(totals)) if totals else None
        store.refused = None
        lease = store.acquire([x.uuid for x in chosen], shared=c.shared, memory=memory, holder=holder)
        if lease is not None:
            return Selection(chosen, lease, pick=why)
        if store.refused is None:
            break
        held = [*held, LeaseInfo(lease_id="-", pid=0, device=store.refused, unleased=True,
                                 command=store.refusal)]
    raise NoGpuAvailable(f"the chosen GPUs were taken at the same moment ({store.refusal}); try again")


# After a lease ends, look again after these delays (the driver's utilisation readings lag by up to
# a second), then every ``recheck`` seconds until the next lease ends.
SETTLE = (0.02, 0.05, 0.1, 0.2, 0.4)
# seconds between two looks of the head woken by events, however often (its timer's are its own)
MIN_GAP = 0.02


def _believed(req: LeaseRequest) -> int:
    """The priority class ``req`` waits and leases in: what it claims, up to what the priority policy
    allows its holder's uid (default: this process's user)."""
    from .policy import load_priority_policy
    from .priority import NORMAL

    uid = os.geteuid() if req.holder.uid is None else req.holder.uid
    return load_priority_policy().believed(NORMAL if req.priority is None else req.priority, uid)


def allocate(req: LeaseRequest, *, store: LeaseStore | None = None, backend: Backend | None = None) -> Selection:
    """Choose (and lease) devices as ``req`` asks; with ``req.wait``, queue (by priority class, then
    first come first served: :mod:`gpusd.alloc.queue`).

    Where a gpusd daemon serves the lease socket (:mod:`gpusd.alloc.authority`), a lease is asked of
    it; otherwise (or with an explicit ``store``, ``backend``, simulation or holder's pid) it is taken
    in the lock directory.  The head of the queue tries again when a lease ends (see
    :mod:`gpusd.alloc.queue`), and at the latest every ``req.poll`` seconds.  Every wait for the
    selection mutex is bounded (``req.timeout``, and :func:`gpusd.alloc.leases.mutex_timeout`).
    ``req.holder.job``: the gpusd job the lease is for, named in its record (and, through the daemon,
    the lease can then grow and shrink)."""
    c, holder, wait, timeout, simulate = req.constraints, req.holder, req.wait, req.timeout, req.simulate
    poll, cancelled, when_blocked = req.poll, req.cancelled, req.when_blocked
    # a look without a lease or a queue has no priority
    level = _believed(req) if req.lease or wait else 0
    if timeout is not None and not timeout >= 0:  # also refuses nan
        raise ConfigError(f"the timeout must be a number of seconds >= 0, not {timeout!r}")
    if (store is None and backend is None and simulate is None and holder.pid is None
            and not os.environ.get("GPUSD_SIMULATE")):
        from . import authority

        sock = authority.connect()
        end = time.monotonic() + timeout if timeout is not None else None
        requeued = False
        # the daemon leases, or chooses (its GPUs may be simulated: no driver here)
        while sock is not None:
            left = None if end is None else max(0.0, end - time.monotonic())
            try:
                if not req.lease:
                    chosen, why = authority.choose_through(sock, c, wait=wait, timeout=left, command=holder.command,
                                                           priority=req.priority, requeue=requeued)
                    return Selection(chosen, None, pick=why)
                chosen, held = authority.lease_through(sock, c, wait=wait, timeout=left, holder=holder,
                                                       priority=req.priority, requeue=requeued)
                return Selection(chosen, held)
            except authority.AuthorityBusy:
                # the same leases (or choice), taken here
                break
            except authority.AuthorityHung as exc:
                # the same, said in one line: the user waited a few seconds
                import sys

                print(f"gpusd: {exc}; {'leasing' if req.lease else 'choosing'} in the lock directory "
                      f"{(store or LeaseStore()).dir} instead", file=sys.stderr, flush=True)
                break
            except authority.DaemonGone:
                # The daemon stopped (or died) while we waited: ask its successor, which keeps our
                # place, or wait in the lock directory when none comes (docs/allocation.md, "Waiting").
                sock = authority.reconnect(authority.REQUEUE_WAIT if end is None
                                           else min(authority.REQUEUE_WAIT, max(0.0, end - time.monotonic())),
                                           cancelled)
                if cancelled is not None and cancelled():
                    if sock is not None:
                        sock.close()
                    raise GpusdError("the wait was cancelled") from None
                if sock is None:
                    authority.say(f"the gpusd daemon stopped while this job waited and none answered within "
                                  f"{authority.REQUEUE_WAIT:g}s: waiting in the lock directory's queue instead")
                    # what is left of the wait's own bound
                    if end is not None:
                        timeout = max(0.0, end - time.monotonic())
                requeued = True
    backend = backend or shared_backend(simulate)
    store = store or LeaseStore()
    if not wait:
        return _attempt(backend, store, req, level)
    hopeless = never(backend.snapshot(detail=False), c)
    # no load or lease ending can help: say so now instead of waiting for ever
    if hopeless is not None:
        raise NoGpuAvailable(f"no {'MIG slice' if c.mig else 'GPU'}s available: need {c.count} ({hopeless}); "
                             "waiting cannot help")
    from . import policy as _policy
    from . import queue
    from .placement import pick  # noqa: F401  (the first pick imports it: now, not at the hand-over)

    deadline = time.monotonic() + timeout if timeout is not None else None
    last: Exception | None = None
    # a place kept across a restart of the daemon
    ticket: queue.Ticket | None = req.place
    if ticket is None:
        try:
            with store.mutex(deadline):
                ticket = queue.enqueue(store, c.count, holder.command, holder.pid, holder.user, priority=level,
                                       resume=req.resume, uid=holder.uid)
        except WaitTimeout as exc:
            last = exc
    watch: queue.LeaseWatch | None = None
    # A new head looks again soon too: a lease may have ended just before it began to watch, with
    # utilisation readings not yet caught up.
    settle = 0
    last_look = 0.0
    # this look comes from the head's own timer (not from an event)
    timed = False
    try:
        if ticket is not None and req.queued is not None:
            # (inside: whatever it raises, the ticket is closed below)
            req.queued()
        while ticket is not None:
            ahead = queue.ahead_of(store, ticket)
            if ahead is not None:
                if watch is None:
                    watch = queue.LeaseWatch(store.dir)
                # Look again now and then: aging may change the order, and two waiters whose clocks
                # straddle an aging step could each wait for the other until one looks again.
                until = time.monotonic() + queue.RECHECK_ORDER
                if not queue.wait_for(ahead, until if deadline is None else min(deadline, until), watch=watch,
                                      cancelled=cancelled):
                    if (deadline is not None and time.monotonic() >= deadline) or (cancelled and cancelled()):
                        break
                continue
            if watch is None:
                # before looking: no lease may end unseen
                watch = queue.LeaseWatch(store.dir)
            else:
                watch.drain()
            if cancelled is not None and cancelled():
                break
            # events anyone can cause (a ticket written, a lock file closed) must not make it spin; its own timer's
            # looks are bounded by the timer
            if not timed:
                gap = MIN_GAP - (time.monotonic() - last_look)
                if gap > 0:
                    time.sleep(gap)
                last_look = time.monotonic()
            timed = False
            try:
                return _attempt(backend, store, req, level, ticket, deadline)
            except _NotHead:
                continue
            except WaitTimeout as exc:
                last = exc
                break
            except _policy.OverCap:
                # a cap is the policy's answer, not a wait: a capped head would hold up the others
                raise
            except NoGpuAvailable as exc:
                last = exc
                # Our own look closed lock files (a failed acquire opens and closes them): those
                # closes are not a lease ending, and waking on them would spin.
                watch.drain()
                if when_blocked is not None:
                    when_blocked()
            if not watch.active:
                delay = min(poll, 0.1)
            elif settle < len(SETTLE):
                delay, settle = SETTLE[settle], settle + 1
            else:
                delay = poll
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                delay = min(delay, left)
            if watch.active:
                if watch.wait(delay):
                    settle = 0
                else:
                    timed = True
            else:
                time.sleep(delay)
            if deadline is not None and time.monotonic() >= deadline:
                # one last look at the deadline (the mutex gets half a second more)
                try:
                    return _attempt(backend, store, req, level, ticket, time.monotonic() + 0.5)
                except (WaitTimeout, _NotHead):
                    # the mutex: the reason given is still the GPUs'
                    pass
                except _policy.OverCap:
                    raise
                except NoGpuAvailable as exc:
                    last = exc
                break
    finally:
        if ticket is not None:
            if req.keep_place is None or not req.keep_place(ticket):
                ticket.close()
        if watch is not None:
            watch.close()
    if cancelled is not None and cancelled():
        raise GpusdError("the wait was cancelled")
    detail = f": {last}" if last else " (still queued behind other jobs)"
    raise WaitTimeout(f"gave up waiting after {timeout:g}s{detail}")


def select(count: int = 1, *, min_free: str | int | float | None = None, memory: str | int | None = None,
           max_util: float | None = None, max_processes: int | None = None,
           include: str | Iterable[int | str] | None = None, exclude: str | Iterable[int | str] | None = None,
           mig: bool = False, by: str = "load", share: bool = False, topology: str = "auto", lease: bool = True,
           wait: bool = False,
           timeout: float | None = None, use_uuid: bool = False, within_visible: bool = True,
           simulate: str | None = None, vendor: str | None = None, time_limit: float | None = None) -> Selection:
    """Pick the ``count`` least-loaded GPUs that satisfy the constraints and (by default) lease them.
    ``time_limit``: the seconds the GPUs are needed at most; GPUs booked to start later (``gpusd reserve
    --at``) may then be given (backfill, docs/pool.md "Time").

    The lease lasts until :meth:`Selection.release`, the end of a ``with`` block, or the end of the
    process — whichever comes first; no other gpusd selection on this machine gets these GPUs
    meanwhile.  ``vendor`` (``"nvidia"``, ``"amd"``, ``"intel"``; default any) keeps to one vendor's GPUs.
    Raises :class:`gpusd.NoGpuAvailable` (or :class:`gpusd.WaitTimeout` with ``wait``)."""
    # the constraint keywords are Constraints' fields (test_select checks the signature)
    given = locals()
    c = Constraints.from_keywords(**{k: given[k] for k in constraint_keywords()})
    sel = allocate(LeaseRequest(c, lease=lease, wait=wait, timeout=timeout, simulate=simulate))
    sel.use_uuid = use_uuid
    return sel
