"""The wait queue of ``--wait``: priority classes, first come first served within a class.

Order (docs/jobs.md, "Fairness"): a ticket's **class** is its priority as the priority policy
believes it for the ticket's owner (:mod:`gpusd.alloc.priority`: ``urgent`` needs root or the
administrator's word), raised one level per aging period waited, up to ``high``.  Higher classes go
first; within a class, everyone in the order they started waiting, where a job that was
**preempted** keeps its place from when its ``gpusd run`` started (so it goes back ahead of the jobs
of its class that queued while it ran).  There is no backfilling: only the job at
the head of the queue may take GPUs, so a 4-GPU job is never starved by a stream of 1-GPU jobs behind
it (the price: while the head waits for 4 GPUs, 1-GPU jobs behind it wait too).  A job that does not
wait (no ``--wait``) does not jump the queue either: while anyone who would be ahead of it is queued,
it is told so and refused.

Time: the order and the aging run on the boot-time clock (``CLOCK_BOOTTIME``: monotonic, one for every
process of the machine), never on the wall clock, so an NTP step or a VM resume neither reorders the
queue nor ages (or un-ages) every waiter at once.  A ticket says when it started waiting on that clock
(``since_boot``), which is believed of the lease authority's tickets (root's, or in its own
directory: where the daemon's clients queue).

What orders tickets comes from the kernel wherever another user could lie: the time another user's
ticket started waiting is its file's ``ctime`` (set by the kernel when it is renamed into place; its
owner can only move it later; read as its age on the wall clock, so a wall-clock step does shift such
tickets), its owner is the file's uid, and a "preempted" claim counts only when ``/proc/locks``
shows the claimed process holding the ticket's lock, owned by the same uid; its place is then the start
time of that process (from ``/proc``, on the boot-time clock), which nobody can set.  A user thus
gains nothing by claiming: at best the place they would have had by queueing when that process started.

Mechanics: each waiter holds ``LOCK_EX`` on its own ticket file, numbered from ``queue.seq`` under the
selection mutex.  A waiter that is not at the head blocks on the ticket of the waiter just ahead of it
(woken by that ticket's close or removal only, :meth:`LeaseWatch.follow`: a lease ending is the head's
business, and 40 waiters woken by every event of the directory cost the hand-over its CPU),
and looks again at least every :data:`RECHECK_ORDER` seconds (aging may change who that is); a lock
is released the moment its waiter gets its GPUs, gives up or dies (the kernel drops the
lock of a killed process), so the hand-over is immediate.  The head checks under the selection mutex
that it still is the head before it takes GPUs.

Only the head looks at the GPUs, and not on a timer: it sleeps until a lease ends.  The kernel says
when (:class:`LeaseWatch`, inotify on the lock directory): a lease ends when its lock files are
closed, whoever closes them (the holder, its last child, or the kernel when they die): an
``IN_CLOSE_WRITE`` event, or ``IN_CLOSE_NOWRITE`` for the authority's read-only lock files.
Because the driver averages utilisation over up to a second, the head looks again shortly after
each such event (20, 50, 100, 200, 400 ms), and otherwise every ``recheck`` seconds for load that
changes outside gpusd.  Without inotify it polls every 0.1 s.

Tickets are files of the shared directory like the others: created with ``O_EXCL`` under a name
nobody can guess, never followed through a symlink, attributed to the uid that owns them.

The lease authority's tickets outlive the daemon: one that stops leaves its waiters' tickets, and the
next re-adopts those whose waiter still runs (:func:`readopt`, :class:`Place`), so a waiter that asks
again keeps its place.
"""

# Imports inside functions: start-up (quick commands import this module).
from __future__ import annotations

import fcntl
import json
import os
import re
import stat
import time
from pathlib import Path

