"""GPU-seconds used and held, per GPU and per user, counted from every sample since the daemon started
(:class:`UsageCounters`): what ``/metrics`` exports as ``gpusd_gpu_used_seconds_total`` and its kin
(:class:`~gpusd.daemon.metrics.UsageCollector`).

Apart from :mod:`.metrics` so that a daemon at rest counts without the Prometheus rendering, which is
loaded on the first scrape (daemon memory at rest).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from ..model import GpuInfo, HostSnapshot

# the labels of every per-GPU series of /metrics
GPU_LABELS = ("host", "uuid", "index", "model")


def gpu_labels(snap: HostSnapshot, g: GpuInfo) -> list[str]:
    """The values of :data:`GPU_LABELS` for ``g`` of ``snap``."""
    return [snap.hostname, g.uuid, str(g.index), g.name or ""]


class UsageCounters:
    """GPU-seconds used (a process ran on the GPU) and held (a gpusd lease held it), per GPU and per
    user, since the daemon started: counters a Grafana panel sums over any range (``increase(...[7d])``)
    to answer "who used what" without ``gpusd report``.  Fed every new sample (:meth:`add`); a GPU
    used by two users gives each half the interval, as the history does (docs/history.md).  A gap
    longer than ``max_gap`` (a suspended machine) counts as ``max_gap``."""

    # distinct users kept (a hostile process name cannot grow this without bound)
    MAX_USERS = 4096

    def __init__(self, max_gap: float = 30.0) -> None:
        self.max_gap = max_gap
        self._prev: HostSnapshot | None = None
        # GPU labels -> [used_s, held_s]
        self.gpu: dict[tuple[str, str, str, str], list[float]] = {}
        # (host, user) -> [used_s, held_s]
        self.user: dict[tuple[str, str], list[float]] = {}

    def add(self, snap: HostSnapshot) -> None:
        prev, self._prev = self._prev, snap
        for g in snap.gpus:
            self.gpu.setdefault(tuple(gpu_labels(snap, g)), [0.0, 0.0])  # type: ignore[arg-type]
        if prev is None or snap.timestamp <= prev.timestamp:
            return
        dt = min(snap.timestamp - prev.timestamp, self.max_gap)
        # the interval just ended is accounted to what the previous sample showed
        for g in prev.gpus:
            acc = self.gpu.setdefault(tuple(gpu_labels(prev, g)), [0.0, 0.0])  # type: ignore[arg-type]
            users = sorted({p.user or "" for p in g.processes})
            holders = sorted({lease.user or "" for lease in g.leases})
            for i, who in ((0, users), (1, holders)):
                if not who:
                    continue
                acc[i] += dt
                for u in who:
                    key = (prev.hostname, u or "unknown")
                    if key in self.user or len(self.user) < self.MAX_USERS:
                        self.user.setdefault(key, [0.0, 0.0])[i] += dt / len(who)
