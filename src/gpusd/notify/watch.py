"""What a notifier watches: this machine's GPUs (the lease view, woken by inotify when a lease ends)
or the fleet's verified hosts (the daemons' event streams, through a discovery client).

A watch answers two calls: :meth:`look` (a :class:`~gpusd.notify.deliver.Notice` when ``count`` GPUs
qualify now, by the rule of ``gpusd select`` or of ``gpusd reserve``; None otherwise) and
:meth:`wait` (sleep until something changed or ``timeout`` passed).  Neither takes a lease, nor
joins the queue: a notice says what was free when it was looked at (docs/notify.md)."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Protocol

from ..alloc import queue
from ..alloc.api import shared_backend
from ..alloc.leases import LeaseStore
from ..alloc.select import explain, never
from ..errors import NoGpuAvailable
from ..pool.client import rank_hosts
from .deliver import Gpu, Notice, clean_gpu, clean_host

if TYPE_CHECKING:  # pragma: no cover
    from ..alloc.select import Candidate, Constraints
    from ..discovery.sync import Client
    from ..inventory import Backend

# After a lease ends, look again after these delays (utilisation readings lag by up to a second, as
# gpusd run --wait's head does), then at least every POLL seconds: a GPU that frees without a lease
# ending (a process outside gpusd exits) is seen within POLL.
SETTLE = (0.02, 0.1, 0.3)
POLL = 1.0
# seconds between two looks woken by events, however many come (a busy fleet's stream)
MIN_GAP = 0.05
# The pace a fleet notifier asks of each host's event stream (docs/wire-format.md): a change of
# leases, processes or health at once, with every sample for a few seconds after it (the readings
# that lag it); a change of readings alone at most every PACE seconds where its constraints read
# readings (free memory, utilisation, room on a shared GPU or a MIG slice), else every SHAPE_PACE
# (its sign of life).  A hundred waiting notifiers cost a host's daemon a write each every 5 or 20
# seconds, not every sample.
PACE = 5.0
SHAPE_PACE = 20.0


def pace_for(c: Constraints) -> float:
    """The pace a fleet notifier waiting for ``c`` asks of each host (above)."""
    reads = c.min_free is not None or c.memory is not None or c.max_util is not None or c.shared or c.mig
    return PACE if reads else SHAPE_PACE


class Watch(Protocol):
    # where it looks, for the log: "on this machine", "on 3 verified host(s)"
    scope: str

    def look(self) -> Notice | None: ...

    def wait(self, timeout: float) -> None: ...

    def close(self) -> None: ...


def _gpus(chosen: list[Candidate]) -> tuple[Gpu, ...] | None:
    out = []
    for cand in chosen:
        g = clean_gpu(cand.gpu.index, cand.uuid, cand.gpu.name)
        if g is None:
            # a GPU whose index or UUID cannot be passed on is not announced
            return None
        out.append(g)
    return tuple(out)


class LocalWatch:
    """``c.count`` GPUs of this machine qualifying as ``gpusd select`` would choose them (the leases
    of both lease stores, the load, ``CUDA_VISIBLE_DEVICES`` of ``env``), read in this process
    (``backend``: NVML, or the daemon's inventory where this process has no driver library) without
    asking the daemon to choose: a hundred notifiers cost the daemon nothing."""

    def __init__(self, c: Constraints, *, simulate: str | None = None, backend: Backend | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.c = c
        self.env = env
        self.backend = backend or shared_backend(simulate)
        self.store = LeaseStore()
        hopeless = never(self.backend.snapshot(detail=False), c)
        if hopeless is not None:
            raise NoGpuAvailable(f"{c.count} GPU(s) can never qualify here ({hopeless}): nothing to wait for")
        self.store.ensure()
        self._watch = queue.LeaseWatch(self.store.dir)
        self._settle = len(SETTLE)
        self._last = 0.0
        self.scope = "on this machine"

    def look(self) -> Notice | None:
        # From here on no lease may end unseen: an end during this look wakes the next wait (reading
        # the records is no reason to wake, and is not drained after the look: that would lose an end).
        self._watch.drain()
        self._last = time.monotonic()
        snap = self.backend.snapshot(util_since=self.store.release_times(), detail=False)
        try:
            chosen = explain(snap, self.c, self.store.leases(), self.env).chosen
        except NoGpuAvailable:
            return None
        gpus = _gpus(chosen)
        return None if gpus is None else Notice(clean_host(snap.hostname), snap.node_id, gpus)

    def wait(self, timeout: float) -> None:
        gap = MIN_GAP - (time.monotonic() - self._last)
        if gap > 0:
            time.sleep(min(gap, timeout))
            timeout -= gap
        if timeout <= 0:
            return
        # a lease ended: look again soon, as the readings catch up
        if self._settle < len(SETTLE):
            delay, self._settle = min(timeout, SETTLE[self._settle]), self._settle + 1
            time.sleep(delay)
            return
        if not self._watch.active:
            time.sleep(min(timeout, POLL))
            return
        if self._watch.wait(min(timeout, POLL)):
            self._settle = 0

    def close(self) -> None:
        self._watch.close()


WAKE_EVENTS = ("device_updated", "device_added", "host_added")


class FleetWatch:
    """``c.count`` GPUs on one verified host of the fleet, ranked as ``gpusd reserve`` ranks them
    (``host``: a glob of host names, ``model``: of GPU names), woken by the hosts' events."""

    def __init__(self, client: Client, c: Constraints, *, host: str | None = None, model: str | None = None,
                 settle: float = 3.0) -> None:
        self.client, self.c, self.host, self.model = client, c, host, model
        self._wake = threading.Event()
        self._last = 0.0
        self.scope = "on the fleet"
        for ev in WAKE_EVENTS:
            client.register_event_handler(ev, self._poke)
        if not client.listening:
            client.wait_settled(settle)

    def _poke(self, _: Any) -> None:
        self._wake.set()

    def look(self) -> Notice | None:
        self._wake.clear()
        self._last = time.monotonic()
        hosts = self.client.hosts
        self.scope = f"on {sum(1 for h in hosts if h.verified is True and h.alive)} verified host(s)"
        for _, h, chosen in rank_hosts(hosts, self.c, host=self.host, model=self.model):
            gpus = _gpus(chosen)
            # the best host, as reserve would ask it first
            if gpus is not None:
                return Notice(clean_host(h.hostname), h.node_id, gpus, fleet=True)
        return None

    def wait(self, timeout: float) -> None:
        gap = MIN_GAP - (time.monotonic() - self._last)
        if gap > 0:
            time.sleep(min(gap, timeout))
            timeout -= gap
        if timeout > 0:
            self._wake.wait(min(timeout, POLL))

    def close(self) -> None:
        for ev in WAKE_EVENTS:
            self.client.unregister_event_handler(ev, self._poke)
