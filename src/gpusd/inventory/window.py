"""Utilisation averaged over a time window.

A single NVML utilisation reading is the fraction of the driver's last sample period (1/6 s to 1 s,
depending on the GPU) in which a kernel ran: one reading of a bursty job can say 0 % or 100 %.  gpusd
therefore reports the mean over a window (default 5 s):

* where the driver keeps a sample buffer (``nvmlDeviceGetSamples``, most data-centre GPUs), gpusd reads
  every sample newer than the last one it has seen and averages the samples inside the window — so even
  a one-shot ``gpusd select`` sees the last seconds, not one instant;
* elsewhere it keeps its own readings of ``nvmlDeviceGetUtilizationRates`` and averages them, weighting
  each by the time until the next one (a long-lived process such as the daemon builds the window up;
  a one-shot call has a single reading and says so with ``utilization_window = None``).
"""

from __future__ import annotations

from collections import deque


class UtilWindow:
    """Time-stamped samples of one quantity, averaged over the last ``window`` seconds."""

    __slots__ = ("window", "_samples")

    def __init__(self, window: float) -> None:
        self.window = window
        self._samples: deque[tuple[float, float]] = deque()

    def add(self, ts: float, value: float) -> None:
        samples = self._samples
        if samples and ts <= samples[-1][0]:
            return  # already seen (or clock went back): keep the series monotonic
        samples.append((ts, value))

    def _trim(self, now: float) -> None:
        samples = self._samples
        horizon = now - self.window
        # Keep one sample older than the horizon: it covers the start of the window.
        while len(samples) > 1 and samples[1][0] <= horizon:
            samples.popleft()

    def last_ts(self) -> float | None:
        return self._samples[-1][0] if self._samples else None

    def mean(self, now: float, since: float | None = None) -> tuple[float | None, float | None]:
        """(mean, seconds covered).  Each sample counts for the time until the next sample (the
        newest for one mean sample period); a lone sample gives (value, None).  With ``since``,
        only samples taken at or after that time count (None, None when there are none)."""
        self._trim(now)
        samples = self._samples
        if since is not None:
            items = [s for s in samples if s[0] >= since]
            if not items:
                return None, None
        else:
            items = list(samples)
        if not items:
            return None, None
        if len(items) == 1:
            return items[0][1], None
        horizon = now - self.window
        if since is not None:
            horizon = max(horizon, since)
        total = 0.0
        weight = 0.0
        period = (items[-1][0] - items[0][0]) / (len(items) - 1)
        for i, (ts, value) in enumerate(items):
            start = max(ts, horizon)
            end = items[i + 1][0] if i + 1 < len(items) else ts + period
            if end <= start:
                continue
            total += value * (end - start)
            weight += end - start
        if weight <= 0:
            return items[-1][1], None
        covered = min(self.window, items[-1][0] + period - max(items[0][0], horizon))
        return total / weight, round(covered, 3)
