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

The mean is a time-weighted one: each reading holds until the next, the newest for one mean reading
period.  Each read costs the same however often readings arrive: readings are kept in at most
``SLOTS`` (+2) time slots of ``window / SLOTS`` seconds, each with its share of a running integral, so
``add`` and ``mean`` are O(1) amortised and memory is bounded.  Readings further apart than a slot
(driver samples every 1/6 s or more, the daemon's 1 s sampling) each have a slot of their own and
the mean is exact; readings closer together share a slot, whose integral is exact, and only where
the window's start (or ``since``) falls inside a shared slot is that slot's share of it prorated
(at most one slot's width, 2 % of the window).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque

SLOTS = 50


def round_ms(seconds: float) -> float:
    """``round(seconds, 3)``, the same float, for a fifth less where it is not a tie (issue
    24: a snapshot rounds each GPU's seconds covered).  ``round(x, 3)`` rounds the exact value of ``x``
    to the nearest multiple of 1/1000 (ties to even) and returns the float nearest to that decimal;
    here ``y = x * 1000`` is within 2**-24 of ``x``'s exact thousands for ``0 < y < 2**29``, so where ``y``
    is further than that from a tie it rounds to the same integer ``k``, and ``k / 1000`` (integers
    exact as floats, one correctly rounded division) is the float nearest to ``k/1000``.  Elsewhere, and
    near a tie: ``round`` itself.  ``tests/inventory/test_window.py`` compares the two."""
    y = seconds * 1000.0
    # 2**29 (and not -0.0, which round keeps)
    if 0.0 < y < 536870912.0:
        k = round(y)
        if -0.4999 < y - k < 0.4999:
            return k / 1000
    return round(seconds, 3)


class _Slot:
    """Readings from ``start`` to ``last``: ``acc`` is the running integral (value x seconds since the
    first reading ever kept) at ``start``; ``n`` the number of readings before this slot."""

    __slots__ = ("acc", "count", "last", "n", "start", "value")

    def __init__(self, start: float, value: float, acc: float, n: int) -> None:
        self.start = start
        self.last = start
        # the newest reading in the slot
        self.value = value
        self.acc = acc
        self.n = n
        self.count = 1


class UtilWindow:
    """Time-stamped samples of one quantity, averaged over the last ``window`` seconds."""

    __slots__ = ("_acc", "_n", "_slots", "_starts", "resolution", "window")

    def __init__(self, window: float) -> None:
        self.window = window
        self.resolution = window / SLOTS
        self._slots: deque[_Slot] = deque()
        # slot starts, for bisect
        self._starts: deque[float] = deque()
        # running integral up to the newest reading
        self._acc = 0.0
        self._n = 0  # readings ever kept

    def add(self, ts: float, value: float) -> None:
        slots = self._slots
        if slots:
            cur = slots[-1]
            if ts <= cur.last:
                # already seen (or clock went back): keep the series monotonic
                return
            # the previous reading held until now
            self._acc += cur.value * (ts - cur.last)
            self._n += 1
            if ts - cur.start < self.resolution:
                cur.last, cur.value = ts, value
                cur.count += 1
                return
        else:
            self._acc, self._n = 0.0, 1
        slots.append(_Slot(ts, value, self._acc, self._n - 1))
        self._starts.append(ts)
        # bound memory where nobody reads the mean
        if len(slots) > 2 * SLOTS:
            self._trim(ts, ts - 2 * self.window)

    def add_mean(self, ts: float, value: float) -> tuple[float | None, float | None]:
        """``add(ts, value)`` then ``mean(ts)``, in one call: what a backend that keeps its own readings
        does for each GPU in each snapshot.  The same numbers, bit for bit, as the two calls (the same
        operations in the same order, written for the case: the reading just added is the newest, and
        the window's start is in its first slot; ``tests/inventory/test_window.py`` checks them against
        each other and against the definition), in half the time."""
        slots = self._slots
        if not slots:
            self.add(ts, value)
            return value, None  # a lone reading
        cur = slots[-1]
        last = cur.last
        if ts <= last:
            # not added (already seen, or the clock went back)
            return self.mean(ts)
        acc = self._acc = self._acc + cur.value * (ts - last)
        n = self._n = self._n + 1
        if ts - cur.start < self.resolution:
            cur.last = ts
            cur.value = value
            cur.count += 1
        else:
            slots.append(_Slot(ts, value, acc, n - 1))
            self._starts.append(ts)
            if len(slots) > 2 * SLOTS:
                self._trim(ts, ts - 2 * self.window)
        window = self.window
        horizon = ts - window
        first = slots[0]
        first_ts = first.start
        if horizon <= first_ts and horizon < ts:
            # The window's start is before its first reading (a backend younger than its window): the
            # integral from that reading, then the newest reading's period (mean(), without its
            # branches for a horizon inside the readings or past the newest).
            n -= first.n
            if n == 1:
                return value, None
            end = ts + (ts - first_ts) / (n - 1)
            total, weight = acc - first.acc, ts - first_ts
            tail = end - ts
            if tail > 0:
                total += value * tail
                weight += tail
            covered = end - first_ts
            if covered >= window:
                return total / weight, window
            # round_ms(covered), inline (the call is a third of its cost)
            y = covered * 1000.0
            if 0.0 < y < 536870912.0:
                k = round(y)
                if -0.4999 < y - k < 0.4999:
                    return total / weight, k / 1000
            return total / weight, round(covered, 3)
        full = horizon > first_ts
        # the trim (as in mean), then the integral up to the horizon
        if full:
            while len(slots) > 1 and slots[1].start <= horizon:
                slots.popleft()
                self._starts.popleft()
            first = slots[0]
            first_ts = first.start
            full = horizon > first_ts
        n -= first.n
        if n == 1:
            return value, None
        period = (ts - first_ts) / (n - 1)
        # _acc_at(0, horizon), inline
        if full:
            f_acc, f_last, f_value = first.acc, first.last, first.value
            if len(slots) == 1:
                inside = acc - f_acc
            else:
                nxt = slots[1]
                inside = nxt.acc - f_acc - f_value * (nxt.start - f_last)
            if horizon >= f_last:
                start_acc = f_acc + inside + f_value * (horizon - f_last)
            else:
                start_acc = f_acc + inside * (horizon - first_ts) / (f_last - first_ts)
            start = horizon
        else:
            start_acc, start = first.acc, first_ts
        if ts > start:
            total, weight = acc - start_acc, ts - start
        else:
            total = weight = 0.0
        end = ts + period
        tail = end - (horizon if horizon > ts else ts)
        # end > the tail's start
        if tail > 0:
            total += value * tail
            weight += tail
        if weight <= 0:
            return value, None
        covered = end - (horizon if full else first_ts)
        if covered >= window:
            return total / weight, window
        return total / weight, round_ms(covered)

    def _trim(self, now: float, horizon: float | None = None) -> None:
        slots, starts = self._slots, self._starts
        if horizon is None:
            horizon = now - self.window
        # Keep one slot older than the horizon: it covers the start of the window.
        while len(slots) > 1 and slots[1].start <= horizon:
            slots.popleft()
            starts.popleft()

    def last_ts(self) -> float | None:
        return self._slots[-1].last if self._slots else None

    def newest(self, now: float, within: float) -> float | None:
        """The newest reading where it is at most ``within`` seconds old at ``now`` (else None)."""
        if not self._slots:
            return None
        slot = self._slots[-1]
        return slot.value if now - within <= slot.last <= now else None

    def _acc_at(self, i: int, t: float) -> float:
        """The running integral at time ``t``, ``slot i's start <= t <= slot i+1's start`` (prorated
        inside a slot of several readings)."""
        slot = self._slots[i]
        if t >= slot.last:
            return slot.acc + self._inside(i) + slot.value * (t - slot.last)
        return slot.acc + self._inside(i) * (t - slot.start) / (slot.last - slot.start)

    def _inside(self, i: int) -> float:
        """The integral over slot i's readings, from its start to its newest reading."""
        slots = self._slots
        slot = slots[i]
        if i == len(slots) - 1 or i == -1:
            return self._acc - slot.acc
        nxt = slots[i + 1]
        return nxt.acc - slot.acc - slot.value * (nxt.start - slot.last)

    def mean(self, now: float, since: float | None = None) -> tuple[float | None, float | None]:
        """(mean, seconds covered).  Each sample counts for the time until the next sample (the
        newest for one mean sample period); a lone sample gives (value, None).  With ``since``,
        only samples taken at or after that time count (None, None when there are none)."""
        slots = self._slots
        horizon = now - self.window
        # _trim(now), inline: once per GPU and snapshot
        while len(slots) > 1 and slots[1].start <= horizon:
            slots.popleft()
            self._starts.popleft()
        if not slots:
            return None, None
        last = slots[-1]
        first = slots[0]
        first_ts, first_acc, n_before = first.start, first.acc, first.n
        if since is not None and since > first_ts:
            if since > last.last:
                return None, None
            horizon = max(horizon, since)
            # the slot that holds ``since``
            i = bisect_right(self._starts, since) - 1
            first = slots[i]
            if since <= first.start:
                first_ts, first_acc, n_before = first.start, first.acc, first.n
            elif since <= first.last:
                # Inside a slot of several readings: count its newest reading only (the others'
                # times are not kept, and some may be older than ``since``).
                first_ts, n_before = first.last, first.n + first.count - 1
                first_acc = first.acc + self._inside(i)
            else:
                if i + 1 >= len(slots):
                    return None, None
                first = slots[i + 1]
                first_ts, first_acc, n_before = first.start, first.acc, first.n
        n = self._n - n_before
        last_ts, last_value = last.last, last.value
        if n == 1:
            return last_value, None
        period = (last_ts - first_ts) / (n - 1)
        # The integral from max(first_ts, horizon) to last_ts, then the newest reading's period.
        if horizon > first_ts:
            # no ``since`` inside the window: the trim left the horizon in the first slot
            if first is slots[0]:
                start_acc = self._acc_at(0, horizon)
            else:
                start_acc = self._acc_at(bisect_right(self._starts, horizon) - 1, horizon)
            start = horizon
        else:
            start_acc, start = first_acc, first_ts
        if last_ts > start:
            total, weight = self._acc - start_acc, last_ts - start
        else:
            total = weight = 0.0
        tail_start = horizon if horizon > last_ts else last_ts
        end = last_ts + period
        if end > tail_start:
            total += last_value * (end - tail_start)
            weight += end - tail_start
        if weight <= 0:
            return last_value, None
        covered = end - (horizon if horizon > first_ts else first_ts)
        # a full window (round() of a float costs more than the rest of a read)
        if covered >= self.window:
            return total / weight, self.window
        return total / weight, round_ms(covered)


def utilisation(window: UtilWindow, now: float, since: float | None, reading: float | None,
                own: bool = False) -> tuple[float | None, float | None]:
    """(utilisation, seconds covered) of one GPU for a snapshot: the window's mean at ``now`` (only
    samples at or after ``since`` count), else the instant ``reading`` (with no window).  ``own``: the
    backend has no driver sample buffer, so ``reading`` (when there is one) is first added to the
    window, which is then built from the backend's own readings."""
    if own and reading is not None:
        if since is None:
            mean, covered = window.add_mean(now, reading)
        else:
            window.add(now, reading)
            mean, covered = window.mean(now, since)
    else:
        mean, covered = window.mean(now, since)
    return (reading, covered) if mean is None else (mean, covered)
