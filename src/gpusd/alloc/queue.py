"""The first-come-first-served wait queue of ``--wait``.

Fairness rule: strict FIFO without backfilling.  Jobs are served in the order they started waiting;
only the job at the head of the queue may take GPUs, so a 4-GPU job is never starved by a stream of
1-GPU jobs behind it (the price: while the head waits for 4 GPUs, 1-GPU jobs behind it wait too).  A
job that does not wait (no ``--wait``) does not jump the queue either: while anyone is queued it is
told so and refused.

Mechanics: each waiter holds ``LOCK_EX`` on its own ticket file, numbered from ``queue.seq`` under the
selection mutex.  A waiter that is not at the head blocks on the ticket of the waiter just ahead of it;
that lock is released the moment that waiter gets its GPUs, gives up or dies (the kernel drops the
lock of a killed process), so the hand-over is immediate.  Only the head polls the GPUs.
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import re
import stat
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .leases import LeaseStore, _open_shared_file, _try_lock, _user

_TICKET = re.compile(r"^queue-(\d{12})-(\d+)\.ticket$")


class Ticket:
    def __init__(self, store: LeaseStore, seq: int, path: Path, fd: int) -> None:
        self.store, self.seq, self.path, self.fd = store, seq, path, fd
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.path.unlink()
        except OSError:
            pass
        os.close(self.fd)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def enqueue(store: LeaseStore, count: int, command: str | None = None) -> Ticket:
    """Join the queue (call under the selection mutex)."""
    store.ensure()
    fd = _open_shared_file(store.dir / "queue.seq")
    try:
        raw = os.pread(fd, 32, 0)
        seq = int(raw.strip() or b"0") + 1
    except (ValueError, OSError):
        seq = int(time.time() * 1000)  # unreadable counter: fall back to a clock-ordered number
    try:
        os.pwrite(fd, f"{seq:<20d}\n".encode(), 0)
    except OSError:
        pass  # read-only for us: numbers from the clock keep their order with the others
    os.close(fd)
    path = store.dir / f"queue-{seq:012d}-{os.getpid()}.ticket"
    tfd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    fcntl.flock(tfd, fcntl.LOCK_EX)
    os.write(tfd, json.dumps({"pid": os.getpid(), "user": _user(), "count": count, "since": time.time(),
                              "command": command}).encode())
    return Ticket(store, seq, path, tfd)


def waiting(store: LeaseStore, cleanup: bool = False) -> list[tuple[int, Path]]:
    """Live tickets (seq, path), oldest first.  Tickets of dead waiters are skipped (and removed
    with ``cleanup``)."""
    out: list[tuple[int, Path]] = []
    try:
        names = os.listdir(store.dir)
    except OSError:
        return out
    for name in names:
        m = _TICKET.match(name)
        if not m:
            continue
        path = store.dir / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            alive = not _try_lock(fd, shared=True)
        finally:
            os.close(fd)
        if alive:
            out.append((int(m.group(1)), path))
        elif cleanup:
            try:
                path.unlink()
            except OSError:
                pass
    out.sort()
    return out


def ahead_of(store: LeaseStore, ticket: Ticket) -> Path | None:
    """The live ticket just ahead of ``ticket``, or None at the head."""
    before = [p for seq, p in waiting(store, cleanup=True) if seq < ticket.seq]
    return before[-1] if before else None


def wait_for(path: Path, deadline: float | None, poll: float = 0.05) -> bool:
    """Block until the waiter holding ``path`` leaves (lock released).  False on deadline."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return True  # already gone
    try:
        if deadline is None:
            fcntl.flock(fd, fcntl.LOCK_SH)  # sleeps in the kernel until the holder leaves
            return True
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return True
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(poll)
    finally:
        os.close(fd)


@dataclass
class Waiter:
    """A job waiting in the queue, as its ticket describes it (None: the ticket does not say, or says
    something malformed — tickets are written by other users and read as untrusted)."""

    position: int  # 1: the head of the queue
    seq: int
    ticket: str  # the ticket's file name in the lock directory
    pid: int | None
    user: str | None
    count: int | None  # GPUs asked for
    since: float | None  # time.time() when it started waiting
    command: str | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_TICKET_MAX = 8192  # a real ticket: under 4 KiB (the command is cut at 512 characters)


def _read_ticket(path: Path) -> dict[str, Any]:
    """The JSON of a ticket, read without following a link or blocking; {} when unreadable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return {}
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return {}
        data = json.loads(os.read(fd, _TICKET_MAX).decode("utf-8", "replace"))
    except (OSError, ValueError, RecursionError):
        return {}
    finally:
        os.close(fd)
    return data if isinstance(data, dict) else {}


def _typed(value: Any, kind: type, limit: int = 256) -> Any:
    if isinstance(value, bool) or not isinstance(value, kind):
        return None
    if isinstance(value, str):
        return value[:limit]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def waiters(store: LeaseStore) -> list[Waiter]:
    """Who is waiting, oldest first (read-only: nothing is locked, cleaned or written)."""
    out: list[Waiter] = []
    for position, (seq, path) in enumerate(waiting(store), 1):
        t = _read_ticket(path)
        m = _TICKET.match(path.name)
        pid = _typed(t.get("pid"), int)
        if pid is None and m:
            pid = int(m.group(2))
        since = t.get("since")
        out.append(Waiter(
            position=position, seq=seq, ticket=path.name, pid=pid, user=_typed(t.get("user"), str, 64),
            count=_typed(t.get("count"), int),
            since=float(since) if isinstance(since, (int, float)) and not isinstance(since, bool)
            and math.isfinite(since) else None,
            command=_typed(t.get("command"), str, 512),
        ))
    return out
