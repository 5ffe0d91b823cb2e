import random

import pytest

from gpusd.inventory.window import SLOTS, UtilWindow, round_ms, utilisation


def test_time_weighted_mean_over_the_window():
    w = UtilWindow(5.0)
    for t, v in [(0.0, 100.0), (1.0, 0.0), (2.0, 0.0), (3.0, 0.0)]:
        w.add(t, v)
    # each sample holds until the next; the last for one period: 100 for 1 s, 0 for 3 s
    mean, covered = w.mean(4.0)
    assert mean == pytest.approx(25.0) and covered == pytest.approx(4.0)


def test_old_samples_leave_the_window():
    w = UtilWindow(2.0)
    for t in range(10):
        w.add(float(t), 100.0 if t < 5 else 10.0)
    mean, covered = w.mean(10.0)
    assert mean == pytest.approx(10.0) and covered == pytest.approx(2.0)


def test_partially_covered_first_sample():
    w = UtilWindow(2.5)
    for t, v in [(0.0, 0.0), (1.0, 100.0), (2.0, 100.0)]:
        w.add(t, v)
    # window [0.5, 3.0): 0 for 0.5 s, then 100 for 2 s
    assert w.mean(3.0)[0] == pytest.approx(80.0)


def test_since_ignores_earlier_samples():
    w = UtilWindow(5.0)
    for t, v in [(0.0, 90.0), (1.0, 90.0), (2.0, 5.0), (3.0, 5.0)]:
        w.add(t, v)
    assert w.mean(4.0, since=2.0)[0] == pytest.approx(5.0)
    assert w.mean(4.0, since=3.5) == (None, None)


def test_single_and_no_sample():
    w = UtilWindow(5.0)
    assert w.mean(1.0) == (None, None)
    w.add(1.0, 42.0)
    assert w.mean(1.5) == (42.0, None)
    w.add(0.5, 1.0)  # out of order: ignored
    assert w.mean(1.5) == (42.0, None)


def _reference_mean(readings, now, window, since=None):
    """The documented mean, straight from its definition: each reading holds until the next one, the
    newest for the mean reading period; only the part inside [now - window, ...) counts."""
    items = [(t, v) for t, v in readings if since is None or t >= since]
    horizon = max(now - window, since) if since is not None else now - window
    # readings older than the one that covers the window's start drop out
    while len(items) > 1 and items[1][0] <= horizon:
        items.pop(0)
    if len(items) == 1:
        return items[0][1]
    period = (items[-1][0] - items[0][0]) / (len(items) - 1)
    total = weight = 0.0
    for (t, v), nxt in zip(items, [x[0] for x in items[1:]] + [items[-1][0] + period]):
        start, end = max(t, horizon), nxt
        if end > start:
            total += v * (end - start)
            weight += end - start
    return total / weight


def test_matches_the_definition_for_readings_a_slot_apart():
    # Readings further apart than a slot (window / SLOTS) are kept one by one: the mean is exact.
    rng = random.Random(5)
    w = UtilWindow(5.0)
    readings = []
    t = 100.0
    for _ in range(300):
        t += rng.uniform(w.resolution * 1.01, 1.5)
        v = rng.uniform(0, 100)
        w.add(t, v)
        readings.append((t, v))
        now = t + rng.uniform(0, 0.3)
        assert w.mean(now)[0] == pytest.approx(_reference_mean(readings, now, 5.0))
        since = t - rng.uniform(0, 3)
        if any(r[0] >= since for r in readings[-40:]):
            got = w.mean(now, since=since)[0]
            assert got == pytest.approx(_reference_mean(readings[-40:], now, 5.0, since))


def test_many_readings_give_the_time_weighted_mean():
    # A loop reading 1000 times a second: 100 % for 2 s, then 0 % for 3 s.
    w = UtilWindow(5.0)
    t = 0.0
    for i in range(5000):
        t = i / 1000
        w.add(t, 100.0 if t < 2.0 else 0.0)
    mean, covered = w.mean(5.0)
    assert mean == pytest.approx(40.0, abs=2.0)  # at most one slot of the window is prorated
    assert covered == pytest.approx(5.0)
    # 5 s later, the burst has left the window
    for i in range(5000, 10000):
        w.add(i / 1000, 0.0)
    assert w.mean(10.0)[0] == pytest.approx(0.0)


def test_many_readings_keep_memory_bounded():
    w = UtilWindow(5.0)
    for i in range(100_000):  # 10 kHz for 10 s
        w.add(i / 10_000, float(i % 100))
        if i % 1000 == 0:
            w.mean(i / 10_000)
    assert len(w._slots) <= SLOTS + 2
    w2 = UtilWindow(5.0)  # nobody asks for the mean: still bounded
    for i in range(100_000):
        w2.add(i / 10_000, 1.0)
    assert len(w2._slots) <= 2 * SLOTS + 1


