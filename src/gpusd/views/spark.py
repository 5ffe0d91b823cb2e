"""Sparklines for ``gpusd top``: each GPU's utilisation over the last hour, in block characters.

:class:`Sparks` keeps, per GPU, the points of the last ``window`` seconds: what the daemon's history
answers (``GET /api/v1/history/series?range=1h``, fetched on a worker thread about once a minute per
host, so a frame never waits on the network) plus every sample ``top`` itself shows.  Hosts read
without a daemon (``--local``) get the points ``top`` saw since it started.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from .top import HostView

BLOCKS = "▁▂▃▄▅▆▇█"
REFETCH = 60.0  # seconds between two history requests to one host


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


class Sparks:
    def __init__(self, window: float = 3600.0, width: int = 16, token: str | None = None,
                 get_json: Callable[[str, str | None, float], Any] | None = None) -> None:
        self.window = window
        self.width = width
        self.token = token
        self._get = get_json
        self.points: dict[str, dict[float, float]] = {}  # node|uuid -> {time: util}
        self._fetched: dict[str, float] = {}
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def update(self, views: list[HostView], now: float | None = None, wait: float = 0.0) -> list[HostView]:
        """Add what ``views`` show, start history fetches that are due (waiting up to ``wait``
        seconds for them: ``top --once``), and set each view's ``spark``."""
        now = time.time() if now is None else now
        futures: list[Future[None]] = []
        for h in views:
            snap = h.snapshot
            if snap is None or not h.alive:
                continue
            with self._lock:
                for g in snap.gpus:
                    if g.utilization_gpu is not None and math.isfinite(g.utilization_gpu):
                        self.points.setdefault(f"{h.key}|{g.uuid}", {})[float(snap.timestamp)] = g.utilization_gpu
            if h.url and now - self._fetched.get(h.key, -math.inf) >= REFETCH:
                self._fetched[h.key] = now
                futures.append(self._executor().submit(self._fetch, h.key, h.url, [g.uuid for g in snap.gpus], now))
        if wait > 0 and futures:
            deadline = time.monotonic() + wait
            for f in futures:
                try:
                    f.result(max(0.0, deadline - time.monotonic()))
                except Exception:  # noqa: BLE001 - a sparkline is a nicety: a slow daemon costs it, not the frame
                    pass
        start = now - self.window
        with self._lock:
            for key in list(self.points):
                pts = self.points[key]
                if len(pts) > 4000 or (pts and min(pts) < start):
                    self.points[key] = {t: v for t, v in pts.items() if t >= start}
            for h in views:
                if h.snapshot is not None:
                    h.spark = {g.uuid: sparkline(binned(self.points.get(f"{h.key}|{g.uuid}", {}).items(),
                                                        start, now, self.width))
                               for g in h.snapshot.gpus}
        return views

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(4, thread_name_prefix="gpusd-spark")
        return self._pool

    def _fetch(self, key: str, url: str, uuids: list[str], now: float) -> None:
        from urllib.parse import quote

        from .sources import base_url, get_json

        get = self._get or get_json
        for uuid in uuids[:64]:
            data = get(f"{base_url(url)}/api/v1/history/series?gpu={quote(uuid)}&range={int(self.window)}s",
                       self.token, 3.0)
            if not isinstance(data, dict):
                continue
            t, util = data.get("t"), data.get("util")
            if not isinstance(t, list) or not isinstance(util, list):
                continue
            raw_step = data.get("step")
            step = float(raw_step) if isinstance(raw_step, (int, float)) else 0.0
            fetched = {float(a) + step / 2: float(b) for a, b in zip(t[:5000], util[:5000])
                       if isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isfinite(b)}
            with self._lock:
                self.points.setdefault(f"{key}|{uuid}", {}).update(fetched)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