from ..record import fields, record
from ..sanitize import json_object
from .inotify import (
    IN_ATTRIB,
    IN_CLOSE_NOWRITE,
    IN_CLOSE_WRITE,
    IN_DELETE,
    IN_DELETE_SELF,
    IN_DONT_FOLLOW,
    IN_MOVED_TO,
    IN_ONLYDIR,
    IN_Q_OVERFLOW,
    Inotify,
)
from .leases import AUTHORITY_DIR, LeaseStore, current_user
from .lockdir import (
    FILE_FLAGS,
    create_exclusive,
    flock_table,
    lock_key,
    open_lock_file,
    process_start,
    process_start_boot,
    read_live,
    try_lock,
    write_new,
)
from .policy import load_priority_policy
from .priority import NORMAL, capped, priority_name

# typing is not imported at run time: start-up time
TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from typing import Any, Callable

_TICKET = re.compile(r"^queue-(\d{12,20})-(\d+)(?:-[0-9a-f]{1,32})?\.ticket$")


class Ticket:
    def __init__(self, store: LeaseStore, seq: int, path: Path, fd: int, dir_fd: int = -1) -> None:
        self.store, self.seq, self.path, self.fd, self.dir_fd = store, seq, path, fd, dir_fd
        self.closed = False

    def close(self, keep: bool = False) -> None:
        """Leave the queue.  ``keep``: the file stays (unlocked) for the next lease authority of this
        store to re-adopt (:func:`readopt`): a daemon that stops keeps its waiters' places."""
        if self.closed:
            return
        self.closed = True
        # first: the waiter behind us is woken by this close
        os.close(self.fd)
        try:
            if self.dir_fd >= 0 and not keep:
                os.unlink(self.path.name, dir_fd=self.dir_fd)
        except OSError:
            pass
        if self.dir_fd >= 0:
            os.close(self.dir_fd)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def enqueue(store: LeaseStore, count: int, command: str | None = None, pid: int | None = None,
            user: str | None = None, priority: int = NORMAL, resume: bool = False, uid: int | None = None) -> Ticket:
    """Join the queue (call under the selection mutex).  ``pid``, ``user`` and ``uid`` name the job when it
    is not this process (the daemon waiting for a client); only root's tickets are believed to.
    ``priority`` is a claim, believed up to the policy's bound for the ticket's owner; ``resume``
    says the job was preempted (believed as the module docstring says)."""
    dfd = store.open(create=True)
    assert dfd is not None
    try:
        fd = open_lock_file(dfd, "queue.seq", store.dir, private=store.private)
        try:
            raw = os.pread(fd, 32, 0)
            seq = int(raw.strip() or b"0") + 1
            if not 0 < seq < 10**12:
                raise ValueError(seq)
        except (ValueError, OSError):
            # unreadable counter: fall back to a clock-ordered number
            seq = int(time.time() * 1000)
        try:
            os.pwrite(fd, f"{seq:<20d}\n".encode(), 0)
        except OSError:
            # read-only for us: numbers from the clock keep their order with the others
            pass
        os.close(fd)
        tag = f"{seq:012d}-{os.getpid()}-{os.urandom(4).hex()}"
        name = f"queue-{tag}.ticket"
        # Locked before it is visible: a ticket others can lock is a dead waiter's, and is removed.
        tfd = create_exclusive(dfd, f".queue-{tag}.tmp", store.dir, lock=True)
        try:
            # since_boot: when it started waiting on the boot-time clock, which orders and ages the
            # tickets of the lease authority (root's: believed) whatever the wall clock does
            write_new(dfd, tfd, f".queue-{tag}.tmp", name, json.dumps(
                {"pid": pid or os.getpid(), "user": user or current_user(), "count": count, "since": time.time(),
                 "since_boot": boottime(), "command": command, "priority": priority, "resume": resume,
                 **({"uid": uid} if uid is not None else {})}).encode(), store.dir)
        except BaseException:
            os.close(tfd)
            raise
    except BaseException:
        os.close(dfd)
        raise
    return Ticket(store, seq, store.dir / name, tfd, dfd)


