"""The lease view: a lock directory's live leases, kept by inotify instead of re-read per call.

:meth:`gpusd.alloc.leases.LeaseStore.leases` asks :func:`look` for a directory's leases.  The first look
in a process reads the directory as it always did (every record opened, its lock tried, parsed, confirmed
against ``/proc/locks``: a one-shot command needs no more).  From the second look at the same directory
on, a process keeps a :class:`DirView` of it: one inotify watch on the directory (added through the
descriptor that was opened and checked, so it is that directory whatever its path names later), the
parsed records keyed by ``(inode, mtime_ns, size, uid, ctime_ns)``, the lock files' names and mtimes and
the tickets' names.  A look then drains the events and re-reads only the files they name.

Why that is enough (docs/allocation.md, "The lease view"):

* A lease ends when its holder's lock on the record goes, and a flock goes when the last descriptor of
  the open file holding it is closed (the holder's release, its last child's exit, the kernel closing the
  descriptors of a killed process).  The kernel queues the close event (``IN_CLOSE_WRITE`` for gpusd's
  holders, whose records are open read-write) *before* it drops the lock, so a look that drains the
  events first never misses a lease that has ended: the record is read again, its lock tried, and a
  dead holder's lease is free in the very next look, as before.
* A record written, replaced, renamed, chmod-ed, chown-ed or removed is an event too (``IN_MODIFY``,
  ``IN_MOVED_*``, ``IN_ATTRIB``, ``IN_CREATE``, ``IN_DELETE``); so is a device lock opened, closed or
  replaced, after which the records claiming that device are confirmed again.
* This process's own reads close files read-only (``IN_CLOSE_NOWRITE``); those events are told apart by
  name (the names read since the last drain) and dropped, or every look would re-read what the last one
  read.  The price: a read-only holder of a record (not gpusd's way: a user who locks another's record)
  whose close falls between this process's read and its next drain is not seen at once.  For that, for a
  lock dropped with ``LOCK_UN`` without a close (no event at all) and for a device lock taken long after
  its file was opened, every :data:`REVALIDATE` seconds a look re-reads and re-confirms everything, as the
  first look did.
* An event queue overflow (a user flooding the directory), a watch removed or a directory replaced make
  the next look a full one, and a fork starts the child afresh (the parent's inotify queue is its own).
  Where inotify is unavailable every look is a full one.

A look never trusts the cache more than the kernel: a record is believed only as far as ``/proc/locks``
confirmed it (read once per look that has something new to confirm, never in a look where nothing
changed), and the bounds of :mod:`gpusd.alloc.leases` (record size, number of files) hold as before.
The :class:`~gpusd.model.LeaseInfo` values returned are copies: callers may change them.
"""

# Imports inside functions: start-up (quick commands import this module).
from __future__ import annotations

import os
import threading
import time

from ..model import LeaseInfo
from .inotify import (
    IN_ATTRIB,
    IN_CLOSE_NOWRITE,
    IN_CLOSE_WRITE,
    IN_CREATE,
    IN_DELETE,
    IN_IGNORED,
    IN_MODIFY,
    IN_MOVED_FROM,
    IN_MOVED_TO,
    IN_ONLYDIR,
    IN_Q_OVERFLOW,
    Inotify,
)
from .lockdir import (
    FILE_FLAGS,
    MAX_LEASE_BYTES,
    MAX_LEASE_FILES,
    LazyLog,
    flock_table,
    lock_key,
    read_live,
    safe_name,
    try_lock,
    user_name,
)

# typing is not imported at run time: start-up time
TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from pathlib import Path
    from typing import Any, Protocol

    class LeaseStore(Protocol):
        """What a view asks of :class:`gpusd.alloc.leases.LeaseStore`, whose ``leases`` looks through
        this module (that module is above this one)."""

        @property
        def dir(self) -> Path: ...
        @property
        def private(self) -> bool: ...
        def _parse(self, name: str, raw: bytes) -> dict[str, Any] | None: ...
        def _believe(self, dfd: int, name: str, lease_id: str, st: os.stat_result, rec: dict[str, Any],
                     table: dict[str, list[tuple[int, bool]]] | None) -> list[LeaseInfo]: ...
        def _unleased(self, dfd: int, devices: list[str], confirmed: dict[str, set[int]],
                      table: dict[str, list[tuple[int, bool]]] | None,
                      suspects: set[int] | None = None) -> list[LeaseInfo]: ...

