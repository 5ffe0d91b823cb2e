"""Bookings as an iCalendar file (RFC 5545): ``gpusd reservations --ics FILE`` (docs/pool.md, "Time").

One ``VEVENT`` per booking, its times in UTC (``DTSTART:20261224T080000Z``: no time zone to get
wrong), its ``UID`` the booking id and host (a calendar that imports the file again updates the
event instead of doubling it).  Text from the hosts (names, notes) is hostile: control characters are
dropped, and RFC 5545's special characters escaped, lines folded at 75 octets.
"""

from __future__ import annotations

import os
import time
from typing import Any, Iterable

PRODID = "-//gpusd//bookings//EN"


def _stamp(ts: float) -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(ts))


def _text(value: object, limit: int = 200) -> str:
    """A TEXT value: printable characters only, ``\\ ; ,`` and newlines escaped (RFC 5545 3.3.11)."""
    s = "".join(ch for ch in str(value)[:limit] if ch.isprintable())
    return s.replace("\\", "\\\\").replace(";", "\\;").replace(",", "\\,")


def _fold(line: str) -> list[str]:
    """Lines of at most 75 octets, continued with a leading space (RFC 5545 3.1)."""
    out: list[str] = []
    cur = ""
    for ch in line:
        if len((cur + ch).encode()) > (75 if not out else 74):
            out.append(cur)
            cur = ""
        cur += ch
    out.append(cur)
    return [out[0], *(" " + x for x in out[1:])]


def render(bookings: Iterable[dict[str, Any]], now: float | None = None) -> str:
    """The calendar of ``bookings`` (as ``GET /api/v1/bookings`` lists them); those without usable
    times are left out."""
    stamp = _stamp(time.time() if now is None else now)
    lines = ["BEGIN:VCALENDAR", "VERSION:2.0", f"PRODID:{PRODID}", "CALSCALE:GREGORIAN"]
    for d in bookings:
        start, end = d.get("start"), d.get("end")
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e11 for v in (start, end)):
            continue
        assert isinstance(start, (int, float)) and isinstance(end, (int, float))
        host = _text(d.get("host"), 64)
        gpus = ",".join(str(i) for i in d.get("indices") or [] if isinstance(i, int))
        bid = "".join(ch for ch in str(d.get("booking_id"))[:64] if ch.isalnum() or ch in "-_")
        summary = f"GPU {gpus} on {host}" if gpus else f"GPUs on {host}"
        event = ["BEGIN:VEVENT", f"UID:{bid}@{''.join(ch for ch in host if ch.isalnum() or ch in '.-') or 'gpusd'}",
                 f"DTSTAMP:{stamp}", f"DTSTART:{_stamp(start)}", f"DTEND:{_stamp(end)}",
                 f"SUMMARY:{_text(summary)}", f"LOCATION:{host}"]
        note = d.get("note")
        desc = f"gpusd booking {bid}" + (f": {note}" if isinstance(note, str) and note else "")
        event += [f"DESCRIPTION:{_text(desc, 400)}", "END:VEVENT"]
        lines += event
    lines.append("END:VCALENDAR")
    return "".join(part + "\r\n" for line in lines for part in _fold(line))


def write_ics(path: str, bookings: Iterable[dict[str, Any]]) -> None:
    """Write the calendar to ``path`` (a new file replaced into place; never through a symlink there)."""
    data = render(bookings).encode()
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)
