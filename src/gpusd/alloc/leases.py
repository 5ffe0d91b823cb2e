"""GPU leases on one machine, held with ``flock`` so the kernel frees them when the holder dies.

The lock directory (``$GPUSD_LOCK_DIR``, default ``/tmp/gpusd-locks``) is shared by every user of the
machine.  gpusd creates it with mode ``1777`` (world-writable, sticky, like ``/tmp``): anyone may take a
lease, nobody may delete another user's files.  An administrator may create it beforehand, e.g.
``install -d -m 1777 /var/lib/gpusd/locks`` and ``GPUSD_LOCK_DIR=/var/lib/gpusd/locks`` in
``/etc/environment``.  It holds:

``select.lock``
    A mutex around "read leases, choose GPUs, take leases", so selection plus lease is atomic across
    processes.  Held for about a millisecond; a wait for it is bounded (:func:`mutex_timeout`, 10 s
    by default, or the caller's deadline), and the error names the holder.
``gpu-<UUID>.lock`` (mode 0666, never deleted)
    One per GPU or MIG slice.  An exclusive lease holds ``LOCK_EX`` on it, a shared lease ``LOCK_SH``:
    the kernel itself refuses a second exclusive holder, whatever any process believes.
``lease-<ID>.json``
    What a lease is: pid, user, start time, command, the memory the job asked for, shared or not, the
    devices.  Its holder keeps ``LOCK_EX`` on it; a file that can be locked by someone else belongs to a
    dead holder and is ignored (and removed when permissions allow).  Another user may write such a
    file, so a record is believed only as far as the kernel confirms it: it is attributed to the uid
    that owns the file (a record written by root, i.e. by the daemon acting as lease authority, may
    name the client), and it counts for a device only while the process holding the record's lock
    also holds that device's lock in the mode claimed (``/proc/locks``).
``queue-<SEQ>-<PID>-<RANDOM>.ticket``, ``queue.seq``
    The first-come-first-served wait queue (:mod:`gpusd.alloc.queue`).

The directory and its files are opened so that a hostile local user cannot turn them against us
(:mod:`gpusd.alloc.lockdir`): no symlink followed, no chmod of a file we did not just create, a
directory owned by another user refused, every wait on the selection mutex bounded.

Lock files are opened with ``O_CLOEXEC`` except where ``gpusd run`` passes them to its command on
purpose: the lease then lasts as long as the job's processes do, even if ``gpusd run`` itself is
killed with SIGKILL.
"""

# Imports inside functions: start-up (quick commands import this module).
from __future__ import annotations

import math
import os
import time
from contextlib import contextmanager
from pathlib import Path

from ..errors import GpusdError, LockBusy, WaitTimeout
from ..model import HostSnapshot, LeaseInfo
from ..record import field, record
from .handle import Holder, LeaseHandle
from .lockdir import (
    DEFAULT_LOCK_DIR,
    DIR_FLAGS,
    FILE_FLAGS,
    LazyLog,
    abandoned,
    check_private_dir,
    create_exclusive,
    describe_holders,
    flock_table,
    holder_name,
    lock_key,
    lock_within,
    open_dir,
    open_lock_file,
    owner_name,
    process_uid,
    read_live,
    replace_private_dir,
    safe_name,
    try_lock,
    user_name,
    write_new,
)

# the bounds and the mutex's, named here too (their users import them from here)
from .lockdir import (
    MAX_LEASE_BYTES as MAX_LEASE_BYTES,
)
from .lockdir import (
    MAX_LEASE_FILES as MAX_LEASE_FILES,
)
from .lockdir import (
    MUTEX_TIMEOUT as MUTEX_TIMEOUT,
)
from .lockdir import (
    mutex_timeout as mutex_timeout,
)

# typing is not imported at run time: start-up time
TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from typing import Any, Iterator


log = LazyLog(__name__)

# the lease authority's own directory, inside the lock directory
AUTHORITY_DIR = "authority"
# locked by the daemon that is the lease authority, for its whole life
CLAIM_FILE = "authority.lock"
LEASE_FORMAT = 1
MAX_LEASE_DEVICES = 64
# an epoch read from a record is a positive 64-bit number (alloc.epoch)
MAX_EPOCH = 2**63


def lock_dir() -> Path:
    return Path(os.environ.get("GPUSD_LOCK_DIR") or DEFAULT_LOCK_DIR)


def current_user() -> str | None:
    return user_name(os.geteuid())


