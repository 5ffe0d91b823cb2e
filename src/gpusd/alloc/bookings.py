"""Bookings as every process that chooses GPUs sees them: the rule of backfill (docs/pool.md, "Time").

A booking (``gpusd reserve --at WHEN --for DUR``) is kept by the host's daemon
(:mod:`gpusd.daemon.bookings`); it writes the bookings of this host into its state directory as
``bookings.json`` (root's file in root's directory, mode 0644, replaced atomically: the fair-share
summary's rules, :mod:`gpusd.alloc.policy`), and every lease request reads it there, the lease
authority's and a lock-directory ``gpusd run``'s alike (:func:`current`).

The rule (:func:`in_the_way`): a GPU booked from ``start`` to ``end`` by one user is not given to
another user's request while ``now < end``, unless the request says it is done before ``start``
(its ``time_limit``: ``gpusd run --time`` plus its grace).  A request without a limit is refused
once any booking of the GPU is ahead, however far (it could still run then); ``--wait`` waits past
the booking.  The booker's own requests are never held off by their own booking.

Times in the file are wall-clock times (a booking is a time of day by nature); what a wall-clock step
does to them is in docs/pool.md, "Clocks": the rule only decides who may *take* a free GPU; a GPU is
never granted twice, since every grant is a lock (the daemon's hold at WHEN included).
"""

# Imports inside functions: start-up (quick commands import this module).
from __future__ import annotations

import json
import math
import os
import stat

from ..ids import LeaseId
from ..record import record
from ..sanitize import json_object

# typing is not imported at run time: start-up time
TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from typing import Any, Iterable

BOOKINGS_FILE = "bookings.json"
MAX_FILE_BYTES = 1 << 20
MAX_BOOKINGS = 1024  # per host
MAX_DEVICES = 64
MAX_NOTE = 200


@record(frozen=True)
class Booking:
    """GPUs (``devices``: UUIDs; ``indices`` for display) of one host booked by ``user`` (the account
    the booker's SSH key maps to) from ``start`` to ``end`` (wall-clock times, seconds since the epoch)."""

    booking_id: str
    user: str
    devices: tuple[str, ...]
    start: float
    end: float
    indices: tuple[int, ...] = ()
    note: str | None = None
    created: float = 0.0
    # the daemon's hold from ``start`` on (its lease id), once taken
    lease: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"booking_id": self.booking_id, "user": self.user, "devices": list(self.devices),
                "indices": list(self.indices), "start": self.start, "end": self.end, "note": self.note,
                "created": self.created, "lease": self.lease}

    @classmethod
    def from_dict(cls, d: object) -> Booking:
        """A booking from JSON someone else may have written: typed and bounded (ValueError otherwise)."""
        if not isinstance(d, dict):
            raise ValueError("not an object")
        bid, user = d.get("booking_id"), d.get("user")
        if not LeaseId.is_valid(bid):
            raise ValueError("no valid booking id")
        if not isinstance(user, str) or not 0 < len(user) <= 64 or not user.isprintable():
            raise ValueError("no valid user")
        devices, indices = d.get("devices"), d.get("indices") or []
        if (not isinstance(devices, list) or not 0 < len(devices) <= MAX_DEVICES
                or not all(isinstance(x, str) and 0 < len(x) <= 128 and x.isprintable() for x in devices)):
            raise ValueError("no valid device list")
        if not isinstance(indices, list) or not all(type(i) is int and 0 <= i < 4096 for i in indices[:MAX_DEVICES]):
            raise ValueError("no valid index list")
        start, end, created = (_time(d.get(k, 0.0 if k == "created" else None)) for k in ("start", "end", "created"))
        if not end > start:
            raise ValueError("ends before it starts")
        note, lease = d.get("note"), d.get("lease")
        return cls(bid, user, tuple(devices), float(start), float(end), tuple(indices[:MAX_DEVICES]),
                   note[:MAX_NOTE] if isinstance(note, str) else None, float(created), LeaseId.optional(lease))


def _time(v: object) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
        raise ValueError("no valid time")
    return float(v)


