"""Parsing and formatting of sizes such as ``8GiB``, ``500MB`` or ``0.25`` (a ratio), of durations
such as ``90s``, ``15m`` or ``2h`` (the one duration parser of every flag and API), and of moments
(:func:`format_clock`)."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
    "ti": 1024**4, "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int) -> int:
    """``"8GiB"`` -> 8589934592.  Plain numbers are bytes.  Raises ValueError with a clear message."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError("a size cannot be negative")
        return text
    m = _SIZE.match(str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 8GiB, 500MB, 1073741824)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_memory(text: str, ratio: bool = True) -> int | float:
    """A memory amount: bytes with a unit (``8GiB``, ``500MB``, ``4096B``) or, with ``ratio``, a
    share of the GPU's total memory: a number from 0 to 1 with no unit (``0.5``) or a percentage
    (``50%``).  A bare number above 1 is refused (``20`` would be 20 bytes or 2000 %: neither is
    meant), with a hint such as "did you mean 20GiB?"."""
    s = str(text).strip()
    if s.endswith("%"):
        if not ratio:
            raise ValueError(f"{text!r}: give an amount such as 20GiB, not a percentage")
        try:
            value = float(s[:-1]) / 100
        except ValueError:
            raise ValueError(f"not a percentage: {text!r}") from None
        if not 0 <= value <= 1:
            raise ValueError(f"not a percentage between 0 and 100: {text!r}")
        return value
    try:
        value = float(s)
    except ValueError:
        return parse_bytes(s)
    if value < 0:
        raise ValueError(f"a memory amount cannot be negative: {text!r}")
    if value == 0:
        return 0.0 if ratio else 0
    if ratio and 0 <= value <= 1:
        return value
    what = "a ratio of the total from 0 to 1 (0.5) or an amount" if ratio else "an amount, not a ratio,"
    hint = f"; did you mean {s}GiB?" if value > 1 else ""
    raise ValueError(f"{text!r} has no unit: give {what} with a unit such as 20GiB, 500MB or 4096B{hint}")


def format_bytes(n: int | None, unit: str = "GiB") -> str:
    if n is None:
        return "-"
    div = {"MiB": 1024**2, "GiB": 1024**3}[unit]
    value = n / div
    return f"{value:.1f}{unit}" if value < 100 else f"{value:.0f}{unit}"


_DURATION = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)")
# Seconds per unit: the one table of duration units (flags, policy files, threshold rules' "for 60s").
DURATION_UNITS: dict[str, float] = {
    "": 1.0, "s": 1.0, "sec": 1.0, "secs": 1.0, "second": 1.0, "seconds": 1.0, "ms": 0.001,
    "m": 60.0, "min": 60.0, "mins": 60.0, "minute": 60.0, "minutes": 60.0,
    "h": 3600.0, "hour": 3600.0, "hours": 3600.0, "d": 86400.0, "day": 86400.0, "days": 86400.0,
    "w": 7 * 86400.0, "week": 7 * 86400.0, "weeks": 7 * 86400.0}
# 20 years: longer is a typo, and would overflow timers
MAX_DURATION = 20 * 365 * 86400
DURATION_EXAMPLES = "seconds, or 90s, 15m, 6h, 7d, 2w"


def parse_duration(text: str | float, zero: bool = False) -> float:
    """``90``, ``90s``, ``15m``, ``6h``, ``7d``, ``2w`` -> seconds.  ``zero``: 0 is allowed (a timeout
    of 0: do not wait); otherwise a duration must be longer than 0.  Raises ValueError with one
    vocabulary for every flag: what was given and what a duration looks like."""
    s = str(text).strip()
    m = _DURATION.fullmatch(s)
    least = "0 or more" if zero else "longer than 0"
    if not m or m.group(2).lower() not in DURATION_UNITS:
        negative = _DURATION.fullmatch(s[1:].strip()) if s.startswith("-") else None
        if negative and negative.group(2).lower() in DURATION_UNITS:
            raise ValueError(f"must be a duration {least} ({DURATION_EXAMPLES}), not {s!r}")
        raise ValueError(f"not a duration: {s!r} ({DURATION_EXAMPLES})")
    value = float(m.group(1)) * DURATION_UNITS[m.group(2).lower()]
    if value > MAX_DURATION:
        raise ValueError(f"must be a duration of at most 20 years, not {s!r}")
    if value == 0 and not zero:
        raise ValueError(f"must be a duration {least} ({DURATION_EXAMPLES}), not {s!r}")
    return value


