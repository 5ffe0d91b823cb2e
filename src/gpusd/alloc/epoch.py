"""Fencing tokens: the epoch each grant of a GPU carries (docs/allocation.md, "Epochs").

Every grant of a GPU gets a number greater than that of every earlier grant of the same GPU, on this
machine, whoever granted it (the daemon, a ``gpusd run`` through the lock directory, a remote lease)
and across daemon restarts, so that a framework can refuse a stale writer (a job whose lease ended
while it was cut off).  The number is the larger of

* the wall clock in microseconds (so a counter file lost, or never writable, still grows), and
* one more than the last epoch stored for the GPU in either lease store (``epoch-<UUID>`` beside its
  lock file; the store that grants writes it, under its selection mutex), so a clock stepped back
  repeats nothing.

The shared lock directory can be written by every user, so a stored value is hostile: a file that is
not a regular one, holds anything but digits, or is more than :data:`MAX_AHEAD_US` ahead of the clock
is not believed (it can push the epoch ahead by at most that, never make it overflow a JSON-safe
integer, 2**53, before the year 2250); lowering it cannot make the epoch go back while the clock does
not.  The lease authority's own directory (root's) can be written only by the daemon.

Only ``os`` and ``time`` are imported (start-up time).
"""

from __future__ import annotations

import logging
import os
import stat
import time

from .lockdir import FILE_FLAGS

log = logging.getLogger("gpusd.alloc")

MAX_AHEAD_US = 10 * 366 * 86400 * 10**6  # a stored epoch further ahead of the clock than this is not believed
WIDTH = 20  # digits written, so that a rewrite in place always covers the previous value
PREFIX = "epoch-"


def _name(device: str) -> str:
    return PREFIX + "".join(c if c.isalnum() or c in "-_." else "_" for c in device)


def now_floor() -> int:
    """The smallest epoch a grant may carry now: the wall clock in microseconds."""
    return time.time_ns() // 1000


def read(dir_fd: int, device: str) -> int | None:
    """The epoch stored for ``device`` in the directory ``dir_fd``; None when there is none or it is
    not believable (not a regular file of digits, or too far ahead of the clock)."""
    try:
        fd = os.open(_name(device), FILE_FLAGS | os.O_RDONLY, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        raw = os.read(fd, WIDTH + 8).strip()
    except OSError:
        return None
    finally:
        os.close(fd)
    if not raw.isdigit() or len(raw) > WIDTH:
        return None
    value = int(raw)
    return value if value <= now_floor() + MAX_AHEAD_US else None


def next_epoch(dir_fds: list[int], devices: list[str]) -> int:
    """The epoch of a grant of ``devices`` now: above every epoch stored for any of them in the
    directories ``dir_fds`` (the granting store's first), and not below the clock."""
    epoch = now_floor()
    for device in devices:
        for fd in dir_fds:
            value = read(fd, device)
            if value is not None and value >= epoch:
                epoch = value + 1
    return epoch


def store(dir_fd: int, devices: list[str], epoch: int, private: bool) -> None:
    """Remember ``epoch`` as the last of ``devices`` (call under the store's selection mutex).  Best
    effort: a file that cannot be written (another user's, read-only) is logged and left; the clock
    still makes the next epoch grow."""
    text = f"{epoch:0{WIDTH}d}\n".encode()
    for device in devices:
        name = _name(device)
        try:
            try:
                fd = os.open(name, FILE_FLAGS | os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=dir_fd)
                # made by us just now: readable by everyone (the other store reads it), writable by
                # every user of the shared directory (their grants of the GPU write it too)
                os.fchmod(fd, 0o644 if private else 0o666)
            except FileExistsError:
                fd = os.open(name, FILE_FLAGS | os.O_WRONLY, dir_fd=dir_fd)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                    raise OSError(f"{name} is not a plain file")  # a hard link to something else
                os.pwrite(fd, text, 0)
            finally:
                os.close(fd)
        except OSError as exc:
            log.debug("cannot store the epoch of %s: %s", device[:64], exc)