log = LazyLog(__name__)
# seconds: a look re-reads and re-confirms every record at least this often
REVALIDATE = 1.0
# directories one process keeps a view of (the shared one and the authority's, normally)
MAX_VIEWS = 8
_IN_OPEN = 0x020
_IN_ISDIR = 0x40000000
EVENTS = (IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_CLOSE_NOWRITE | _IN_OPEN | IN_MOVED_FROM | IN_MOVED_TO
          | IN_CREATE | IN_DELETE | IN_ONLYDIR)
# a dirty mark: read and confirm again, whatever the events said
_FULL = 1 << 40
_lock = threading.Lock()
_DEVICE = LeaseInfo.__slots__.index("device")


class _Entry:
    """A live record as last read: its stat key, its fields (None: unreadable), the LeaseInfo values the
    kernel confirmed and the pids holding its lock (for the device locks' other holders)."""

    __slots__ = ("key", "st", "record", "infos", "pids", "devices", "sig")

    def __init__(self, key: tuple[int, ...], st: os.stat_result, record: dict[str, Any] | None) -> None:
        self.key, self.st, self.record = key, st, record
        self.infos: list[LeaseInfo] = []
        # None: /proc/locks could not be read
        self.pids: set[int] | None = None
        self.devices: tuple[str, ...] = tuple(safe_name(d) for d in record["devices"]) if record else ()
        # what /proc/locks said of its locks when it was confirmed
        self.sig: tuple[Any, ...] | None = None