def format_duration(seconds: float | None) -> str:
    """``28`` -> ``28s``, ``3540`` -> ``59m``, ``7140`` -> ``1h59m``, ``183600`` -> ``2d3h``: a time
    left or an age, rounded down to the two largest units a reader needs."""
    if seconds is None or seconds != seconds:
        return "-"
    s = int(max(0.0, seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m" + (f"{s % 60:02d}s" if s < 600 and s % 60 else "")
    if s < 86400:
        return f"{s // 3600}h" + (f"{s % 3600 // 60:02d}m" if s % 3600 // 60 else "")
    return f"{s // 86400}d" + (f"{s % 86400 // 3600}h" if s % 86400 // 3600 else "")


def format_clock(ts: float, now: float | None = None) -> str:
    """A moment as people read it on this machine's clock: ``19:10:48`` when it is today, else with
    the date, ``2026-12-02 19:10:48`` (a 24-hour hold ends tomorrow: a bare time would read as past)."""
    import time

    when = time.localtime(ts)
    today = time.localtime(time.time() if now is None else now)
    if when[:3] == today[:3]:
        return time.strftime("%H:%M:%S", when)
    return time.strftime("%Y-%m-%d %H:%M:%S", when)


WHEN_EXAMPLES = "+20m, 14:30, 2026-12-24T09:00 or 2026-12-24T09:00+01:00"


def parse_when(text: str, now: float | None = None) -> float:
    """A moment (``gpusd reserve --at``) as a wall-clock time, seconds since the epoch (docs/pool.md,
    "Time"): ``+DURATION`` from ``now``; ``HH:MM`` (or ``HH:MM:SS``) in this machine's time zone, its
    next occurrence (today, else tomorrow); an ISO 8601 date and time, in its own offset when it gives
    one (``Z``, ``+01:00``), else in this machine's time zone.  A local time that does not exist (the
    hour skipped when daylight saving starts) is refused; one that occurs twice (the hour repeated when
    it ends) is the first.  ValueError names what was given and what a moment looks like."""
    import datetime as dt
    import re
    import time

    s = str(text).strip()
    now = time.time() if now is None else now
    if s.startswith("+"):
        return now + parse_duration(s[1:], zero=True)
    m = re.fullmatch(r"([01]?[0-9]|2[0-3]):([0-5][0-9])(?::([0-5][0-9]))?", s)
    try:
        if m:
            today = dt.datetime.fromtimestamp(now).date()
            clock = dt.time(int(m.group(1)), int(m.group(2)), int(m.group(3) or 0))
            naive = dt.datetime.combine(today, clock)
            if _local(naive) <= now:
                naive = dt.datetime.combine(today + dt.timedelta(days=1), clock)
            return _local(naive)
        when = dt.datetime.fromisoformat(s.replace("Z", "+00:00") if s.endswith("Z") else s)
    except ValueError as exc:
        if "does not exist" in str(exc):
            raise
        raise ValueError(f"not a moment: {s!r} ({WHEN_EXAMPLES})") from None
    if when.tzinfo is not None:
        return when.timestamp()
    return _local(when)


def _local(naive: object) -> float:
    """A naive local date and time as a wall-clock time; ValueError where the local time zone skips it."""
    import datetime as dt

    assert isinstance(naive, dt.datetime)
    ts = naive.replace(fold=0).timestamp()
    if dt.datetime.fromtimestamp(ts) != naive:
        raise ValueError(f"{naive.isoformat(sep=' ')} does not exist in this machine's time zone (the hour "
                         "skipped when daylight saving time starts): give another time, or an offset")
    return ts