class Place:
    """A client's place in the lease authority's queue, kept across a restart of the daemon: the ticket
    a previous daemon left for the waiting process ``pid`` of ``uid``, locked again by this daemon
    (so it counts in the order, with its sequence number and the kernel's time it started waiting)
    until that process asks again (:meth:`claims`) or ``until`` (monotonic) passes."""

    def __init__(self, ticket: Ticket, pid: int, uid: int, started: float, until: float) -> None:
        self.ticket, self.pid, self.uid, self.started, self.until = ticket, pid, uid, started, until

    def alive(self) -> bool:
        """Whether its waiter still runs: the same process (its start time), as the same user."""
        from .lockdir import process_uid

        return process_uid(self.pid) == self.uid and process_start(self.pid) == self.started


# seconds a restarted daemon keeps a waiter's place for it to ask again
READOPT_GRACE = 30.0


def readopt(store: LeaseStore, grace: float = READOPT_GRACE) -> dict[tuple[int, int], Place]:
    """The places of the waiters a previous lease authority of ``store`` left (it stopped, or was
    killed), by (pid, uid): call before :meth:`LeaseStore.prepare`, which removes the rest.

    Only in the authority's own directory, which only the daemon's user can write: a ticket there is
    the daemon's word on who waited since when.  One is kept when nobody holds its lock (a live
    daemon's waiter is that daemon's), it names a pid and uid, and that process still runs as that
    uid and started before the ticket did (a pid used again is not the waiter).  It is locked again
    here, unchanged: its name (sequence number) and ``ctime`` (the kernel's time it started waiting)
    keep its place in the order, so a client that asks again gains nothing by it but that place."""
    from .lockdir import process_uid

    if not store.private:
        return {}
    dfd = store.open_listed()
    if dfd is None:
        return {}
    out: dict[tuple[int, int], Place] = {}
    until = time.monotonic() + grace
    try:
        names = sorted(n for n in os.listdir(dfd) if _TICKET.match(n))[:MAX_TICKETS]
        for name in names:
            m = _TICKET.match(name)
            assert m is not None
            try:
                fd = os.open(name, FILE_FLAGS | os.O_RDWR, dir_fd=dfd)
            except OSError:
                continue
            kept = False
            try:
                st = os.fstat(fd)
                if (not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_uid != os.geteuid()
                        or not try_lock(fd, shared=False)):
                    continue
                raw = os.pread(fd, MAX_TICKET_BYTES + 1, 0)
                # ValueError: not a ticket, passed over below
                d = json_object(raw, MAX_TICKET_BYTES)
                pid, uid = d.get("pid"), d.get("uid")
                if type(pid) is not int or type(uid) is not int or not (0 < pid < 2**31 and 0 <= uid < 2**32):
                    continue
                started = process_start(pid)
                # /proc's start time is exact to a clock tick after the boot time, which is whole seconds
                if (started is None or started > st.st_ctime_ns / 1e9 + 1.0 or process_uid(pid) != uid
                        or (pid, uid) in out):
                    continue
                out[(pid, uid)] = Place(Ticket(store, int(m.group(1)), store.dir / name, fd, os.dup(dfd)),
                                        pid, uid, started, until)
                kept = True
            except (OSError, ValueError):
                pass
            finally:
                if not kept:
                    os.close(fd)
    except OSError:
        pass
    finally:
        os.close(dfd)
    return out


MAX_TICKET_BYTES = 8192
MAX_TICKETS = 4096
# beyond this, a (non-root) user's tickets are not counted: they queue behind all
MAX_TICKETS_PER_USER = 512
# seconds: a waiter that is not the head looks at the order again at least this often
RECHECK_ORDER = 5.0


