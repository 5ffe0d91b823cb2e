"""The lock directory, opened so that another local user cannot turn it against us.

Every user of a machine shares one lock directory, so anything in it may have been put there by a
hostile local user.  The rules this module enforces (docs/allocation.md, "What a local user can do"):

* The directory is opened with ``O_DIRECTORY | O_NOFOLLOW`` and refused, with a message saying why,
  when it is not owned by root or by the current user, or when others may write to it without the
  sticky bit.  Every file operation afterwards is relative to that descriptor.
* Files are opened with ``O_NOFOLLOW`` (a symlink is refused, never followed) and ``O_NONBLOCK`` (a
  FIFO cannot hang us), and must be regular files with one link (no hard link to a file elsewhere).
* A file is chmod-ed only right after ``O_CREAT | O_EXCL`` created it, through that descriptor.
* Waiting for a lock another user can hold is bounded (:func:`lock_within`); the error names the
  holder's uid and pid when ``/proc/locks`` tells them.
* A *private* directory (the lease authority's: :func:`open_dir` with ``private``) belongs to the daemon's user
  and nobody else may write to it; its lock files are created ``0600`` (only that user can open them,
  so only it can ``flock`` them), and a lock file there that is not the daemon's own ``0600`` file is
  refused.  Records and tickets anyone may read are created ``0600``, locked, and only then made
  readable (:func:`create_exclusive` with ``lock``): nobody can take a lock on them first.
"""

from __future__ import annotations

import errno
import fcntl
import math
import os
import stat
import time
from pathlib import Path

from ..errors import DiskFull, GpusdError, LockBusy

# typing is not imported at run time: start-up time
TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from typing import Any

# $GPUSD_LOCK_DIR, else this (gpusd.alloc.leases.lock_dir)
DEFAULT_LOCK_DIR = "/tmp/gpusd-locks"
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# What the lease store (gpusd.alloc.leases) and its view (gpusd.alloc.leaseview) both read of a directory
# seconds: the documented bound on a wait for the selection mutex
MUTEX_TIMEOUT = 10.0
# a lease record is a few hundred bytes; larger files are skipped
MAX_LEASE_BYTES = 16384
MAX_LEASE_FILES = 4096


def mutex_timeout() -> float:
    """The bound on a wait for the selection mutex: ``$GPUSD_MUTEX_TIMEOUT`` seconds, default 10."""
    try:
        value = float(os.environ.get("GPUSD_MUTEX_TIMEOUT") or MUTEX_TIMEOUT)
    except ValueError:
        return MUTEX_TIMEOUT
    return value if math.isfinite(value) and value > 0 else MUTEX_TIMEOUT


def safe_name(device: str) -> str:
    """A device's name as it may appear in a file name of the directory (``gpu-NAME.lock``)."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in device)


class LazyLog:
    """A module's logger, ``logging`` imported on first use: most commands never log (start-up time)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, name: str) -> Any:
        import logging

        return getattr(logging.getLogger(self._name), name)


def owner_name(uid: int) -> str:
    """``"alice (uid 1000)"``, or ``"uid 1000"`` when the name is unknown."""
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (KeyError, ImportError):
        return f"uid {uid}"


def user_name(uid: int) -> str:
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (KeyError, ImportError):
        return str(uid)


def check_dir(path: Path, st: os.stat_result) -> None:
    """Refuse a lock directory another user controls (see the module docstring)."""
    me = os.geteuid()
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid not in (0, me):
        raise GpusdError(
            f"refusing the lock directory {path}: it belongs to {owner_name(st.st_uid)}, not to root or you, "
            "so that user could replace the lock files of everyone who uses it. An administrator should create "
            f"it (`sudo install -d -m 1777 {path}`), or run the gpusd daemon as root (docs/allocation.md)")
    if mode & 0o022 and not mode & stat.S_ISVTX:
        raise GpusdError(
            f"refusing the lock directory {path}: its mode {mode:o} lets other users delete or replace your lock "
            f"files; its owner should `chmod 1777 {path}` (world-writable with the sticky bit, like /tmp)")


def check_private_dir(path: Path, st: os.stat_result) -> None:
    """Refuse a private (lease authority) directory that is not ours alone to write."""
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise GpusdError(
            f"refusing the lease authority's lock directory {path}: it must be a directory owned by "
            f"{owner_name(os.geteuid())} that nobody else can write to (it is owned by {owner_name(st.st_uid)}, "
            f"mode {stat.S_IMODE(st.st_mode):o}); an administrator should remove it")


def _symlink(exc: OSError, path: Path) -> bool:
    """Whether an open without following links failed on ``path`` for being a symbolic link."""
    # O_DIRECTORY | O_NOFOLLOW on a symlink says ENOTDIR
    return exc.errno == errno.ELOOP or (exc.errno == errno.ENOTDIR and os.path.islink(path))


