"""The recent samples: per GPU, the last minutes of the live values in ring buffers bounded by time and
length, served at ``GET /api/v1/history`` (``gpusd start --sample-window S``).

Not the usage history (:mod:`gpusd.usage`, an SQLite database kept for a year): docs/history.md, "Two
kinds of history"."""

from __future__ import annotations

from collections import deque
from typing import Any

from ..model import HostSnapshot, finite

FIELDS = ("utilization_gpu", "memory_used", "temperature", "power_draw")


class RecentSamples:
    def __init__(self, seconds: float, interval: float) -> None:
        self.seconds = seconds
        self.maxlen = max(1, int(seconds / max(interval, 0.01)) + 1)
        self._series: dict[str, dict[str, deque[Any]]] = {}

    def add(self, snap: HostSnapshot) -> None:
        seen = set()
        for g in snap.gpus:
            seen.add(g.uuid)
            s = self._series.get(g.uuid)
            if s is None:
                s = self._series[g.uuid] = {k: deque(maxlen=self.maxlen) for k in ("t", *FIELDS)}
            s["t"].append(round(snap.timestamp, 3))
            for k in FIELDS:
                v = getattr(g, k)
                # JSON never carries NaN/Infinity
                s[k].append(finite(v) if isinstance(v, float) else v)
        for uuid in [u for u in self._series if u not in seen]:
            # a GPU that disappeared takes its history with it
            del self._series[uuid]

    def to_dict(self, seconds: float | None = None) -> dict[str, dict[str, list[Any]]]:
        out: dict[str, dict[str, list[Any]]] = {}
        for uuid, s in self._series.items():
            t = list(s["t"])
            start = 0
            if seconds is not None and t:
                cutoff = t[-1] - seconds
                while start < len(t) and t[start] < cutoff:
                    start += 1
            out[uuid] = {k: list(v)[start:] for k, v in s.items()}
        return out