@record
class Waiter:
    """A job waiting in the queue, as its ticket describes it.  A ticket is another user's file: it is
    attributed to the uid that owns it (only root's tickets, the daemon's, may name someone else),
    its fields are typed and bounded (None: missing or malformed), and its strings must still go
    through :func:`gpusd.sanitize.for_terminal` before they are printed."""

    # 1: the head of the queue
    position: int
    seq: int
    # the ticket's file name in the lock directory
    ticket: str
    pid: int | None
    user: str | None
    count: int | None  # GPUs asked for
    # when it started waiting (the kernel's ctime of the ticket)
    since: float | None
    command: str | None
    # as believed for the ticket's owner (the policy's bound applied)
    priority: int = NORMAL
    # its class now: the priority after aging
    level: int = NORMAL
    # a preempted job, believed (see the module docstring)
    resumed: bool = False
    uid: int | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["priority_name"], d["level_name"] = priority_name(self.priority), priority_name(self.level)
        return d


def _scan(store: LeaseStore, cleanup: bool = False, peers: bool = True) -> list[tuple[Waiter, float, Path]]:
    """The live tickets, read and attributed, unordered: (waiter, place in its class, path).  Tickets
    of dead waiters are skipped (and removed with ``cleanup``); a ticket that cannot be read is still
    a waiter (of normal priority, in the order it started waiting).  With ``peers``, for the shared
    directory, the waiters of the lease authority's store (:meth:`LeaseStore.peers`) too, in one
    order; the authority's store counts only its own."""
    out = _scan_one(store, cleanup)
    if peers and not store.private:
        # The shared directory's waiters queue behind the authority's; the authority's queue is its own:
        # a ticket anyone can write in the shared directory (held by a process that never takes GPUs)
        # must not hold up the daemon's clients (docs/allocation.md, "The authority's own directory").
        for peer in store.peers():
            out.extend(_scan_one(peer, False))
    return out


def _scan_one(store: LeaseStore, cleanup: bool) -> list[tuple[Waiter, float, Path]]:
    from .lockdir import process_uid, user_name

    out: list[tuple[Waiter, float, Path]] = []
    dfd = store.open_listed()
    if dfd is None:
        return out
    policy = load_priority_policy()
    locks: dict[str, list[tuple[int, bool]]] | None = None
    now, now_boot = time.time(), boottime()
    try:
        from .leaseview import ticket_names

        # this process's view of the directory, if any; else a listing
        listed = ticket_names(dfd)
        names = sorted(n for n in (os.listdir(dfd) if listed is None else listed) if _TICKET.match(n))[:MAX_TICKETS]
        per_uid: dict[int, int] = {}
        # uid -> the highest priority the policy lets it claim (one lookup each)
        bound: dict[int, int] = {}
        for name in names:
            m = _TICKET.match(name)
            assert m is not None
            # None: not a ticket gpusd made (a FIFO, a directory, a hard link to another file), or a dead waiter's
            got = read_live(dfd, name, MAX_TICKET_BYTES, cleanup)
            if got is None:
                continue
            st, raw = got
            if store.private:
                # The authority's tickets are readable by all, so a user could lock one its daemon left
                # behind (killed) and pass it off as a waiter: one counts only while a process of the
                # ticket's owner (the daemon's user) holds its lock.  Its waits never change hands.
                if locks is None:
                    locks = flock_table() or {}
                if not any(process_uid(pid) == st.st_uid for pid, _ in locks.get(lock_key(st), []) if pid > 0):
                    continue
            try:
                d = json_object(raw, MAX_TICKET_BYTES)
            except ValueError:
                d = {}
            pid, count, command, user = d.get("pid"), d.get("count"), d.get("command"), d.get("user")
            pid = pid if type(pid) is int and 0 < pid < 2**31 else None
            if st.st_uid != 0:
                user = user_name(st.st_uid)
                if pid is not None and process_uid(pid) != st.st_uid:
                    pid = None
            # a flood of one user's tickets costs everyone's scans: bounded per user
            if st.st_uid != 0:
                per_uid[st.st_uid] = per_uid.get(st.st_uid, 0) + 1
                if per_uid[st.st_uid] > MAX_TICKETS_PER_USER:
                    continue
            since = st.st_ctime_ns / 1e9
            if st.st_uid not in bound:
                bound[st.st_uid] = policy.max_for(st.st_uid)
            priority = capped(d.get("priority"), bound[st.st_uid])
            place = _since_boot(d.get("since_boot"), st, now, now_boot, store.private or st.st_uid == 0)
            resumed = False
            if d.get("resume") is True and pid is not None:
                if locks is None:
                    locks = flock_table() or {}
                if (pid, True) in locks.get(lock_key(st), []):
                    started = process_start_boot(pid)
                    if started is not None and started <= place:
                        place, resumed = started, True
            out.append((Waiter(
                position=0, seq=int(m.group(1)), ticket=name, pid=pid,
                user=user[:64] if isinstance(user, str) else None,
                count=count if type(count) is int and count > 0 else None, since=since,
                command=command[:1024] if isinstance(command, str) else None,
                priority=priority, level=policy.aged(priority, now_boot - place), resumed=resumed, uid=st.st_uid),
                place, store.dir / name))
    except OSError:
        pass
    finally:
        os.close(dfd)
    return out