def open_dir(path: Path, create: bool, private: bool = False) -> int | None:
    """A descriptor of the checked lock directory; None when it does not exist and ``create`` is
    False.  A directory this call creates gets mode 1777 (``private``: 0755, see the module
    docstring), through its descriptor, after checking that it is the one just made."""
    created = False
    for _ in range(3):
        try:
            fd = os.open(path, DIR_FLAGS)
            break
        except FileNotFoundError:
            if not create:
                return None
            try:
                if not path.parent.is_dir():
                    path.parent.mkdir(parents=True, exist_ok=True)
                os.mkdir(path, 0o700)
                created = True
            except FileExistsError:
                pass
            except PermissionError:
                raise GpusdError(f"cannot create the lock directory {path}: permission denied "
                                 "(set GPUSD_LOCK_DIR)") from None
            except OSError as exc:
                raise GpusdError(f"cannot create the lock directory {path}: {exc.strerror}") from None
        except OSError as exc:
            if _symlink(exc, path):
                raise GpusdError(f"refusing the lock directory {path}: it is a symbolic link (an administrator "
                                 "should remove it, or set GPUSD_LOCK_DIR to a real directory)") from None
            if exc.errno == errno.ENOTDIR:
                raise GpusdError(f"cannot create the lock directory {path}: not a directory") from None
            raise GpusdError(f"cannot open the lock directory {path}: {exc.strerror}") from None
    else:
        raise GpusdError(f"cannot open the lock directory {path}: it keeps disappearing")
    try:
        st = os.fstat(fd)
        if created and st.st_uid == os.geteuid():
            # the directory we just made: open to every user, sticky; a private one readable only
            os.fchmod(fd, 0o755 if private else 0o1777)
            st = os.fstat(fd)
        if private:
            check_private_dir(path, st)
        else:
            check_dir(path, st)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_file(fd: int, where: Path) -> None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        what = "not a regular file" if not stat.S_ISREG(st.st_mode) else "a hard link to another file"
        raise GpusdError(f"refusing {where}: it is {what} (made by {owner_name(st.st_uid)}); an administrator "
                         "should remove it")


def open_lock_file(dir_fd: int, name: str, where: Path, private: bool = False, read_only: bool = False) -> int:
    """Open (creating it with mode 0666 when missing) a lock file every user can lock.

    A file someone else made is opened as it is (read-write, else read-only: ``flock`` works on
    either) and never chmod-ed; a symlink, FIFO or hard link in its place is refused.  ``private``
    (the lease authority's directory): created ``0600``, and an existing file must be our own
    ``0600`` one (anything else is refused: another user could hold a lock on it).  ``read_only``:
    opened (and created) read-only, for a lock whose descriptor the lease authority passes to a client
    (``SCM_RIGHTS``), which must not be able to write into root's files through it."""
    path = where / name
    mode = os.O_RDONLY if read_only else os.O_RDWR
    for _ in range(3):
        try:
            fd = os.open(name, FILE_FLAGS | mode | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=dir_fd)
        except FileExistsError:
            pass
        except PermissionError:
            raise GpusdError(f"cannot create {path}: the lock directory is not writable for you") from None
        else:
            try:
                if not private:
                    # just created by us: other users must be able to open it too
                    os.fchmod(fd, 0o666)
            except BaseException:
                os.close(fd)
                raise
            return fd
        try:
            try:
                fd = os.open(name, FILE_FLAGS | mode, dir_fd=dir_fd)
            except PermissionError:
                fd = os.open(name, FILE_FLAGS | os.O_RDONLY, dir_fd=dir_fd)
        except FileNotFoundError:
            # removed meanwhile: create it
            continue
        except PermissionError:
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                who = f"it belongs to {owner_name(st.st_uid)} with mode {stat.S_IMODE(st.st_mode):03o}"
            except OSError:
                who = "permission denied"
            raise GpusdError(f"cannot open {path}: {who}, so you cannot lock it; ask that user or an "
                             "administrator to remove it") from None
        except OSError as exc:
            if _symlink(exc, path):
                raise GpusdError(f"refusing {path}: it is a symbolic link (someone may be trying to make gpusd "
                                 "write elsewhere); an administrator should remove it") from None
            raise GpusdError(f"cannot open {path}: {exc.strerror}") from None
        _check_file(fd, path)
        if private:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid() or st.st_mode & 0o077:
                os.close(fd)
                raise GpusdError(f"refusing {path}: a lock file of the lease authority must be its own, mode 600 "
                                 f"(it is {owner_name(st.st_uid)}'s, mode {stat.S_IMODE(st.st_mode):03o}); an "
                                 "administrator should remove it")
        return fd
    raise GpusdError(f"cannot open {path}: it keeps disappearing")