class DirView:
    """What this process knows of one lock directory (see the module docstring)."""

    def __init__(self, path: Path, ident: tuple[int, int], wd: int = -1) -> None:
        self.path, self.ident, self.wd = path, ident, wd
        # lease record name -> as last read
        self.entries: dict[str, _Entry] = {}
        # lease record name -> the events seen since (or _FULL)
        self.dirty: dict[str, int] = {}
        # device (as in the file name) -> its lock file's mtime
        self.locks: dict[str, float | None] = {}
        # device -> its lock file as /proc/locks names it
        self.lockkeys: dict[str, str] = {}
        # devices whose lock file changed since the last look
        self.restat: set[str] = set()
        # those of them stat-ed again already (release_times) but not yet looked at
        self.changed: set[str] = set()
        # names of queue-*.ticket files
        self.tickets: set[str] = set()
        # names this process opened read-only since the last drain
        self.own: set[str] = set()
        # records found abandoned by a look that was not to remove them
        self.unclean: set[str] = set()
        # device -> names of the records claiming it
        self.claims: dict[str, set[str]] = {}
        # device locks held without a lease, as last found
        self.blockers: list[tuple[Any, ...]] | None = None
        # the confirmed leases' fields (None: to rebuild)
        self.flat: list[tuple[Any, ...]] | None = None
        # live records nothing confirms (unreadable, or not held): with flat
        self.suspect: list[_Entry] = []
        # device -> pids holding the records of its leases
        self.confirmed: dict[str, set[int]] = {}
        # (horizon, the lock files touched since)
        self.recent: tuple[float, dict[str, float]] | None = None
        # the devices with a lock file and no confirmed lease
        self.free: list[str] | None = None
        self.full = True
        self.checked = 0.0
        self.used = time.monotonic()

    # -- events -------------------------------------------------------------------------------------
    def event(self, mask: int, raw: bytes) -> None:
        if mask & IN_Q_OVERFLOW:
            self.full = True
            return
        if not raw or mask & _IN_ISDIR:
            # the directory itself (our own open of it), or a directory in it
            return
        name = os.fsdecode(raw)
        # one kind per event: never both
        own = mask in (IN_CLOSE_NOWRITE, _IN_OPEN) and name in self.own
        if name.startswith("lease-") and name.endswith(".json"):
            from ..ids import LeaseId

            if LeaseId.from_file_name(name) is None:
                # no lease's record (the full look skips it too): anyone may make such a name
                return
            if own or mask == _IN_OPEN:
                # our own read, or anyone's open (a read, or a lock to come: its close will tell)
                return
            if name in self.entries or len(self.entries) + len(self.dirty) < MAX_LEASE_FILES:
                self.dirty[name] = self.dirty.get(name, 0) | mask
        elif name.startswith("gpu-") and name.endswith(".lock"):
            dev = name[4:-5]
            # as many device locks followed as a full look takes (anyone may make them in the shared directory)
            if not own and (dev in self.locks or len(self.locks) + len(self.restat) < MAX_LEASE_FILES):
                self.restat.add(dev)
        elif name.startswith("queue-") and name.endswith(".ticket"):
            if mask & (IN_CREATE | IN_MOVED_TO):
                self.tickets.add(name)
            elif mask & (IN_DELETE | IN_MOVED_FROM):
                self.tickets.discard(name)

    # -- looking ----------------------------------------------------------------------------------------
    def _rescan(self, dfd: int) -> None:
        names = os.listdir(dfd)
        leases = [n for n in names if n.startswith("lease-")]
        # (gpusd.ids, for lease records only: a directory without any is the common case of a quick look)
        if leases:
            from ..ids import LeaseId

            leases = [n for n in leases if LeaseId.from_file_name(n) is not None]
        # one per lease: more is someone filling the directory
        if len(leases) > MAX_LEASE_FILES:
            log.warning("more than %d lease files in %s: the rest are ignored", MAX_LEASE_FILES, self.path)
            leases = leases[:MAX_LEASE_FILES]
        listed = set(leases)
        for name in [n for n in self.entries if n not in listed]:
            self._drop(name)
        self.dirty = dict.fromkeys(leases, _FULL)
        devices = [n[4:-5] for n in names if n.startswith("gpu-") and n.endswith(".lock")][:MAX_LEASE_FILES]
        self.locks = dict.fromkeys(devices)
        self.lockkeys = {}
        self.restat = set(devices)
        self.recent = self.free = None
        self.tickets = {n for n in names if n.startswith("queue-") and n.endswith(".ticket")}
        self.blockers = None

    def _drop(self, name: str) -> None:
        e = self.entries.pop(name, None)
        if e is not None:
            for dev in e.devices:
                names = self.claims.get(dev)
                if names is not None:
                    names.discard(name)
                    if not names:
                        del self.claims[dev]
            self.flat = None

    def _set(self, name: str, e: _Entry) -> None:
        self._drop(name)
        self.entries[name] = e
        for dev in e.devices:
            self.claims.setdefault(dev, set()).add(name)
        self.flat = None

    def _stat_locks(self, dfd: int) -> None:
        if self.restat:
            self.recent = None
        for dev in self.restat:
            if dev not in self.locks:
                self.free = None  # a new lock file
            try:
                st = os.stat(f"gpu-{dev}.lock", dir_fd=dfd, follow_symlinks=False)
            except OSError:
                self.locks.pop(dev, None)
                self.lockkeys.pop(dev, None)
                self.free = None
                continue
            self.locks[dev], self.lockkeys[dev] = st.st_mtime, lock_key(st)
        self.changed |= self.restat
        self.restat = set()

    def look(self, store: LeaseStore, dfd: int, cleanup: bool, blockers: bool) -> list[LeaseInfo]:
        """The live leases of this directory (as :meth:`LeaseStore.leases` documents them)."""
        now = time.monotonic()
        full = self.full or now - self.checked >= REVALIDATE
        if full:
            try:
                self._rescan(dfd)
            except OSError:
                # unreadable: no leases seen (as before), and a full look next time
                self.full = True
                return []
            self.full, self.checked = False, now
        if cleanup and self.unclean:
            for name in self.unclean:
                self.dirty[name] = self.dirty.get(name, 0) | _FULL
            self.unclean = set()
        self.own = set()
        self._stat_locks(dfd)
        # (a release_times between two looks stats the lock files too: what it saw change counts here)
        changed_devices, self.changed = self.changed, set()
        # a device lock opened, closed or replaced: its claims are read again
        for dev in changed_devices:
            for name in self.claims.get(dev, ()):
                self.dirty[name] = self.dirty.get(name, 0) | _FULL
        confirm: list[str] = []
        for name, mask in self.dirty.items():
            # released meanwhile: None
            got = read_live(dfd, name, MAX_LEASE_BYTES, cleanup, single_link=False)
            self.own.add(name)
            if got is None:
                self._drop(name)
                if not cleanup:
                    self.unclean.add(name)
                continue
            st, raw = got
            key = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size, st.st_uid, st.st_ctime_ns)
            e = self.entries.get(name)
            if e is not None and e.key == key and not mask & ~(IN_CLOSE_NOWRITE | _IN_OPEN):
                # someone read it; it is still locked, and the same record
                continue
            # the same record, read again: confirmed again below
            if e is not None and e.key == key:
                e.st = st
                if e.record is not None:
                    confirm.append(name)
                continue
            if len(raw) > MAX_LEASE_BYTES:
                log.warning("skipping lease file %s of %s: %d bytes (at most %d)", name, user_name(st.st_uid),
                            st.st_size, MAX_LEASE_BYTES)
                self._set(name, _Entry(key, st, None))
                continue
            record = store._parse(name, raw)
            self._set(name, _Entry(key, st, record))
            if record is not None:
                confirm.append(name)
        self.dirty = {}
        table: dict[str, list[tuple[int, bool]]] | None = None
        table_read = False
        if confirm:
            from ..ids import LeaseId

            table, table_read = flock_table(), True
            for name in confirm:
                e = self.entries[name]
                # What the kernel says of its locks: the same as when it was last confirmed (its holders,
                # its devices' lock files and their holders), the same answer: no need to work it out again
                sig = None if table is None else (
                    tuple(table.get(lock_key(e.st), ())),
                    tuple((k, tuple(table.get(k, ()) if k else ()))
                          for k in (self.lockkeys.get(dev) for dev in e.devices)))
                if sig is not None and sig == e.sig:
                    continue
                lease_id = LeaseId.from_file_name(name)
                assert lease_id is not None and e.record is not None
                e.infos = store._believe(dfd, name, lease_id, e.st, e.record, table)
                e.pids = {pid for pid, _ in table.get(lock_key(e.st), [])} if table is not None else None
                e.sig = sig
                self.flat = None
        rebuilt = False
        if self.flat is None:
            rebuilt = True
            self.flat = [_values(le) for e in self.entries.values() for le in e.infos]
            self.suspect = [e for e in self.entries.values() if not e.infos]
            self.confirmed, self.free = {}, None
            for e in self.entries.values():
                if e.infos and e.pids is not None:
                    for dev in e.devices:
                        self.confirmed.setdefault(dev, set()).update(e.pids)
        out = _copies(self.flat)
        # A device lock held with no confirmed lease: an ``unreadable`` lease (in the authority's
        # directory, whoever holds it; in the shared one, the holder of a record that cannot be read or
        # confirmed) or, with ``blockers``, a lock held without a lease (``LeaseStore._unleased``).
        suspect = self.suspect
        if not blockers and not ((store.private or suspect) and any(d not in self.confirmed for d in self.locks)):
            return out
        # A lock taken on a file opened long before is no event: under the mutex (cleanup) the devices
        # without a lease are tried each time, as every allocation did, and /proc/locks is read when one
        # is held or when the lock of a leased device changed; otherwise what the last reading found
        # stands (a lease that stopped being confirmed, its record damaged say, is looked at again).
        if cleanup and not table_read:
            if self.free is None:
                self.free = [dev for dev in self.locks if dev not in self.confirmed]
            held = self._tried(dfd, self.free)
            if held or self.blockers is None or changed_devices & self.confirmed.keys():
                table, table_read = flock_table(), True
            else:
                # the devices without a lease are free: only what holds leased ones stands
                self.blockers = [b for b in self.blockers if b[_DEVICE] in self.confirmed]
        elif not table_read and (changed_devices or self.blockers is None
                                 or (rebuilt and (store.private or suspect))):
            table, table_read = flock_table(), True
        if table_read:
            suspects = {pid for e in suspect for pid, _ in (table or {}).get(lock_key(e.st), ())}
            self.blockers = [_values(b) for b in store._unleased(dfd, list(self.locks), self.confirmed, table,
                                                                 suspects)]
        found = _copies(self.blockers or [])
        return out + (found if blockers else [b for b in found if b.unreadable])

    def _tried(self, dfd: int, devices: list[str]) -> list[str]:
        """The devices among ``devices`` whose lock someone holds (tried without blocking; under the
        selection mutex only: nobody else takes these locks then).  Opened read-only: the close is none
        of the queue's events, and it is ours (:attr:`own`)."""
        out = []
        for dev in devices:
            name = f"gpu-{dev}.lock"
            try:
                fd = os.open(name, FILE_FLAGS | os.O_RDONLY, dir_fd=dfd)
            except OSError:
                continue
            self.own.add(name)
            try:
                if not try_lock(fd, shared=False):
                    out.append(dev)
            except OSError:
                pass
            finally:
                os.close(fd)
        return out

    def release_times(self, dfd: int, horizon: float) -> dict[str, float]:
        """Device -> its lock file's mtime, where that is ``horizon`` or later."""
        if self.restat or self.recent is None or horizon < self.recent[0]:
            self._stat_locks(dfd)
            self.recent = (horizon, {dev: t for dev, t in self.locks.items() if t is not None and t >= horizon})
        elif any(t < horizon for t in self.recent[1].values()):
            # the horizon only moves on: fewer
            self.recent = (horizon, {dev: t for dev, t in self.recent[1].items() if t >= horizon})
        return dict(self.recent[1])