def _shares(store: LeaseStore) -> dict[str, float] | None:
    """The users' GPU-hours for the fair-share order, when the policy asks for it (alloc/policy.py)."""
    from . import policy

    if policy.load().fair_share_days is None:
        return None
    # root's daemon's state directory, never the shared lock directory
    return policy.read_shares()


def _order(entries: list[tuple[Waiter, float, Path]],
           shares: dict[str, float] | None = None) -> list[tuple[Waiter, float, Path]]:
    # A resumed job is placed at its process's start, not ahead of its class: a claim anyone can
    # make must never put a process started after others queued ahead of them.  With the fair-share
    # policy, within a class the user with fewer GPU-hours (the daemon's summary of the history) goes
    # first, then the order of waiting; every waiter reads the same summary, so all agree.
    if shares is not None:
        entries.sort(key=lambda e: (-e[0].level, shares.get(e[0].user or "", 0.0), e[1], e[0].seq))
    else:
        entries.sort(key=lambda e: (-e[0].level, e[1], e[0].seq))
    for i, (w, _, _) in enumerate(entries):
        w.position = i + 1
    return entries


def waiting(store: LeaseStore, cleanup: bool = False) -> list[tuple[int, Path]]:
    """Live tickets (seq, path), in queue order (the head first).  Tickets of dead waiters are
    skipped (and removed with ``cleanup``)."""
    return [(w.seq, path) for w, _, path in _order(_scan(store, cleanup), _shares(store))]


def waiters(store: LeaseStore) -> list[Waiter]:
    """The live waiters, in queue order (read-only: nothing is locked, cleaned or written)."""
    return [w for w, _, _ in _order(_scan(store), _shares(store))]


def ahead_of(store: LeaseStore, ticket: Ticket) -> Path | None:
    """The live ticket just ahead of ``ticket`` in the queue order, or None at the head."""
    order = _order(_scan(store, cleanup=True), _shares(store))
    for i, (_, _, path) in enumerate(order):
        if path.name == ticket.path.name:
            return order[i - 1][2] if i else None
    # not visible (over a bound, unreadable): behind everyone
    return order[-1][2] if order else None


def ahead_of_newcomer(store: LeaseStore, priority: int) -> list[Waiter]:
    """The waiters who would be ahead of a job of (believed) ``priority`` that joined now."""
    return [w for w, _, _ in _order(_scan(store, cleanup=True), _shares(store)) if w.level >= priority]