def create_exclusive(dir_fd: int, name: str, where: Path, mode: int = 0o644, lock: bool = False,
                     read_only: bool = False) -> int:
    """Create a new file (never an existing one, never through a symlink) for writing, with ``mode``
    whatever the umask (a lease record or ticket others cannot read would be invisible to them: a
    GPU locked with no record, a waiter nobody queues behind).  The chmod is of the file we just
    created, through its descriptor.  With ``lock``, the file holds our ``LOCK_EX`` before anyone
    else may open it (it is created 0600 and made readable after): nobody can lock it first.
    ``read_only``: the descriptor returned cannot write (the lease authority passes its records'
    lock descriptors to its clients); the caller writes through one of its own."""
    access = os.O_RDONLY if read_only else os.O_RDWR
    try:
        fd = os.open(name, FILE_FLAGS | access | os.O_CREAT | os.O_EXCL, 0o600 if lock else mode, dir_fd=dir_fd)
    except OSError as exc:
        # no inode left: the directory's file system is full
        if DiskFull.caused(exc):
            raise DiskFull.of(where, exc, name) from None
        raise GpusdError(f"cannot create {where / name}: {exc.strerror}") from None
    if lock:
        # nobody else can have opened it: never blocks
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        os.fchmod(fd, mode)
    except OSError:
        pass
    return fd


