"""Sparklines for ``gpusd top``: each GPU's utilisation and memory over a recent window (an hour by
default, up to 30 days with ``gpusd top --history 30d``), in block characters.

:class:`Sparks` keeps, per GPU, the points of the window: what the daemon's history answers
(``GET /api/v1/history/series``, fetched on worker threads about once a minute per host, so a frame
never waits on the network) plus every sample ``top`` itself shows.  Hosts read without a daemon
(``--local``), and hosts that did not prove they hold the fleet secret (``verified`` False: a stranger
gets no request from ``top``), get the points ``top`` saw since it started.
"""

# Imports inside functions: start-up (gpusd top imports this module).
from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from .sources import get_json

if TYPE_CHECKING:  # pragma: no cover
    from ..wire.signing import FleetKey
    from .top import HostView

BLOCKS = "▁▂▃▄▅▆▇█"
# seconds between two history requests to one host
REFETCH = 60.0
# kept per GPU and metric
MAX_POINTS = 20000


def sparkline(values: Sequence[float | None], width: int | None = None) -> str:
    """``values`` (percent, 0-100) as block characters; a missing value is a space."""
    out = []
    for v in values[-width:] if width else values:
        if v is None or not math.isfinite(v):
            out.append(" ")
        else:
            out.append(BLOCKS[min(len(BLOCKS) - 1, max(0, int(v / 100 * len(BLOCKS))))])
    return "".join(out)


def binned(points: Iterable[tuple[float, float]], start: float, end: float, bins: int) -> list[float | None]:
    """The mean of ``points`` (time, value) in each of ``bins`` equal slices of [start, end)."""
    sums, counts = [0.0] * bins, [0] * bins
    span = (end - start) / bins
    for t, v in points:
        i = int((t - start) // span)
        if 0 <= i < bins:
            sums[i] += v
            counts[i] += 1
    return [s / c if c else None for s, c in zip(sums, counts)]


def window_label(seconds: float) -> str:
    """``3600`` -> ``1h``, ``2592000`` -> ``30d``: the column header's range."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


def _finite(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


class Sparks:
    def __init__(self, window: float = 3600.0, width: int = 16, key: FleetKey | None = None,
                 get_json: Callable[[str, FleetKey | None, float], Any] | None = None) -> None:
        self.window = window
        self.width = width
        # the fleet secret's keys: requests signed (the series themselves are public)
        self.key = key
        self._get = get_json
        # node|uuid -> {"util": {time: %}, "mem": {time: %}}
        self.points: dict[str, dict[str, dict[float, float]]] = {}
        self._fetched: dict[str, float] = {}
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    @property
    def label(self) -> str:
        return window_label(self.window)

    def _add(self, key: str, metric: str, t: float, v: float | None) -> None:
        if v is not None:
            self.points.setdefault(key, {}).setdefault(metric, {})[t] = v

    def update(self, views: list[HostView], now: float | None = None, wait: float = 0.0) -> list[HostView]:
        """Add what ``views`` show, start history fetches that are due (waiting up to ``wait``
        seconds for them: ``top --once``), and set each view's ``spark`` and ``spark_mem``."""
        now = time.time() if now is None else now
        futures: list[Future[None]] = []
        for h in views:
            snap = h.snapshot
            if snap is None or not h.alive:
                continue
            with self._lock:
                for g in snap.gpus:
                    key, t = f"{h.key}|{g.uuid}", float(snap.timestamp)
                    self._add(key, "util", t, _finite(g.utilization_gpu))
                    ratio = g.memory_used_ratio
                    self._add(key, "mem", t, None if ratio is None else 100 * ratio)
            # A host that failed to prove it holds the fleet secret (a stranger announcing itself) is
            # not asked anything: its sparklines show what top itself sees of it.
            if h.url and h.verified is not False and now - self._fetched.get(h.key, -math.inf) >= REFETCH:
                self._fetched[h.key] = now
                futures.append(self._executor().submit(self._fetch, h.key, h.url, [g.uuid for g in snap.gpus]))
        if wait > 0 and futures:
            deadline = time.monotonic() + wait
            for f in futures:
                try:
                    f.result(max(0.0, deadline - time.monotonic()))
                except Exception:  # noqa: BLE001 - a sparkline is a nicety: a slow daemon costs it, not the frame
                    pass
        start = now - self.window
        with self._lock:
            for series in self.points.values():
                for metric, pts in series.items():
                    if len(pts) > MAX_POINTS or (pts and min(pts) < start):
                        series[metric] = {t: v for t, v in pts.items() if t >= start}
            for h in views:
                if h.snapshot is None:
                    continue
                for attr, metric in (("spark", "util"), ("spark_mem", "mem")):
                    setattr(h, attr, {g.uuid: sparkline(binned(
                        self.points.get(f"{h.key}|{g.uuid}", {}).get(metric, {}).items(), start, now, self.width))
                        for g in h.snapshot.gpus})
                h.spark_label = self.label
        return views

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(4, thread_name_prefix="gpusd-spark")
        return self._pool

    def _fetch(self, key: str, url: str, uuids: list[str]) -> None:
        from ..discovery.fleetview import base_url

        get = self._get or get_json
        for uuid in uuids[:64]:
            data = get(f"{base_url(url)}/api/v1/history/series?gpu={quote(uuid)}&range={int(self.window)}s",
                       self.key, 3.0)
            if not isinstance(data, dict) or not isinstance(data.get("t"), list):
                continue
            step = _finite(data.get("step")) or 0.0
            total = _finite(data.get("memory_total"))
            times = [_finite(t) for t in data["t"][:5000]]
            raw_util, raw_mem = data.get("util"), data.get("mem")
            util: list[Any] = raw_util if isinstance(raw_util, list) else []
            mem: list[Any] = raw_mem if isinstance(raw_mem, list) else []
            with self._lock:
                for i, t in enumerate(times):
                    if t is None:
                        continue
                    mid = t + step / 2
                    self._add(f"{key}|{uuid}", "util", mid, _finite(util[i]) if i < len(util) else None)
                    m = _finite(mem[i]) if i < len(mem) else None
                    self._add(f"{key}|{uuid}", "mem", mid, 100 * m / total if m is not None and total else None)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