def boottime() -> float:
    """The boot-time clock: monotonic, the same for every process of this boot (a wall-clock step does
    not move it)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def _since_boot(claimed: object, st: os.stat_result, now: float, now_boot: float, trusted: bool) -> float:
    """When a ticket started waiting, on the boot-time clock.  The lease authority's tickets (root's,
    or any in its own directory, ``trusted``) say it (``since_boot``) and are believed; another
    user's ticket could claim any time, so its place comes from the kernel's ``ctime`` of its file
    (a wall time: its age on the wall clock, the one thing a user cannot set, at the price that a
    wall-clock step shifts such tickets)."""
    if trusted and type(claimed) in (int, float) and 0 <= claimed <= now_boot:  # type: ignore[operator]
        return float(claimed)  # type: ignore[arg-type]
    return now_boot - max(0.0, now - st.st_ctime_ns / 1e9)


def wait_for(path: Path, deadline: float | None, poll: float = 0.05, watch: LeaseWatch | None = None,
             cancelled: Callable[[], bool] | None = None) -> bool:
    """Block until the waiter holding ``path`` leaves (lock released).  False on deadline (or when
    ``cancelled()`` says so, checked at least every second).  With ``watch``, it sleeps until that
    ticket alone is closed or removed (:meth:`LeaseWatch.follow`): the other waiters' and the
    leases' traffic in the directory does not wake it."""
    try:
        fd = os.open(path, FILE_FLAGS | os.O_RDONLY)
    except OSError:
        return True  # already gone
    followed = -1
    try:
        if deadline is None and cancelled is None:
            # sleeps in the kernel until the holder leaves
            fcntl.flock(fd, fcntl.LOCK_SH)
            return True
        if watch is not None and watch.active:
            # before the first try: a close after it wakes us
            followed = watch.follow(path)
        while True:
            if try_lock(fd, shared=True):
                return True
            if cancelled is not None and cancelled():
                return False
            left = deadline - time.monotonic() if deadline is not None else 1.0
            if left <= 0:
                return False
            if watch is not None and followed >= 0:
                # woken when the ticket ahead is closed or removed (a lease ending is the head's
                # business, and so are the other tickets: 40 waiters woken by every event in the
                # directory would slow the hand-over); 1 s in case one is missed
                watch.wait(min(left, 1.0), followed=True)
            else:
                time.sleep(min(left, poll))
    finally:
        if followed >= 0 and watch is not None:
            watch.unfollow(followed)
        os.close(fd)


# -- being woken when a lease ends ------------------------------------------------------------------