def in_the_way(bookings: Iterable[Booking], user: str | None, time_limit: float | None,
               now: float) -> list[Booking]:
    """The bookings whose GPUs a request of ``user`` that runs at most ``time_limit`` seconds (None:
    without a limit) may not take at ``now``: those of other users not yet over, unless the request
    ends before they start."""
    out = []
    for b in bookings:
        if b.user == user or now >= b.end:
            continue
        if time_limit is not None and now + time_limit <= b.start:
            # backfill: done before the booking starts
            continue
        out.append(b)
    return out


def refusal(blocking: list[Booking], time_limit: float | None, now: float) -> str:
    """Why the booked GPUs were not given, naming the booking(s) and when (one line)."""
    from ..sanitize import for_terminal
    from ..units import format_clock, format_duration

    first = min(blocking, key=lambda b: b.start)
    gpus = ",".join(str(i) for i in first.indices) or f"{len(first.devices)} GPU(s)"
    when = (f"from {format_clock(first.start)}" if first.start > now else "now") + f" to {format_clock(first.end)}"
    more = f" (and {len(blocking) - 1} more booking(s))" if len(blocking) > 1 else ""
    if first.start > now:
        fits = format_duration(first.start - now)
        hint = (f"a job with --time shorter than {fits} (its grace included) may use them; " if time_limit is None
                else f"--time {format_duration(time_limit)} (with its grace) would still run then; ")
    else:
        hint = ""
    return (f"GPU {gpus} booked by {for_terminal(first.user, 64)} {when} (booking {first.booking_id}){more}: "
            f"{hint}--wait waits past the booking")


# -- the daemon's summary: bookings.json in its state directory --------------------------------------
# the daemon's own state directory, in the daemon's process (set_own_dir)
_own_dir: list[str] = []


def set_own_dir(directory: str | os.PathLike[str] | None) -> None:
    """In the daemon's process: its lease requests (the lease authority's, the pool's) read the bookings
    where it writes them, whatever its environment says (``gpusd start --state-dir``)."""
    _own_dir[:] = [] if directory is None else [os.fspath(directory)]


def bookings_dir() -> str:
    """Where lease requests look for the daemon's bookings: the daemon's own directory in its process,
    else the fair-share summary's (``$GPUSD_STATE_DIR``, else root's ``/var/lib/gpusd``)."""
    if _own_dir:
        return _own_dir[0]
    from .policy import shares_dir

    return shares_dir()


def write_summary(directory: str | os.PathLike[str], bookings: Iterable[Booking]) -> None:
    """Write ``bookings`` into ``directory`` (the daemon's own state directory; OSError when it is
    not the daemon's alone), atomically."""
    from .policy import publish_summary

    data = json.dumps({"format": 1, "bookings": [b.to_dict() for b in bookings][:MAX_BOOKINGS]}).encode()
    publish_summary(directory, BOOKINGS_FILE, data, "the bookings summary")

# the bookings summary as last read, by directory (the daemon's own file, not a policy file: alloc.policy
# keeps those)
_summaries: dict[str, tuple[tuple[int, int, int], list[Booking]]] = {}


def current(directory: str | os.PathLike[str] | None = None) -> list[Booking]:
    """The bookings the daemon last wrote in ``directory`` (default :func:`bookings_dir`); none when
    there is no file, or it is not root's regular file in a directory only root (or, for a daemon of
    one's own, oneself) can write.  A damaged entry is left out, never the rest."""
    path = os.fspath(bookings_dir() if directory is None else directory)
    owners = {0, os.geteuid()}
    try:
        dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return []
    try:
        dst = os.fstat(dfd)
        if dst.st_uid not in owners or dst.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return []
        fd = os.open(BOOKINGS_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except OSError:
        return []
    finally:
        os.close(dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != dst.st_uid or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return []
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        hit = _summaries.get(path)
        if hit is not None and hit[0] == key:
            return hit[1]
        raw = os.read(fd, MAX_FILE_BYTES + 1)
    except OSError:
        return []
    finally:
        os.close(fd)
    out: list[Booking] = []
    try:
        d: dict[str, Any] | None = json_object(raw, MAX_FILE_BYTES)
    except ValueError:
        d = None
    for item in (d.get("bookings") if d is not None else None) or []:
        try:
            out.append(Booking.from_dict(item))
        except ValueError:
            continue
    _summaries[path] = (key, out)
    return out
