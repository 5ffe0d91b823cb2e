import pytest

from gpusd.units import format_bytes, parse_bytes, parse_memory


@pytest.mark.parametrize("text, expected", [
    ("8GiB", 8 * 2**30), ("8 GiB", 8 * 2**30), ("500MB", 500 * 10**6), ("1.5G", 1_500_000_000),
    ("1024", 1024), ("2Ti", 2 * 2**40), (4096, 4096),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["", "GiB", "8 parsecs", "-1GiB", "1e9"])
def test_parse_bytes_rejects(bad):
    with pytest.raises(ValueError, match="not a size"):
        parse_bytes(bad)


def test_parse_memory_ratio_or_bytes():
    assert parse_memory("0.5") == 0.5
    assert parse_memory("50%") == 0.5
    assert parse_memory("1.0") == 1.0
    assert parse_memory("8GiB") == 8 * 2**30
    assert parse_memory("2048B") == 2048
    with pytest.raises(ValueError, match="did you mean 2048GiB"):
        parse_memory("2048")  # bytes need a unit
    with pytest.raises(ValueError):
        parse_memory("150%")


def test_format_bytes():
    assert format_bytes(None) == "-"
    assert format_bytes(80 * 2**30) == "80.0GiB"
    assert format_bytes(141 * 2**30) == "141GiB"


def test_a_moment_that_is_not_today_is_written_with_its_date() -> None:
    """A 24-hour hold ends tomorrow: "until 19:10:48" alone reads as a time already past."""
    import time

    from gpusd.units import format_clock

    now = time.mktime((2026, 12, 1, 19, 10, 48, 0, 0, -1))
    assert format_clock(now + 60, now=now) == "19:11:48"
    assert format_clock(now + 24 * 3600, now=now) == "2026-12-02 19:10:48"
    assert format_clock(now - 24 * 3600, now=now) == "2026-11-30 19:10:48"


def test_one_table_of_duration_units() -> None:
    """Flags and threshold rules read durations by the same units (gpusd.units.DURATION_UNITS); no
    other module keeps a table of its own."""
    import re

    from gpusd.thresholds import parse_rule
    from gpusd.units import DURATION_UNITS, parse_duration
    from tests_paths import REPO

    assert parse_duration("90 seconds") == 90 and parse_duration("2w") == 14 * 86400
    assert parse_rule("utilization>90 for 2min").duration == 120 == parse_duration("2min")
    assert parse_rule("utilization>90 for 1d").duration == DURATION_UNITS["d"]
    src = REPO / "src" / "gpusd"
    for path in src.rglob("*.py"):
        if path.name != "units.py":
            assert not re.search(r"[\"'](min|h|m)[\"']: ?(60|3600)\b", path.read_text()), path