class LeaseWatch:
    """Wakes a waiter when a lease or a ticket in the lock directory ends (Linux inotify).

    ``wait(timeout)`` returns True when a lease ends (one of its device lock files is closed after
    writing, or its record is removed: whoever ends it, the holder, its last child, or the kernel when
    they die), False after ``timeout``; the queue's tickets do not wake the head (:func:`_relevant`).
    ``active`` is False where inotify is unavailable (then the caller polls).

    A waiter behind the head follows only the ticket ahead of it (:meth:`follow`, :func:`wait_for`):
    the directory's watches are taken off meanwhile, so that the events of every lease and ticket
    do not wake (nor queue up for) each of the waiters, and put back by :meth:`drain`, which the
    head calls before it looks: no lease may end unseen from then on."""

    def __init__(self, directory: Path) -> None:
        self._ino: Inotify | None = None
        self._events = IN_CLOSE_WRITE | IN_MOVED_TO | IN_DELETE | IN_ONLYDIR | IN_DONT_FOLLOW
        # the other store's leases and tickets count here too (LeaseStore.peers): their ends as well
        peer = directory.parent if directory.name == AUTHORITY_DIR else directory / AUTHORITY_DIR
        self._dirs = (directory, peer)
        # the directories' watches, while armed
        self._wds: list[int] = []
        # the watch on the ticket ahead (wait_for), while one is followed
        self._followed = -1
        try:
            ino = Inotify()
        except OSError:
            return
        self._ino = ino
        if not self._arm():
            self._ino = None
            ino.close()

    def _arm(self) -> bool:
        """Watch the directories (again); False when the lock directory itself cannot be watched."""
        if self._ino is None:
            return False
        if not self._wds:
            wd = self._ino.watch(self._dirs[0], self._mask(self._dirs[0]))
            if wd < 0:
                return False
            self._wds = [wd]
            # absent: nothing to watch there
            peer = self._ino.watch(self._dirs[1], self._mask(self._dirs[1]))
            if peer >= 0 and peer != wd:
                self._wds.append(peer)
        return True

    def _mask(self, directory: Path) -> int:
        """The events watched in ``directory``: in the authority's, read-only closes too (its GPU locks are
        read-only, passed to its clients: a lease it granted ends with the client's last close); never in
        the shared one, where they are readers' (a look tries free GPUs' locks read-only), no lease ending."""
        return self._events | (IN_CLOSE_NOWRITE if directory.name == AUTHORITY_DIR else 0)

    def follow(self, ticket: Path) -> int:
        """Watch only ``ticket`` (the one ahead: its holder's close, its removal) until :meth:`unfollow`;
        the directories' watches are taken off until the next :meth:`drain`.  The watch's descriptor,
        or -1 when it cannot be watched (the caller then polls)."""
        if self._ino is None:
            return -1
        for wd in self._wds:
            self._ino.unwatch(wd)
        self._wds = []
        self._followed = self._ino.watch(ticket, IN_CLOSE_WRITE | IN_ATTRIB | IN_DELETE_SELF | IN_DONT_FOLLOW)
        return self._followed

    def unfollow(self, wd: int) -> None:
        if self._ino is not None and wd >= 0:
            self._ino.unwatch(wd)
        if wd == self._followed:
            self._followed = -1

    @property
    def fd(self) -> int:
        return self._ino.fd if self._ino is not None else -1

    @property
    def active(self) -> bool:
        return self.fd >= 0

    def drain(self) -> bool:
        """Read the pending events: True when one of them is a lease ending.  The directories are
        watched again first, if a :meth:`follow` took them off (then True: what happened meanwhile is
        unknown)."""
        if self._ino is None:
            return False
        rearmed = not self._wds
        if rearmed and not self._arm():
            # the directory cannot be watched any more: the caller polls
            self.close()
            return True
        return any(mask & IN_Q_OVERFLOW or _relevant(name, mask) for wd, mask, name in self._ino.read()
                   if wd in self._wds or wd < 0) or rearmed

    def wait(self, timeout: float, followed: bool = False) -> bool:
        """Block until :meth:`drain` finds an event (True) or ``timeout`` passed (False); ``followed``:
        until the followed ticket's watch has one (any)."""
        end = time.monotonic() + timeout
        while self._ino is not None:
            left = end - time.monotonic()
            if left <= 0 or not self._ino.wait(left):
                return False
            if followed:
                if any(wd == self._followed or mask & IN_Q_OVERFLOW for wd, mask, _ in self._ino.read()):
                    return True
            elif self.drain():
                return True
        return False

    def close(self) -> None:
        """Close the inotify instance (in the background: :meth:`Inotify.close`)."""
        if self._ino is not None:
            ino, self._ino = self._ino, None
            ino.close()

    def __enter__(self) -> LeaseWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _relevant(name: bytes, mask: int) -> bool:
    if name.startswith(b"gpu-") and name.endswith(b".lock"):
        # a lease's device lock closed (read-only closes come from the authority's directory only: _mask)
        return bool(mask & (IN_CLOSE_WRITE | IN_CLOSE_NOWRITE))
    if name.startswith(b"lease-") and name.endswith(b".json"):
        # removed, or closed after writing; not rewritten (renamed over), not read by someone
        return bool(mask & (IN_DELETE | IN_CLOSE_WRITE))
    # Tickets are not the head's business: one that comes ahead of it is a head itself and looks on its
    # own (the head's look checks under the mutex that it still is the head); the waiters behind follow
    # the ticket ahead of them (LeaseWatch.follow).  40 tickets arriving at once would be 40 looks.
    return False
