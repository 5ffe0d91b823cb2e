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

import os
import stat
import time

from .lockdir import FILE_FLAGS

# a stored epoch further ahead of the clock than this is not believed
MAX_AHEAD_US = 10 * 366 * 86400 * 10**6
# digits written, so that a rewrite in place always covers the previous value
WIDTH = 20
PREFIX = "epoch-"


def _name(device: str) -> str:
    return PREFIX + "".join(c if c.isalnum() or c in "-_." else "_" for c in device)


def now_floor() -> int:
    """The smallest epoch a grant may carry now: the wall clock in microseconds."""
    return time.time_ns() // 1000


def _parse(raw: bytes) -> int | None:
    raw = raw.strip()
    if not raw.isdigit() or len(raw) > WIDTH:
        return None
    value = int(raw)
    return value if value <= now_floor() + MAX_AHEAD_US else None


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
        return _parse(os.read(fd, WIDTH + 8))
    except OSError:
        return None
    finally:
        os.close(fd)


def _own(dir_fd: int, device: str, private: bool) -> int | None:
    """The granting store's file of ``device``, open for reading and writing (made when missing:
    readable by everyone, since the other store reads it, and, in the shared directory, writable by
    every user, whose grants of the GPU write it too); None when it cannot be used (another user's
    read-only file, not a plain file, a hard link to something else)."""
    name = _name(device)
    try:
        try:
            fd = os.open(name, FILE_FLAGS | os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=dir_fd)
            os.fchmod(fd, 0o644 if private else 0o666)  # made by us just now
            return fd
        except FileExistsError:
            fd = os.open(name, FILE_FLAGS | os.O_RDWR, dir_fd=dir_fd)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            os.close(fd)
            return None
        return fd
    except OSError as exc:
        _debug("cannot use the epoch file of %s: %s", device[:64], exc)
        return None


def grant(dir_fd: int, peer_fds: list[int], devices: list[str], private: bool) -> int:
    """The epoch of a grant of ``devices`` now, remembered as their last in the granting store's
    directory ``dir_fd`` (call under its selection mutex, before the lease is published): above every
    epoch stored for any of them there and in the other store's ``peer_fds``, and not below the
    clock.  Remembering is best effort: a file that cannot be written is logged and left (the clock
    still makes the next epoch grow)."""
    epoch = now_floor()
    own: list[int] = []
    try:
        for device in devices:
            fd = _own(dir_fd, device, private)
            if fd is not None:
                own.append(fd)
                try:
                    value = _parse(os.pread(fd, WIDTH + 8, 0))
                except OSError:
                    value = None
            else:
                value = read(dir_fd, device)
            if value is not None and value >= epoch:
                epoch = value + 1
            for peer in peer_fds:
                value = read(peer, device)
                if value is not None and value >= epoch:
                    epoch = value + 1
        text = f"{epoch:0{WIDTH}d}\n".encode()
        for fd in own:
            try:
                os.pwrite(fd, text, 0)
            except OSError as exc:
                _debug("cannot store an epoch: %s", exc)
    finally:
        for fd in own:
            os.close(fd)
    return epoch


def _debug(msg: str, *args: object) -> None:
    """A debug line, with ``logging`` imported only when there is one (the quick commands' start-up)."""
    import logging

    logging.getLogger("gpusd.alloc").debug(msg, *args)
