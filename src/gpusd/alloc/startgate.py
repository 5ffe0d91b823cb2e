"""The start slots of ``gpusd run --wait``: how many of one user's queued jobs start up at once.

Forty jobs submitted at once are forty interpreters importing gpusd and opening NVML together: on a
machine with few cores each gets a sliver of the CPU, all of them finish starting at about the same
time, and even the first jobs, for which GPUs are free, start late (measured by bench_alloc's makespan:
the first jobs of each GPU waited 4-7 s on 2 cores).  So a ``gpusd run --wait`` takes one of a few
*start slots* (:func:`count`) before it imports the rest of gpusd, and gives it back once it has
joined the queue (or asked the daemon): the others sleep in the kernel meanwhile, and the jobs start
up roughly in the order they were submitted.  There are half as many slots as CPUs (at least one; or
``$GPUSD_START_SLOTS``, 0 for none): the other half stays for the jobs already running and their
hand-overs.  The queue's order and every lease are untouched: this
only orders how the processes use the CPU to get there.

The slots are ``start-<uid>-<k>.lock`` in the lock directory, private to their user (created ``0600``;
one that is not the user's own ``0600`` file is not used: :func:`gpusd.alloc.lockdir.open_lock_file`),
so that nobody else can hold them.  The wait for a slot is bounded: as long as the slot keeps changing
hands (each holder counts its turn in the file), at most :data:`MAX_WAIT` s; a slot that does not
change hands for :data:`WAIT` s is held by a hung process, and the start goes on without one.  Where
no slot can be had (no writable lock directory) there is no gate.  The slot's
descriptor is close-on-exec: a job never inherits it.
"""

# Imports inside functions: start-up (quick commands import this module).
from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path

# typing is not imported at run time: start-up time
TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    pass

# seconds: a slot that does not change hands for this long is held by a hung process: go on without
WAIT = 2.0
# seconds: the longest a start waits for a slot, however it moves
MAX_WAIT = 30.0

# the slot this process holds (one gpusd run per process)
_held: int | None = None
# leave() from the lease's thread and from the main thread: one close
_lock = threading.Lock()


def _turns(fd: int) -> bytes:
    """How many times the slot changed hands (what its waiters watch for progress)."""
    try:
        return os.pread(fd, 32, 0)
    except OSError:
        return b""


def _turn(fd: int) -> None:
    """Count one more hand-over of the slot we now hold."""
    try:
        os.pwrite(fd, f"{int(_turns(fd).strip() or b'0') % 10**12 + 1:<20d}\n".encode(), 0)
    except (OSError, ValueError):
        pass


def _wait(fd: int) -> bool:
    """Wait for the slot ``fd``: as long as it keeps changing hands (every :data:`WAIT` s at least: the
    starts ahead are going on), :data:`MAX_WAIT` s in all.  The kernel has no flock with a timeout: a
    thread blocks in it, and if we stop waiting it lets the slot go the moment it gets it."""
    import time

    got = threading.Event()
    box = {"abandoned": False}
    gate = threading.Lock()

    def block() -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            return
        with gate:
            if box["abandoned"]:
                # too late: give it to the next one at once
                os.close(fd)
                return
            got.set()

    threading.Thread(target=block, name="gpusd-start-slot", daemon=True).start()
    end = time.monotonic() + MAX_WAIT
    seen = _turns(fd)
    while True:
        if got.wait(max(0.0, min(WAIT, end - time.monotonic()))):
            _turn(fd)
            return True
        now = _turns(fd)
        # no start went through it for WAIT s: its holder hangs
        if now == seen or time.monotonic() >= end:
            with gate:
                if got.is_set():
                    _turn(fd)
                    return True
                # the thread closes the descriptor
                box["abandoned"] = True
            return False
        seen = now


def enter(lock_dir: Path | None = None) -> bool:
    """Take a start slot, waiting for one as long as the slots move (:func:`_wait`); True when one is
    held, False when the start goes on without one."""
    global _held
    if _held is not None:
        return True
    from .lockdir import DEFAULT_LOCK_DIR, open_dir, open_lock_file, try_lock

    where = lock_dir or Path(os.environ.get("GPUSD_LOCK_DIR") or DEFAULT_LOCK_DIR)
    slots = count()
    if slots <= 0:
        return False
    try:
        dfd = open_dir(where, create=True)
    except Exception:
        # no lock directory we may use: no gate
        return False
    if dfd is None:  # pragma: no cover - create=True
        return False
    fds: list[int] = []
    try:
        me = os.geteuid()
        for k in range(slots):
            try:
                fds.append(open_lock_file(dfd, f"start-{me}-{k}.lock", where, private=True))
            except Exception:
                # another user's file squats the name, or no room: that slot is not ours
                continue
            try:
                free = try_lock(fds[-1], shared=False)
            except OSError:
                # a lock directory without locks (NFS mounted nolock: ENOLCK): no gate
                return False
            if free:
                _held = fds.pop()
                _turn(_held)
                return True
        if not fds:
            return False
        # all taken: queue on one of them
        mine = fds.pop(os.getpid() % len(fds))
        if _wait(mine):
            _held = mine
            return True
        # (the waiting thread closes it)
        return False
    finally:
        for fd in fds:
            os.close(fd)
        os.close(dfd)


def count() -> int:
    """How many slots: ``$GPUSD_START_SLOTS`` (0: no gate), else half the CPUs this process may use
    (at least one): the other half stays for the jobs already running and the hand-overs."""
    raw = os.environ.get("GPUSD_START_SLOTS", "").strip()
    if raw:
        try:
            return max(0, min(int(raw), 1024))
        except ValueError:
            pass
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    return max(1, cpus // 2)


def leave() -> None:
    """Give the slot back (nothing when none is held): the process has joined the queue, or ends."""
    global _held
    with _lock:
        fd, _held = _held, None
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


def held() -> bool:
    return _held is not None