@record(eq=False)
class Lease(LeaseHandle):
    """Leases on one or more devices in a lock directory, taken together (:meth:`LeaseStore.acquire`).
    Release with :meth:`release` (or exit).  It holds a lock descriptor per device
    (:attr:`device_fds`, in the order of :attr:`devices`) and its record's (:attr:`record_fd`); a
    device given back while a command still holds an inherited copy of its lock stays recorded
    (:attr:`lingering`) until :meth:`settle`."""

    lease_id: str
    devices: list[str]
    shared: bool
    memory: int | None
    path: Path
    device_fds: list[int] = field(default_factory=list)
    # the record's lock: held while the lease lives
    record_fd: int = -1
    released: bool = False
    # the lock directory, to remove the record without following any path again
    dir_fd: int = -1
    # what the record says (for LeaseStore.rewrite)
    record: dict[str, Any] | None = None
    holder: Holder = field(default_factory=Holder)
    # given back, still held by a command's copy
    lingering: dict[str, int] = field(default_factory=dict)

    @property
    def fds(self) -> list[int]:
        """The device locks and the record's lock, for a command to inherit."""
        if self.released:
            return []
        return [*self.device_fds, *self.lingering.values(), *([self.record_fd] if self.record_fd >= 0 else [])]

    def epochs(self) -> dict[str, int]:
        """Each device's epoch, as the record says (alloc.epoch)."""
        raw = (self.record or {}).get("epochs")
        return {k: v for k, v in raw.items() if k in self.devices} if isinstance(raw, dict) else {}

    def named_fds(self, devices: list[str]) -> tuple[list[int], list[str]]:
        """The lock descriptors of ``devices`` (those this lease holds) and of the record, and their
        names (a device's UUID, ``"record"``): what the lease authority passes to its client with an
        answer, for it to co-hold (docs/allocation.md, "The descriptors").  Empty once released."""
        if self.released:
            return [], []
        pairs = [(self.device_fds[self.devices.index(d)], d) for d in devices if d in self.devices]
        if self.record_fd >= 0:
            pairs.append((self.record_fd, "record"))
        return [fd for fd, _ in pairs], [name for _, name in pairs]

    @property
    def store(self) -> LeaseStore:
        """The store this lease was taken in (its record's directory)."""
        return LeaseStore.of(self)

    def update(self, **changes: Any) -> None:
        """Rewrite the record with ``changes`` (under the store's selection mutex)."""
        store = self.store
        with store.mutex():
            store.rewrite(self, **changes)

    def give_back(self, device: str, *, linger: bool = False, unlock: bool = False) -> None:
        """Free ``device`` (under the store's mutex; the record stops naming it first).  ``linger``:
        a command holds an inherited copy of its lock, so the GPU stays locked whatever we do: keep it
        recorded (:attr:`lingering`) until :meth:`settle`.  ``unlock``: a command holds such a copy but
        no longer uses the GPU (moved away): unlock it for everyone (the flock belongs to the open
        file, which the copy shares)."""
        store = self.store
        with store.mutex():
            store.drop(self, device, linger=linger, unlock=unlock)

    def join(self, extra: Lease) -> None:
        """``extra``'s devices join this lease (a job grown): one record names them all (under the
        store's mutex; on an error nothing has changed, and the caller releases ``extra``)."""
        store = self.store
        with store.mutex():
            store.join(self, extra)

    def settle(self) -> None:
        """The command that held copies of the :attr:`lingering` devices' locks has exited: the record
        stops naming them, then they are closed (under the store's mutex)."""
        if not self.lingering or self.released:
            return
        store = self.store
        with store.mutex():
            gone, self.lingering = self.lingering, {}
            try:
                store.rewrite(self)
            except BaseException:
                self.lingering = gone
                raise
        for fd in gone.values():
            _end_device(fd)

    def release(self, unlock: bool = False) -> None:
        """End the lease.  ``unlock``: another process holds copies of its descriptors (the lease
        authority passed them to its client), so the locks are dropped for every copy (``LOCK_UN``
        on the open files they share) rather than only closed here."""
        if self.released:
            return
        self.released = True
        devices = [*self.device_fds, *self.lingering.values()]
        for fd in devices:
            try:
                # The lock file's mtime says when the GPU's last lease ended: the load before then
                # was this job's, no reason to avoid the GPU now (see LeaseStore.release_times).
                os.utime(fd)
            except OSError:
                pass
        # Devices first: their close is what waiters are woken by (queue.LeaseWatch), and a record
        # whose devices are free no longer counts anyway.
        for fd in devices:
            # closing drops the flock (unless a child still holds a copy)
            _end_device(fd, unlock=unlock)
        try:
            if self.dir_fd >= 0:
                os.unlink(self.path.name, dir_fd=self.dir_fd)
        except OSError:
            pass
        if unlock and self.record_fd >= 0:
            _unlock(self.record_fd)
        for fd in (self.record_fd, self.dir_fd):
            try:
                if fd >= 0:
                    os.close(fd)
            except OSError:
                pass
        self.device_fds, self.lingering = [], {}
        self.record_fd = self.dir_fd = -1

    def forget(self) -> None:
        """Close this process's descriptors without ending the lease: for when they were handed to
        another process (the daemon passing its leases to its clients as it stops), whose copies keep
        the locks held and the record valid."""
        for fd in (*self.device_fds, *self.lingering.values(), self.record_fd, self.dir_fd):
            try:
                if fd >= 0:
                    os.close(fd)
            except OSError:
                pass
        self.device_fds, self.lingering, self.record_fd, self.dir_fd, self.released = [], {}, -1, -1, True

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    # a dropped Selection must not leak locks
    def __del__(self) -> None:
        try:
            self.release()
        except Exception:
            pass


def _end_device(fd: int, unlock: bool = False) -> None:
    """Close a device's lock descriptor, saying when its lease ended (the lock file's mtime:
    LeaseStore.release_times); ``unlock``: drop the flock first, for the copies a command inherited too."""
    try:
        os.utime(fd)
    except OSError:
        pass
    if unlock:
        _unlock(fd)
    try:
        os.close(fd)
    except OSError:
        pass


def _unlock(fd: int) -> None:
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError:
        pass


# the authority store of this process, while it serves the lease socket
_serving: LeaseStore | None = None


def authority_serving() -> bool:
    """Whether a daemon is this machine's lease authority: this process serves the lease socket, or a
    socket owned by root is where clients look for it (``$GPUSD_LEASE_SOCKET``, or the default where a
    client turned its own off: the attacker's environment must not hide the authority from others)."""
    if _serving is not None:
        return True
    import stat as _stat

    from .authority import DEFAULT_SOCKET, socket_path

    try:
        st = os.lstat(socket_path() or DEFAULT_SOCKET)
    except OSError:
        return False
    return _stat.S_ISSOCK(st.st_mode) and st.st_uid == 0


def outside_authority(leases: list[LeaseInfo]) -> list[LeaseInfo]:
    """``leases`` of the shared lock directory, marked "not through the authority" (not the locks held
    without a lease: those say so already).  Copies: a lease view's cached records stay as read."""
    from dataclasses import replace

    return [replace(le, outside_authority=True) if not le.unleased else le for le in leases]