def test_expired_window_keeps_the_last_reading():
    # Nothing read for longer than the window: the newest reading still stands for the present.
    w = UtilWindow(5.0)
    w.add(0.0, 30.0)
    w.add(1.0, 70.0)
    assert w.mean(60.0)[0] == pytest.approx(70.0)


def test_since_inside_a_busy_slot_drops_the_earlier_readings():
    # Readings 1 ms apart share a slot; a lease ended at t=1.0505 while 100 % was read.
    w = UtilWindow(5.0)
    for i in range(1000, 1100):
        t = i / 1000
        w.add(t, 100.0 if t < 1.0505 else 0.0)
    mean, _ = w.mean(1.2, since=1.0505)
    assert mean == pytest.approx(0.0)  # nothing read during the lease counts
    assert w.mean(1.2, since=1.2) == (None, None)


def _readings(rng: random.Random, window: float, grid: bool) -> list[tuple[float, float]]:
    """Readings as a backend's own come: dense (many to a slot), sparse, gaps longer than the window,
    and now and then a repeated or a backward time stamp (the clock stepping back).  ``grid``: on a grid
    of 1/4 s from 0, exact in binary, so that readings land exactly a slot apart or exactly on the
    window's start (the comparisons' edges)."""
    t = 0.0 if grid else rng.choice([0.0, 1.7e9])  # a fresh clock, or the epoch's (coarser floats)
    out = []
    for _ in range(rng.randint(1, 500)):
        r = rng.random()
        if r < 0.03:
            t -= rng.choice([0.25, 1.0]) if grid else rng.uniform(0, 1.0)
        elif r > 0.06:
            steps = [1e-4, 2e-3, 0.05, 0.3, 1.0, 1.5 * window]
            t += 0.25 * rng.randint(1, 12) if grid else rng.choice(steps) * rng.random()
        out.append((t, rng.choice([0.0, 100.0, 35.0, rng.uniform(0, 100)])))
    return out


@pytest.mark.parametrize("seed", range(60))
def test_add_mean_is_add_then_mean_bit_for_bit(seed):
    # The snapshot's one call per GPU against the two calls it replaces, on random series: the
    # same mean and the same seconds covered, exactly, after every reading; and the two windows stay the
    # same, as later means with and without ``since`` show.
    rng = random.Random(seed)
    grid = seed % 3 == 0
    window = rng.choice([12.5, 25.0, 50.0] if grid else [5.0, 1.0, 0.25, 30.0])  # on the grid: slots of 1/4 s or more
    fused, reference, via = UtilWindow(window), UtilWindow(window), UtilWindow(window)
    for t, v in _readings(rng, window, grid):
        reference.add(t, v)
        expected = reference.mean(t)
        assert fused.add_mean(t, v) == expected
        assert utilisation(via, t, None, v, own=True) == (v if expected[0] is None else expected[0], expected[1])
        if rng.random() < 0.1:
            later = t + rng.choice([0.0, rng.uniform(0, 2 * window), 0.25 * rng.randint(0, 8)])
            since = rng.choice([None, t - rng.uniform(0, window), t + 0.01, t - 0.25 * rng.randint(0, 8)])
            assert fused.mean(later, since) == reference.mean(later, since) == via.mean(later, since)
    assert (fused._acc, fused._n, len(fused._slots)) == (reference._acc, reference._n, len(reference._slots))


def test_add_mean_matches_the_definition():
    rng = random.Random(7)
    w = UtilWindow(5.0)
    readings = []
    t = 50.0
    for _ in range(300):
        t += rng.uniform(w.resolution * 1.01, 1.5)  # a slot apart: the mean is exact
        v = rng.uniform(0, 100)
        readings.append((t, v))
        mean, covered = w.add_mean(t, v)
        if len(readings) == 1:
            assert (mean, covered) == (v, None)
        else:
            assert mean == pytest.approx(_reference_mean(readings, t, 5.0))
            assert covered is not None and 0 < covered <= 5.0


def test_round_ms_is_round_to_three_places_bit_for_bit():
    import math

    rng = random.Random(11)
    values = [0.0, -0.0, 1e-300, 0.0005, 0.0015, 0.0025, 2.5e-4, 5.0, 4.9995, 1.2345, 536870.911, 536870.913, 1e9,
              -1.2345, -0.0005, math.inf, -math.inf, math.nan]
    for _ in range(20000):
        values.append(rng.uniform(0, 10) if rng.random() < 0.5 else rng.uniform(0, 1e6))
        k = rng.randint(0, 10**7)
        tie = (k + 0.5) / 1000  # as near a tie as a float gets: the fallback decides
        values += [tie, math.nextafter(tie, 0), math.nextafter(tie, math.inf), k / 1000, math.nextafter(k / 1000, 0)]
    for x in values:
        assert round_ms(x).hex() == round(x, 3).hex(), x
