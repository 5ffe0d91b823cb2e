"""WHEN of ``gpusd reserve --at`` (docs/pool.md, "WHEN, exactly"): +DURATION, HH:MM in this machine's time
zone (its next occurrence), ISO times with or without an offset, and daylight saving's skipped and repeated
hours."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from gpusd.units import parse_when


@pytest.fixture
def berlin(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("TZ", "Europe/Berlin")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def test_forms_of_when(berlin: None) -> None:
    now = 1796630400.0  # 2026-12-07 09:00:00 in Berlin (UTC+1)
    assert parse_when("+20s", now) == now + 20 and parse_when("+2h", now) == now + 7200
    assert parse_when("14:30", now) == now + 5.5 * 3600  # later today
    assert parse_when("08:00", now) == now + 23 * 3600  # passed today: tomorrow
    assert parse_when("2026-12-24T09:00", now) == 1798099200.0  # local time
    assert parse_when("2026-12-24T09:00+00:00", now) == 1798102800.0  # its own offset
    assert parse_when("2026-12-24T08:00Z", now) == 1798099200.0


def test_daylight_saving(berlin: None) -> None:
    with pytest.raises(ValueError, match="does not exist in this machine's time zone"):
        parse_when("2026-03-29T02:30")  # skipped when DST starts
    first = parse_when("2026-10-25T02:30")  # repeated when it ends: the first of the two (UTC+2)
    assert first == 1792888200.0


def test_what_is_not_a_moment() -> None:
    for bad in ("tomorrow", "25:00", "12:60", "+-5m", "2026-13-01T00:00"):
        with pytest.raises(ValueError):
            parse_when(bad)