class LeaseStore:
    """The lock directory of this machine (``private``: the lease authority's own directory in it,
    ``<lock dir>/authority``, whose lock files only the daemon can open; see docs/allocation.md,
    "What a local user can and cannot do").  Each store also reads the leases and waiters of the
    other one (:meth:`peers`), so that leases taken in either never overlap."""

    def __init__(self, directory: Path | str | None = None, private: bool = False) -> None:
        self.dir = Path(directory) if directory is not None else lock_dir()
        self.private = private
        # why the last acquire returned None: who holds what
        self.refusal: str | None = None
        # and the device it could not take
        self.refused: str | None = None

    @classmethod
    def authority(cls, base: Path | str | None = None) -> LeaseStore:
        """The lease authority's store, inside the lock directory ``base`` (default: this machine's)."""
        return cls(Path(base) if base is not None else lock_dir()).sub()

    def sub(self) -> LeaseStore:
        return LeaseStore(self.dir / AUTHORITY_DIR, private=True) if not self.private else self

    @staticmethod
    def for_daemon() -> LeaseStore:
        """Where this daemon takes leases: its authority store while it serves the lease socket
        (remote leases, moves), else the shared lock directory."""
        return _serving if _serving is not None else LeaseStore()

    @staticmethod
    def of(lease: Lease) -> LeaseStore:
        """The store ``lease`` was taken in (its record's directory)."""
        d = lease.path.parent
        return LeaseStore(d, private=d.name == AUTHORITY_DIR)

    @staticmethod
    def serving(store: LeaseStore | None) -> None:
        """Record (None: forget) the authority store of this process (the lease socket's)."""
        global _serving
        _serving = store

    def peers(self) -> list[LeaseStore]:
        """The other store of this machine whose leases and waiters count here too: the shared lock
        directory for the authority's store; for the shared one, the authority's store when it is
        there and can be trusted (a real directory owned by root or by us that nobody else can write)."""
        if self.private:
            return [LeaseStore(self.dir.parent)]
        path = self.dir / AUTHORITY_DIR
        try:
            st = os.lstat(path)
        except OSError:
            return []
        import stat as _stat

        if not _stat.S_ISDIR(st.st_mode) or st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o022:
            log.debug("ignoring %s: not a lease authority's directory (%s's, mode %o)", path,
                      owner_name(st.st_uid), st.st_mode & 0o7777)
            return []
        return [LeaseStore(path, private=True)]

    def prepare(self) -> None:
        """Make the authority's store ready (the daemon, as it becomes the lease authority): the
        shared lock directory exists and is safe; the authority's directory in it is our own, made
        new when something else squats its name (moved aside, never chmod-ed or followed); tickets a
        previous daemon left are removed, except those whose lock is held: the places this daemon
        re-adopted for their waiters (:func:`gpusd.alloc.queue.readopt`), or a live daemon's."""
        fd = self._own_dir()
        try:
            for name in os.listdir(fd):
                if name.startswith(("queue-", ".queue-")) and name.endswith((".ticket", ".tmp")):
                    _remove_unlocked(fd, name)
        finally:
            os.close(fd)

    def claim(self) -> int:
        """Become the lease authority of this lock directory (a daemon, before :meth:`prepare`):
        ``LOCK_EX`` on :data:`CLAIM_FILE` in the authority's directory, held for the daemon's life
        through the descriptor returned.  GpusdError (one line, naming the holder) when another daemon
        holds it, and nothing is changed: a second authority would remove the first one's queue
        tickets, whatever state directory or socket it has."""
        fd = self._own_dir()
        try:
            lock = open_lock_file(fd, CLAIM_FILE, self.dir, private=True)
            if not try_lock(lock, shared=False):
                who = describe_holders(lock)
                os.close(lock)
                raise GpusdError(f"another gpusd daemon ({who}) is already the lease authority of the lock directory "
                                 f"{self.dir.parent}: stop it first, or give this daemon another GPUSD_LOCK_DIR (or "
                                 "GPUSD_LEASE_SOCKET=off: no leases)")
            return lock
        finally:
            os.close(fd)

    def _own_dir(self) -> int:
        """The authority's directory, checked (made new when something else squats its name)."""
        assert self.private
        parent = open_dir(self.dir.parent, True)
        assert parent is not None
        try:
            try:
                fd = open_dir(self.dir, True, private=True)
            except GpusdError:
                replace_private_dir(parent, self.dir.name, self.dir)
                fd = open_dir(self.dir, True, private=True)
            assert fd is not None
            return fd
        finally:
            os.close(parent)

    # -- setup ----------------------------------------------------------------------------------
    def open(self, create: bool = True) -> int | None:
        """A descriptor of the (checked) lock directory; the caller closes it.  None when it does
        not exist and ``create`` is False."""
        if self.private and not create:
            try:
                fd = os.open(self.dir, DIR_FLAGS)
            except FileNotFoundError:
                return None
            except OSError as exc:
                raise GpusdError(f"cannot open the lease authority's lock directory {self.dir}: "
                                 f"{exc.strerror}") from None
            st = os.fstat(fd)
            # read by others: root's, or ours
            if st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o022:
                os.close(fd)
                check_private_dir(self.dir, st)  # raises, saying why
            return fd
        return open_dir(self.dir, create, private=self.private)

    def open_listed(self) -> int | None:
        """:meth:`open` for a reader that lists what is there: None where the directory does not
        exist or is not trusted (a directory we do not believe lists nothing)."""
        try:
            return self.open(create=False)
        except GpusdError:
            return None

    def _writable(self) -> int:
        fd = open_dir(self.dir, True, private=self.private)
        assert fd is not None
        if not os.access(self.dir, os.W_OK | os.X_OK):
            st = os.fstat(fd)
            os.close(fd)
            d = self.dir
            raise GpusdError(
                f"the lock directory {d} is not writable for you (mode {st.st_mode & 0o7777:o}, uid "
                f"{st.st_uid}): its owner should `chmod 1777 {d}`, or set GPUSD_LOCK_DIR for every user")
        return fd

    def ensure(self) -> None:
        """Create the lock directory if needed, and check that it is safe and writable."""
        os.close(self._writable())

    @contextmanager
    def mutex(self, deadline: float | None = None) -> Iterator[None]:
        """The machine-wide selection mutex.  The wait for it is bounded by :func:`mutex_timeout`
        and by ``deadline`` (``time.monotonic()``): :class:`LockBusy`, or :class:`WaitTimeout` when
        ``deadline`` ran out first, naming the holder."""
        dfd = self._writable()
        try:
            fd = open_lock_file(dfd, "select.lock", self.dir, private=self.private)
        finally:
            os.close(dfd)
        try:
            bound = mutex_timeout()
            limit = time.monotonic() + bound
            what = f"the selection mutex {self.dir / 'select.lock'}"
            why = ("a gpusd job holds it for about a millisecond: that process is stuck or hostile; stop it, "
                   "or ask an administrator")
            if deadline is not None and deadline < limit:
                try:
                    lock_within(fd, shared=False, deadline=deadline)
                except LockBusy as exc:
                    raise WaitTimeout(f"{what} is held by {exc} ({why})") from None
            else:
                try:
                    lock_within(fd, shared=False, deadline=limit)
                except LockBusy as exc:
                    raise LockBusy(f"{what} has been held for more than {bound:g}s by {exc}; gave up ({why})") from None
            yield
        finally:
            os.close(fd)

    def mutex_holders(self, confirm: float = 0.05) -> list[tuple[int, int | None]]:
        """Who holds the selection mutex, for the views: (pid, uid or None), from ``/proc/locks``;
        empty when it is free.  It is tried without blocking (an allocation waiting for it just tries
        again), and again after ``confirm`` seconds: an allocation holds it for about a millisecond,
        so only a holder that keeps it is named.  Not for the authority's own mutex (nobody else can
        open it)."""
        if self.private:
            return []
        dfd = self.open(create=False)
        if dfd is None:
            return []
        try:
            fd = os.open("select.lock", FILE_FLAGS | os.O_RDONLY, dir_fd=dfd)
        except OSError:
            return []
        finally:
            os.close(dfd)
        try:
            for attempt in range(2):
                if try_lock(fd, shared=False):
                    return []
                if not attempt:
                    time.sleep(confirm)
            table = flock_table() or {}
            holders = table.get(lock_key(os.fstat(fd)), [])[:8]
            return [(pid, process_uid(pid) if pid > 0 else None) for pid, _ in holders]
        except OSError:
            return []
        finally:
            # read-only: its close is no event for the queue's watchers
            os.close(fd)

    # -- reading --------------------------------------------------------------------------------
    def leases(self, cleanup: bool = False, peers: bool = True) -> list[LeaseInfo]:
        """Live leases, one :class:`LeaseInfo` per leased device.  A lease file whose holder died
        is skipped (and removed when ``cleanup`` and permissions allow); so is a record the kernel
        does not confirm (see the module docstring).  A device lock held by a process that holds no
        lease on it comes as a LeaseInfo with ``unleased`` set, naming that process's pid and uid
        (it blocks the GPU here: an administrator's to act on; not looked for in the authority's own
        directory, whose lock files only its user can open).  With ``cleanup`` (a caller under the
        selection mutex: the allocation itself) such locks are found by trying each unleased GPU's
        lock, and ``/proc/locks`` (a read costs the kernel an RCU grace period, ~10 ms on a busy
        machine) is read only to name a holder found so.  With ``peers``, the confirmed leases of
        :meth:`peers` follow (not the locks held there without a lease: they block nothing here)."""
        dfd = self.open(create=False)
        if dfd is None:
            out: list[LeaseInfo] = []
        else:
            try:
                out = self._leases(dfd, cleanup, blockers=not self.private)
            finally:
                os.close(dfd)
        if not self.private and out and authority_serving():
            out = outside_authority(out)
        if peers:
            for peer in self.peers():
                try:
                    got = peer._confirmed()
                except GpusdError as exc:
                    log.warning("%s", exc)
                    continue
                out.extend(outside_authority(got) if not peer.private and got and authority_serving() else got)
        return out

    def _confirmed(self) -> list[LeaseInfo]:
        """The leases the kernel confirms, nothing else (read by the other store)."""
        dfd = self.open(create=False)
        if dfd is None:
            return []
        try:
            return self._leases(dfd, False, blockers=False)
        finally:
            os.close(dfd)

    def lease_of(self, lease_id: str) -> tuple[int, list[LeaseInfo]] | None:
        """The record of lease ``lease_id`` alone, read as :meth:`leases` reads each (live, typed,
        confirmed by the kernel): the uid that owns the file and its :class:`LeaseInfo` (one per
        device), or None when there is no such live record.  No scan of the directory: other users'
        files (there may be thousands, and a scan reads at most MAX_LEASE_FILES) cannot hide it.  Looked
        for in this store and its :meth:`peers`, the authority's own directory first: a root daemon's
        leases are there, where no other user can write, so a record of the same id that another user
        wrote in the shared directory never hides the daemon's."""
        for store in sorted((self, *self.peers()), key=lambda st: not st.private):
            try:
                got = store._lease_of_here(lease_id)
            except GpusdError as exc:
                if store is self:
                    raise
                log.warning("%s", exc)
                continue
            if got is not None:
                return got
        return None

    def _lease_of_here(self, lease_id: str) -> tuple[int, list[LeaseInfo]] | None:
        from ..ids import LeaseId

        if not LeaseId.is_valid(lease_id):
            return None
        name = f"lease-{lease_id}.json"
        dfd = self.open(create=False)
        if dfd is None:
            return None
        try:
            got = read_live(dfd, name, MAX_LEASE_BYTES, False, single_link=False)
            if got is None:
                return None
            st, raw = got
            if len(raw) > MAX_LEASE_BYTES:
                return None
            record = self._parse(name, raw)
            if record is None:
                return None
            infos = self._believe(dfd, name, lease_id, st, record, flock_table())
            return (st.st_uid, infos) if infos else None
        finally:
            os.close(dfd)

    def _leases(self, dfd: int, cleanup: bool, blockers: bool = False) -> list[LeaseInfo]:
        """The live leases of the directory ``dfd``, through this process's view of it (read again
        only where the kernel's events say something changed: :mod:`gpusd.alloc.leaseview`)."""
        from . import leaseview

        return leaseview.look(self, dfd, cleanup, blockers)

    def _unleased(self, dfd: int, devices: list[str], confirmed: dict[str, set[int]],
                  table: dict[str, list[tuple[int, bool]]] | None,
                  suspects: set[int] | None = None) -> list[LeaseInfo]:
        """The device locks held by processes that hold no confirmed lease on the device (``/proc/locks``).

        Two kinds, told apart by who holds the lock.  In the authority's own directory only the daemon
        (or a client it handed a lease's descriptors to) can lock a file, and in the shared one a
        process in ``suspects`` holds the lock of a record this directory cannot read or confirm:
        such a lock is a lease whose record is damaged, empty or foreign (``unreadable``: the GPU
        stays taken, the kernel's lock is the truth).  Any other holder is someone bypassing gpusd,
        or a local user blocking the GPU (``unleased``).  Both are named by pid and uid."""
        out: list[LeaseInfo] = []
        if not table:
            return out
        for dev in devices:
            try:
                st = os.stat(f"gpu-{dev}.lock", dir_fd=dfd, follow_symlinks=False)
            except OSError:
                continue
            ours = confirmed.get(dev, set())
            for pid, exclusive in table.get(lock_key(st), [])[:8]:
                if pid in ours:
                    continue
                uid = process_uid(pid) if pid > 0 else None
                who = owner_name(uid) if uid is not None else "an unknown user"
                mode = "LOCK_EX" if exclusive else "LOCK_SH"
                if self.private or (suspects is not None and pid in suspects):
                    out.append(LeaseInfo.from_dict({
                        "lease_id": "-", "pid": pid, "user": user_name(uid) if uid is not None else None,
                        "shared": not exclusive, "device": dev, "unreadable": True,
                        "command": f"record unreadable: {holder_name(pid)} holds {mode} on "
                                   f"{self.dir / f'gpu-{dev}.lock'} but its lease record cannot be read (damaged, "
                                   "empty or not a gpusd record); the GPU stays held until that lock is released"}))
                    continue
                out.append(LeaseInfo.from_dict({
                    "lease_id": "-", "pid": pid, "user": who, "shared": not exclusive, "device": dev,
                    "unleased": True,
                    "command": f"without a lease: {holder_name(pid)} holds {mode} "
                               f"on {self.dir / f'gpu-{dev}.lock'}, not through gpusd; stop it, or ask an "
                               "administrator"}))
        return out

    @staticmethod
    def _parse(name: str, raw: bytes) -> dict[str, Any] | None:
        """The fields of a lease record, typed and bounded; None (logged) when it is not one."""
        from ..ids import JobId, SlurmJobId

        # here: a lock directory without lease records needs no JSON
        from ..sanitize import json_object

        try:
            d = json_object(raw)
            devices = d.get("devices")
            if (not isinstance(devices, list) or not devices or len(devices) > MAX_LEASE_DEVICES
                    or not all(isinstance(x, str) and 0 < len(x) <= 128 for x in devices)):
                raise ValueError("no valid device list")
            pid, memory, started = d.get("pid"), d.get("memory"), d.get("started")
            if type(pid) is not int or not 0 < pid < 2**31:
                raise ValueError("no valid pid")
            if memory is not None and (type(memory) is not int or memory < 0):
                raise ValueError("bad memory")
            if started is not None and (type(started) not in (int, float) or not math.isfinite(started)):
                raise ValueError("bad start time")
            user, command = d.get("user"), d.get("command")
            # a daemon's remote lease
            remote_from, expires = d.get("remote_from"), d.get("expires")
            if expires is not None and (type(expires) not in (int, float) or not math.isfinite(expires)):
                raise ValueError("bad expiry time")
            # when its holder stops renewing (shown only): a bad one costs itself
            raw_ends = d.get("ends")
            ends = float(raw_ends) if isinstance(raw_ends, (int, float)) and not isinstance(raw_ends, bool) \
                and math.isfinite(raw_ends) else None
            epoch, epochs = d.get("epoch"), d.get("epochs")
            if type(epoch) is not int or not 0 < epoch < MAX_EPOCH:
                # a bad epoch costs the epoch, not the record (the kernel's lock is the truth)
                epoch = None
            epochs = ({k: v for k, v in list(epochs.items())[:MAX_LEASE_DEVICES]
                       if k in devices and type(v) is int and 0 < v < MAX_EPOCH}
                      if isinstance(epochs, dict) else {})
            return {
                "epoch": epoch, "epochs": epochs,
                "pid": pid, "memory": memory, "started": started, "shared": d.get("shared") is True,
                "devices": devices, "user": user[:64] if isinstance(user, str) else None,
                "command": command[:1024] if isinstance(command, str) else None,
                "remote_from": remote_from[:128] if isinstance(remote_from, str) else None,
                "expires": float(expires) if expires is not None else None, "ends": ends,
                "job": JobId.optional(d.get("job")),
                "slurm_job": SlurmJobId.optional(d.get("slurm_job")),
            }
        except (ValueError, TypeError, RecursionError) as exc:
            log.warning("skipping unreadable lease file %s: %s", name, exc)
            return None

    def _believe(self, dfd: int, name: str, lease_id: str, st: os.stat_result, rec: dict[str, Any],
                 table: dict[str, list[tuple[int, bool]]] | None) -> list[LeaseInfo]:
        """The part of a live record the kernel confirms, attributed to the file's owner."""
        holders = [pid for pid, _ in table.get(lock_key(st), [])] if table is not None else []
        # /proc/locks sees this file system: check every device claimed
        if holders:
            for dev in rec["devices"]:
                try:
                    dst = os.stat(f"gpu-{safe_name(dev)}.lock", dir_fd=dfd, follow_symlinks=False)
                except OSError:
                    dst = None
                locks = table.get(lock_key(dst), []) if (table is not None and dst is not None) else []
                # /proc/locks names the process that took a lock, even after it handed the open file on
                # and died.  In the lease authority's own directory only its user can open a lock file,
                # so a device lock held there in the claimed mode is the record's even under another pid
                # (a remote lease a restarted daemon took back, its record rewritten since: docs/pool.md)
                anyone = self.private and st.st_uid in (0, os.geteuid()) and dst is not None and \
                    dst.st_uid == st.st_uid
                if not any((anyone or pid in holders) and excl != rec["shared"] for pid, excl in locks):
                    log.debug("ignoring lease file %s of %s: it claims %s, which its holder does not hold",
                                name, user_name(st.st_uid), safe_name(dev)[:64])
                    return []
        pid, user = rec["pid"], rec["user"]
        # only root (the lease authority) may write a record for someone else
        if st.st_uid != 0:
            user = user_name(st.st_uid)
            if process_uid(pid) != st.st_uid:
                pid = holders[0] if holders and holders[0] > 0 else 0
        base = {"lease_id": lease_id, "pid": pid, "user": user, "started": rec["started"],
                "memory": rec["memory"], "shared": rec["shared"], "command": rec["command"],
                "remote_from": rec["remote_from"], "expires": rec["expires"], "ends": rec.get("ends"),
                "job": rec.get("job"),
                # a Slurm job's lease is recorded by the lease authority (root) only (docs/slurm.md)
                "slurm_job": rec.get("slurm_job") if st.st_uid == 0 else None}
        return [LeaseInfo.from_dict({**base, "device": dev, "epoch": rec["epochs"].get(dev, rec["epoch"])})
                for dev in rec["devices"]]

    def release_times(self, within: float = 60.0) -> dict[str, float]:
        """Device UUID -> when its last gpusd lease ended (the lock file's mtime), for leases that
        ended in the last ``within`` seconds.  Selection ignores utilisation samples from before."""
        out: dict[str, float] = {}
        horizon = time.time() - within
        dfd = self.open_listed()
        if dfd is None:
            return out
        try:
            from . import leaseview

            # this process's view of the directory, if any
            known = leaseview.release_times(self, dfd, horizon)
            if known is not None:
                out = known
            else:
                with os.scandir(dfd) as entries:
                    for entry in entries:
                        name = entry.name
                        if name.startswith("gpu-") and name.endswith(".lock"):
                            try:
                                mtime = entry.stat(follow_symlinks=False).st_mtime
                            except OSError:
                                continue
                            if mtime >= horizon:
                                out[name[4:-5]] = mtime
        except OSError:
            pass
        finally:
            os.close(dfd)
        # the authority's ends count here; never the other way (anyone can touch ours)
        if not self.private:
            for peer in self.peers():
                for dev, mtime in peer.release_times(within).items():
                    out[dev] = max(mtime, out.get(dev, mtime))
        return out

    def attach(self, snap: HostSnapshot) -> HostSnapshot:
        """Add the live leases to the GPUs of ``snap`` (a MIG slice's lease to its parent GPU)."""
        try:
            leases = self.leases()
        except GpusdError as exc:
            # a refused lock directory: say so, but show the GPUs
            log.warning("%s", exc)
            return snap
        owner: dict[str, int] = {}
        for i, g in enumerate(snap.gpus):
            owner[g.uuid] = i
            for m in g.mig_instances:
                owner[m.uuid] = i
        from .policy import flag_over_cap

        # a user over a cap is flagged (alloc/policy.py)
        for lease in flag_over_cap(leases):
            at = owner.get(lease.device or "")
            if at is not None:
                snap.gpus[at].leases.append(lease)
        mark_unleased(snap)
        return snap

    # -- taking ---------------------------------------------------------------------------------
    def acquire(self, devices: list[str], *, shared: bool = False, memory: int | None = None,
                holder: Holder | None = None) -> Lease | None:
        """Lock ``devices`` (all or nothing, without blocking) and record the lease.  Returns None
        when one of them is held in a conflicting mode (:attr:`refusal` then says by whom), here or,
        at the same moment, in the other store (:meth:`peers`).  Call under :meth:`mutex` for atomicity
        with the choice of devices.  ``holder`` says who the lease is for, written into the record:
        its ``pid`` and ``user`` name the job when it is not this process (the daemon taking a lease
        for a client; only root's records are believed to name others), its ``command``, and for a
        lease the daemon holds for a remote holder ``remote_from`` and ``expires`` (docs/pool.md),
        ``job`` (the gpusd job the lease is for) and ``slurm_job``."""
        import json

        from ..ids import LeaseId

        holder = holder or Holder()
        dfd = self._writable()
        fds: list[int] = []
        try:
            for dev in devices:
                # read-only in the authority's store: the daemon passes these descriptors to its client
                fd = open_lock_file(dfd, f"gpu-{safe_name(dev)}.lock", self.dir, private=self.private,
                                    read_only=self.private)
                fds.append(fd)
                if not try_lock(fd, shared):
                    # A process that bypassed the mutex: named, so that someone can act
                    self.refused = dev
                    self.refusal = (f"{safe_name(dev)[:64]} is locked by {describe_holders(fd)} "
                                    f"({self.dir / f'gpu-{safe_name(dev)}.lock'})")
                    for f in fds:
                        os.close(f)
                    os.close(dfd)
                    return None
            lease_id = LeaseId.new()
            # the fencing token of this grant (alloc.epoch)
            epoch = self._grant_epoch(dfd, list(devices))
            record = {
                "format": LEASE_FORMAT,
                "lease_id": lease_id,
                "pid": holder.pid or os.getpid(),
                "user": holder.user or current_user(),
                "started": time.time(),
                "memory": memory,
                "shared": shared,
                "command": holder.command,
                "devices": list(devices),
                **holder.extra(),
                "epoch": epoch,
                "epochs": {dev: epoch for dev in devices},
            }
            final = f"lease-{lease_id}.json"
            tmp = f".lease-{lease_id}.tmp"
            # locked before it is visible; a full disk: DiskFull, nothing left behind
            fds.append(self._new_record(dfd, tmp, final, json.dumps(record).encode()))
        except BaseException:
            for f in (*fds, dfd):
                try:
                    os.close(f)
                except OSError:
                    pass
            raise
        lease = Lease(lease_id, list(devices), shared, memory, self.dir / final, fds[:-1], fds[-1], dir_fd=dfd,
                      record=record, holder=holder)
        # The other store's mutex is not ours: a lease published there at the same moment could name
        # the same GPU.  Each side publishes, then looks at the other; at least one of two such leases
        # sees the other and gives way (both may: each then tries again).
        try:
            clash = [le for peer in self.peers() for le in peer.leases(peers=False)
                     if not le.unleased and le.device in devices and not (shared and le.shared)]
        except BaseException:
            lease.release()
            raise
        if clash:
            lease.release()
            le = clash[0]
            self.refused = le.device
            self.refusal = f"{(le.device or '?')[:64]} was leased at the same moment by pid {le.pid} of {le.user}"
            return None
        return lease

    def _grant_epoch(self, dfd: int, devices: list[str]) -> int:
        """The epoch of a grant of ``devices`` here now, remembered here before the lease's record is
        published (so the next grant, in either store, sees it): above what either store remembers."""
        from . import epoch as _epoch

        fds: list[int] = []
        try:
            for peer in self.peers():
                # a peer directory we do not believe is left out: the clock and our own count still hold
                fd = peer.open_listed()
                if fd is not None:
                    fds.append(fd)
            return _epoch.grant(dfd, fds, devices, self.private)
        finally:
            for fd in fds:
                os.close(fd)

    def rewrite(self, lease: Lease, **changes: Any) -> None:
        """Replace ``lease``'s record with one where ``changes`` apply (a remote lease's new expiry):
        a new file, locked before it is renamed over the old one, so no reader ever sees a lease
        without a locked record.  The record names ``changes["devices"]`` (default: the lease's
        devices) and the lease's :attr:`~Lease.lingering` ones.  Call under :meth:`mutex` (a
        stale-record cleanup must not run between the rename and the old file's close); a holder
        does so through :meth:`Lease.update`.  GpusdError/OSError when it cannot."""
        import json

        if lease.released or lease.dir_fd < 0 or lease.record is None:
            raise GpusdError("the lease is no longer held")
        devices = list(changes.pop("devices", lease.devices))
        record = {**lease.record, **changes, "devices": [*devices, *(d for d in lease.lingering if d not in devices)]}
        tmp = f".lease-{lease.lease_id}.{os.urandom(3).hex()}.tmp"
        fd = self._new_record(lease.dir_fd, tmp, lease.path.name, json.dumps(record).encode())
        old, lease.record_fd = lease.record_fd, fd
        lease.record = record
        if old >= 0:
            os.close(old)

    def adopt(self, lease_id: str, record: dict[str, Any], fds: list[int], holder: Holder,
              **changes: Any) -> Lease | None:
        """Take back lease ``lease_id`` from descriptors another process kept for it (a restarted
        daemon, its remote leases: docs/pool.md).  ``record`` is what its record said; ``fds`` are
        believed only as far as they are, each, the lock file of one of the record's devices in this
        directory (same device and inode) whose lock they still hold (a device lock someone else holds
        refuses the adoption).  The record is then written anew with ``changes``, locked by us (the
        old one's lock may have gone with the process that died).  Returns the lease, or None (every
        descriptor closed; the reason logged) when they are not.  Takes the store's mutex."""
        import stat as _stat

        from ..ids import LeaseId

        devices = record.get("devices")
        shared = record.get("shared") is True
        memory = record.get("memory") if type(record.get("memory")) is int else None
        mine: list[int] = []
        spare = list(fds)
        dfd = -1
        try:
            if not LeaseId.is_valid(lease_id) or not isinstance(devices, list) or not devices or \
                    not all(isinstance(d, str) for d in devices):
                raise GpusdError("its record names no devices")
            dfd = self._writable()
            with self.mutex():
                ids = {}
                for fd in spare:
                    try:
                        st = os.fstat(fd)
                    except OSError:
                        continue
                    if _stat.S_ISREG(st.st_mode):
                        ids[(st.st_dev, st.st_ino)] = fd
                for dev in devices:
                    try:
                        st = os.stat(f"gpu-{safe_name(dev)}.lock", dir_fd=dfd, follow_symlinks=False)
                    except OSError:
                        raise GpusdError(f"the lock file of {safe_name(dev)[:64]} is gone") from None
                    fd = ids.pop((st.st_dev, st.st_ino), -1)
                    if fd < 0:
                        raise GpusdError(f"no descriptor of {safe_name(dev)[:64]}'s lock was kept")
                    spare.remove(fd)
                    mine.append(fd)
                    # ours still holds it (a no-op), unless someone else does
                    if not try_lock(fd, shared):
                        raise GpusdError(f"{safe_name(dev)[:64]} is locked by {describe_holders(fd)}")
                lease = Lease(lease_id, list(devices), shared, memory, self.dir / f"lease-{lease_id}.json", mine,
                              -1, dir_fd=dfd, record={**record, "lease_id": lease_id}, holder=holder)
                mine, dfd = [], -1  # the lease's now
                try:
                    self.rewrite(lease, **changes)
                except BaseException:
                    lease.release()
                    raise
            return lease
        except (GpusdError, OSError) as exc:
            log.warning("cannot take back lease %s: %s", lease_id[:40], exc)
            return None
        finally:
            for fd in (*mine, *spare, *([dfd] if dfd >= 0 else [])):
                try:
                    os.close(fd)
                except OSError:
                    pass

    def _new_record(self, dfd: int, tmp: str, final: str, data: bytes) -> int:
        """Write the record ``data`` as ``tmp``, locked (``LOCK_EX``) before anyone else may open it,
        then renamed to ``final``; the descriptor that holds the lock.  In the authority's store that
        descriptor is read-only and the record is written through a second one: the daemon passes its
        copies of a lease's descriptors to the client (docs/allocation.md), who must not be able to
        rewrite a record of root's, which is believed to name its holder.  A full disk: DiskFull
        (naming the directory), ``tmp`` removed."""
        if not self.private:
            fd = create_exclusive(dfd, tmp, self.dir, lock=True)
            try:
                write_new(dfd, fd, tmp, final, data, self.dir)
            except BaseException:
                os.close(fd)
                raise
            return fd
        fd = create_exclusive(dfd, tmp, self.dir, lock=True, read_only=True)
        try:
            # the file just made, in a directory only we can write: the name is still it (checked anyway)
            try:
                writer = os.open(tmp, FILE_FLAGS | os.O_WRONLY, dir_fd=dfd)
            except BaseException:
                try:
                    os.unlink(tmp, dir_fd=dfd)
                except OSError:
                    pass
                raise
            try:
                if not os.path.samestat(os.fstat(writer), os.fstat(fd)):
                    raise GpusdError(f"{self.dir / tmp} was replaced while it was written")
                write_new(dfd, writer, tmp, final, data, self.dir)
            finally:
                os.close(writer)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def join(self, lease: Lease, extra: Lease) -> None:
        """``extra``'s devices join ``lease`` (a job grown under its lease): one record names them
        all, ``extra``'s record goes.  The record is rewritten before anything else changes, and it
        never names a device its holder does not hold.  Call under :meth:`mutex`, like
        :meth:`rewrite`; on an error nothing has changed (the caller releases ``extra``)."""
        if extra.released or extra.shared != lease.shared:
            raise GpusdError("cannot join these leases")
        devices = [*lease.devices, *extra.devices]
        # each GPU keeps the epoch of its own grant
        epochs = {**lease.epochs(), **extra.epochs()}
        self.rewrite(lease, devices=devices, epochs=epochs, epoch=max(epochs.values()) if epochs else None)
        lease.device_fds = [*lease.device_fds, *extra.device_fds]
        lease.devices = devices
        extra.device_fds, extra.devices = [], []
        extra.release()  # only its record now

    def drop(self, lease: Lease, device: str, *, linger: bool = False, unlock: bool = False) -> None:
        """Free one device of ``lease`` at once (a job shrunk): the record stops naming it first,
        then its lock is closed (``unlock``: unlocked first, for a command's inherited copy; ``linger``:
        kept, and recorded, in :attr:`Lease.lingering`).  Call under :meth:`mutex`.  GpusdError when
        the lease does not hold it or it is the last one (a lease ends with its holder's release)."""
        if device not in lease.devices or lease.released:
            raise GpusdError(f"the lease does not hold {device[:128]}")
        if len(lease.devices) == 1:
            raise GpusdError("a lease keeps at least one device")
        at = lease.devices.index(device)
        devices = [d for d in lease.devices if d != device]
        fd = lease.device_fds[at]
        if linger:
            lease.lingering[device] = fd
        try:
            self.rewrite(lease, devices=devices)
        except BaseException:
            lease.lingering.pop(device, None)
            raise
        lease.device_fds.pop(at)
        lease.devices = devices
        if not linger:
            _end_device(fd, unlock=unlock)


