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
        horizon = now - self.window
        if since is not None:
            items = [x for x in samples if x[0] >= since]
            if since > horizon:
                horizon = since
        else:
            items = samples  # type: ignore[assignment]
        n = len(items)
        if n == 0:
            return None, None
        if n == 1:
            return items[0][1], None
        first_ts = items[0][0]
        last_ts, last_value = items[-1]
        period = (last_ts - first_ts) / (n - 1)
        total = weight = 0.0
        prev_ts, prev_value = items[0]
        for ts, value in items:  # the first iteration covers nothing (ts == prev_ts)
            start = prev_ts if prev_ts > horizon else horizon
            if ts > start:
                total += prev_value * (ts - start)
                weight += ts - start
            prev_ts, prev_value = ts, value
        start = last_ts if last_ts > horizon else horizon
        end = last_ts + period
        if end > start:
            total += last_value * (end - start)
            weight += end - start
        if weight <= 0:
            return last_value, None
        covered = min(self.window, end - (first_ts if first_ts > horizon else horizon))
        return total / weight, round(covered, 3)