def write_new(dir_fd: int, fd: int, tmp: str, final: str, data: bytes, where: Path) -> None:
    """Write ``data`` into ``fd`` (the new file ``tmp`` of the directory ``dir_fd``), then rename it to
    ``final``: readers see the whole file or none.  On any failure ``tmp`` is removed (the caller still
    closes ``fd``): a full disk leaves no half-written or empty file behind, and says so
    (:class:`DiskFull`, naming ``where``, the directory)."""
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            # no progress: never loop on a file system that takes nothing
            if n <= 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            view = view[n:]
        os.rename(tmp, final, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException as exc:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        if DiskFull.caused(exc):
            raise DiskFull.of(where, exc if isinstance(exc, OSError) else None, final) from None
        raise


def replace_file(path: Path, tmp: Path, data: bytes) -> None:
    """Write ``data`` to ``tmp`` and rename it over ``path`` (files of our own private directories,
    not of the shared lock directory): the whole file or the old one.  On a failure ``tmp`` is removed;
    a full disk says so (:class:`DiskFull`, naming the directory)."""
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            tmp.unlink()
        except OSError:
            pass
        if DiskFull.caused(exc):
            raise DiskFull.of(path.parent, exc if isinstance(exc, OSError) else None, path.name) from None
        raise


def replace_private_dir(parent_fd: int, name: str, where: Path) -> None:
    """Move aside whatever squats the name of a private directory in the shared directory
    ``parent_fd`` (a directory another user made there, or one with the wrong mode), so that a new
    one can be made: nothing of it is followed, opened or chmod-ed.  Only root can move another
    user's entry out of a sticky directory; GpusdError otherwise."""
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise GpusdError(f"cannot check {where}: {exc.strerror}") from None
    aside = f"{name}.refused-{os.urandom(4).hex()}"
    try:
        os.rename(name, aside, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
    except OSError as exc:
        raise GpusdError(f"refusing the lease authority's lock directory {where} ({owner_name(st.st_uid)}'s, mode "
                         f"{stat.S_IMODE(st.st_mode):o}) and cannot move it aside: {exc.strerror}") from None
    from logging import getLogger

    getLogger(__name__).warning("moved %s (%s's, mode %o, not the lease authority's own) aside to %s",
                                where, owner_name(st.st_uid), stat.S_IMODE(st.st_mode), aside)


def same_file(fd: int, path: Path) -> bool:
    """Whether the open ``fd`` is the file at ``path`` now (not one renamed or replaced since)."""
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def try_lock(fd: int, shared: bool) -> bool:
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise


def abandoned(fd: int, dir_fd: int, names: tuple[str, ...], cleanup: bool) -> bool:
    """Whether nobody holds the lock on ``fd`` (its holder died without cleaning up); then, with
    ``cleanup``, ``names`` are removed from the directory ``dir_fd`` (in a sticky directory, only
    our own files can be)."""
    if not try_lock(fd, shared=True):
        return False
    if cleanup:
        for name in names:
            try:
                os.unlink(name, dir_fd=dir_fd)
            except OSError:
                pass
    return True


def read_live(dir_fd: int, name: str, max_bytes: int, cleanup: bool, remove: tuple[str, ...] | None = None,
              single_link: bool = True) -> tuple[os.stat_result, bytes] | None:
    """Read the file ``name`` of a lock directory whose writer still holds its lock: its stat and at
    most ``max_bytes + 1`` bytes (more than ``max_bytes``: the caller's to refuse).  None when it is
    gone, a symlink, not a regular file, hard-linked elsewhere (with ``single_link``), or abandoned
    by a dead holder (then ``remove``, default the file itself, is removed with ``cleanup``)."""
    try:
        fd = os.open(name, FILE_FLAGS | os.O_RDONLY, dir_fd=dir_fd)
    except OSError:
        # gone meanwhile, or a symlink
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (single_link and st.st_nlink != 1):
            return None
        if abandoned(fd, dir_fd, (name,) if remove is None else remove, cleanup):
            return None
        return st, os.read(fd, max_bytes + 1)
    except OSError:
        return None
    finally:
        os.close(fd)


# -- who holds a lock ----------------------------------------------------------------------------------

def lock_key(st: os.stat_result) -> str:
    """How /proc/locks names a file: ``MAJOR:MINOR:INODE`` (hex device numbers)."""
    return f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"


_PROC_LOCKS_MAX = 4 << 20


def read_proc_locks() -> bytes | None:
    """/proc/locks, read to its end (None when it cannot be read).  The kernel returns a page of whole
    records at most per ``read``, and much less where the next record is large (a lock and every process
    waiting on it, one line each: anyone can make one), so only an empty read is the end, as a buffered
    read finds it.  (Each ``read`` takes the kernel's file-lock semaphore for writing and waits for an
    RCU grace period: 5-8 ms where other CPUs are busy.)"""
    try:
        with open("/proc/locks", "rb") as f:
            return f.read(_PROC_LOCKS_MAX)
    except OSError:
        return None


def flock_table() -> dict[str, list[tuple[int, bool]]] | None:
    """The flock locks held on this machine, from /proc/locks: key -> [(pid, exclusive)].  A pid is 0
    when the holder is outside our pid namespace.  None when /proc/locks cannot be read."""
    raw = read_proc_locks()
    if raw is None:
        return None
    table: dict[str, list[tuple[int, bool]]] = {}
    for line in raw.split(b"\n"):
        parts = line.split()
        if len(parts) < 6 or parts[1] != b"FLOCK":
            # POSIX/OFD locks, and "->" lines of blocked waiters
            continue
        try:
            pid = int(parts[4])
        except ValueError:
            continue
        table.setdefault(parts[5].decode("ascii", "replace"), []).append((pid, parts[3] == b"WRITE"))
    return table


def process_uid(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except (OSError, ValueError):
        return None


def process_start_boot(pid: int) -> float | None:
    """When process ``pid`` started, on the boot-time clock (``/proc/PID/stat``, set by the kernel)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read(4096)
        return int(raw[raw.rindex(b")") + 2:].split()[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def process_start(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch), from /proc: set by the kernel."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read(4096)
        with open("/proc/stat", "rb") as f:
            boot = next(int(line.split()[1]) for line in f.read(1 << 16).split(b"\n") if line.startswith(b"btime "))
        ticks = int(raw[raw.rindex(b")") + 2:].split()[19])
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def holder_name(pid: int) -> str:
    """``"pid 123 of alice (uid 1000)"``: a process holding a lock, as /proc/locks names it."""
    uid = process_uid(pid) if pid > 0 else None
    if uid is not None:
        return f"pid {pid} of {owner_name(uid)}"
    return f"pid {pid}" if pid > 0 else "a process outside this pid namespace"


def describe_holders(fd: int, table: dict[str, list[tuple[int, bool]]] | None = None) -> str:
    """``"pid 123 of alice (uid 1000)"`` for the holders of the flock on ``fd``, where known."""
    table = flock_table() if table is None else table
    if table is None:
        return "another process (/proc/locks cannot be read to say which)"
    holders = table.get(lock_key(os.fstat(fd)), [])
    if not holders:
        return "another process (not visible here)"
    return ", ".join(holder_name(pid) for pid, _ in holders[:3])


def lock_within(fd: int, *, shared: bool, deadline: float) -> None:
    """Take the flock on ``fd``, waiting until ``deadline`` (``time.monotonic()``) at most.

    The kernel offers no flock with a timeout, so this tries without blocking, with sleeps that grow
    from 0.5 ms to 5 ms (the selection mutex is normally held for about a millisecond).  Raises
    :class:`LockBusy` whose message names the holder (:func:`describe_holders`)."""
    if try_lock(fd, shared):
        return
    delay = 0.0005
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise LockBusy(describe_holders(fd))
        time.sleep(min(delay, left))
        delay = min(delay * 2, 0.005)
        if try_lock(fd, shared):
            return