def _ancestors(pid: int, depth: int = 64) -> set[int]:
    """``pid`` and its parents, as /proc shows them (bounded; a process of another pid namespace: itself)."""
    out = {pid}
    for _ in range(depth):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                raw = f.read(4096)
        except OSError:
            break
        try:
            ppid = int(raw[raw.rindex(b")") + 2:].split()[1])
        except (ValueError, IndexError):
            break
        if ppid <= 1 or ppid in out:
            break
        out.add(ppid)
        pid = ppid
    return out


def mark_unleased(snap: HostSnapshot) -> None:
    """Mark each GPU process that no lease on its GPU covers (``ProcessInfo.unleased``): a process is
    covered by a lease whose holder is the process or one of its ancestors, or whose user is the
    process's user (a remote reservation's job runs under sshd, not under the daemon that holds it).
    So an administrator sees who uses GPUs without gpusd (devices, top, the dashboard, the history)."""
    for g in snap.gpus:
        if not g.processes:
            continue
        # a lock held without a lease covers nothing; nor does one whose record is unreadable (whose job?)
        leases = [le for le in g.leases if not le.unleased and not le.unreadable]
        holders = {le.pid for le in leases if le.pid}
        users = {le.user for le in leases if le.user}
        for p in g.processes:
            p.unleased = not ((p.user is not None and p.user in users) or (holders and _ancestors(p.pid) & holders))


def _remove_unlocked(dir_fd: int, name: str) -> None:
    """Remove the queue file ``name`` unless someone holds its lock (a waiter's place: never taken from it)."""
    try:
        fd = os.open(name, FILE_FLAGS | os.O_RDONLY, dir_fd=dir_fd)
    except OSError:
        return
    try:
        abandoned(fd, dir_fd, (name,), True)
    except OSError:
        pass
    finally:
        os.close(fd)