def _values(le: LeaseInfo) -> tuple[Any, ...]:
    return tuple(getattr(le, f) for f in le.__slots__)


def _copies(values: list[tuple[Any, ...]]) -> list[LeaseInfo]:
    """New LeaseInfo values each time (a caller may blank a lease's user: the view's stay as read)."""
    return [LeaseInfo(*v) for v in values]


# -- the views of this process --------------------------------------------------------------------------

_ino: Inotify | None = None
_ino_pid = 0
_ino_failed = False
# (st_dev, st_ino) of the directory -> its view
_views: dict[tuple[int, int], DirView] = {}
_by_wd: dict[int, DirView] = {}
# directories looked at once (a second look makes a view)
_seen: set[tuple[int, int]] = set()


def _reset() -> None:
    global _ino, _ino_pid
    if _ino is not None and _ino_pid == os.getpid():
        _ino.close()
    elif _ino is not None:
        # the parent's instance: never read (its events are the parent's), never closed by us
        _ino.fd = -1
    _ino, _ino_pid = None, os.getpid()
    _views.clear()
    _by_wd.clear()


def _after_fork() -> None:
    """In a forked child: a new lock (another thread of the parent may have held ours), and no view
    (the parent's inotify queue is the parent's: :func:`_view` starts afresh on the next look)."""
    global _lock, _ino_pid
    _lock = threading.Lock()
    _ino_pid = -1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def _pump() -> None:
    if _ino is None:
        return
    for wd, mask, name in _ino.read():
        if wd < 0 or mask & IN_Q_OVERFLOW:
            for each in _views.values():
                each.full = True
            continue
        v = _by_wd.get(wd)
        if v is None:
            continue
        # the watch is gone (directory removed, file system unmounted)
        if mask & IN_IGNORED:
            _by_wd.pop(wd, None)
            _views.pop(v.ident, None)
            continue
        v.event(mask, name)


