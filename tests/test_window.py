import pytest

from gpusd.inventory.window import UtilWindow


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