def _view(store: LeaseStore, dfd: int) -> DirView | None:
    """This process's view of the directory ``dfd``; None on the first look (then nothing is kept)."""
    global _ino, _ino_failed
    if _ino_pid != os.getpid():
        _reset()
    st = os.fstat(dfd)
    ident = (st.st_dev, st.st_ino)
    _pump()
    v = _views.get(ident)
    if v is not None:
        v.used = time.monotonic()
        return v
    if _ino_failed:
        return None
    if ident not in _seen:
        _seen.add(ident)
        return None
    if _ino is None:
        try:
            _ino = Inotify()
        except OSError:
            _ino_failed = True
            return None
    # the one looked at longest ago goes
    if len(_views) >= MAX_VIEWS:
        old = min(_views.values(), key=lambda each: each.used)
        _views.pop(old.ident, None)
        _by_wd.pop(old.wd, None)
        _ino.unwatch(old.wd)
    # Through the descriptor opened and checked: the watch is on that directory whatever its path names now
    wd = _ino.watch(f"/proc/self/fd/{dfd}", EVENTS)
    if wd < 0:
        return None
    # the same directory under another name
    made = _by_wd.get(wd)
    if made is None:
        made = _by_wd[wd] = DirView(store.dir, ident, wd)
    _views[ident] = made
    return made


def look(store: LeaseStore, dfd: int, cleanup: bool, blockers: bool) -> list[LeaseInfo]:
    """The live leases of the lock directory ``dfd`` (of ``store``): see the module docstring."""
    with _lock:
        v = _view(store, dfd)
        if v is None:
            return DirView(store.dir, (0, 0)).look(store, dfd, cleanup, blockers)
        return v.look(store, dfd, cleanup, blockers)


def _current(dfd: int) -> "DirView | None":
    """The view of ``dfd`` brought up to date, where this process keeps one that is not due for a full
    look (the caller holds ``_lock``); None otherwise."""
    if _ino_pid != os.getpid() or not _views:
        return None
    v = _views.get(_ident(dfd))
    if v is None:
        return None
    _pump()
    if v.full or v.ident not in _views:
        return None
    return v


def release_times(store: LeaseStore, dfd: int, horizon: float) -> dict[str, float] | None:
    """Device -> its lock file's mtime where that is ``horizon`` or later, from the view of ``dfd``;
    None without one (then scan)."""
    with _lock:
        v = _current(dfd)
        return None if v is None else v.release_times(dfd, horizon)


def ticket_names(dfd: int) -> list[str] | None:
    """The names of the queue's tickets in ``dfd``, from its view; None without one (then list it)."""
    with _lock:
        v = _current(dfd)
        return None if v is None else list(v.tickets)


def _ident(dfd: int) -> tuple[int, int]:
    st = os.fstat(dfd)
    return st.st_dev, st.st_ino
