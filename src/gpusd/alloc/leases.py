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

from __future__ import annotations

import fcntl
import json
import math
import os
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import GpusdError, LockBusy, WaitTimeout
from ..model import HostSnapshot, LeaseInfo
from .lockdir import (
    create_exclusive,
    flock_table,
    lock_key,
    lock_within,
    open_dir,
    open_lock_file,
    process_uid,
    read_live,
    try_lock,
    user_name,
)

TYPE_CHECKING = False  # typing is not imported at run time: start-up time (issue 24)
if TYPE_CHECKING:  # pragma: no cover
    from typing import Any, Iterator


class _Log:
    """``logging`` imported on first use: most commands never log here (start-up time matters)."""

    def __getattr__(self, name: str) -> Any:
        import logging

        return getattr(logging.getLogger(__name__), name)


log = _Log()

DEFAULT_LOCK_DIR = "/tmp/gpusd-locks"
LEASE_FORMAT = 1
MUTEX_TIMEOUT = 10.0  # seconds: the documented bound on a wait for the selection mutex
MAX_LEASE_BYTES = 16384  # a lease record is a few hundred bytes; larger files are skipped
MAX_LEASE_DEVICES = 64
MAX_LEASE_FILES = 4096
_LEASE_NAME = re.compile(r"^lease-([A-Za-z0-9_-]{1,64})\.json$")
_JOB_ID = re.compile(r"^[a-f0-9]{8,32}$")  # a gpusd job's id (gpusd.jobs.record)


def lock_dir() -> Path:
    return Path(os.environ.get("GPUSD_LOCK_DIR") or DEFAULT_LOCK_DIR)


def mutex_timeout() -> float:
    """The bound on a wait for the selection mutex: ``$GPUSD_MUTEX_TIMEOUT`` seconds, default 10."""
    try:
        value = float(os.environ.get("GPUSD_MUTEX_TIMEOUT") or MUTEX_TIMEOUT)
    except ValueError:
        return MUTEX_TIMEOUT
    return value if math.isfinite(value) and value > 0 else MUTEX_TIMEOUT


def current_user() -> str | None:
    return user_name(os.geteuid())


@dataclass
class Lease:
    """Leases on one or more devices, taken together.  Release with :meth:`release` (or exit)."""

    lease_id: str
    devices: list[str]
    shared: bool
    memory: int | None
    path: Path
    fds: list[int] = field(default_factory=list)  # device locks + the lease file's lock
    released: bool = False
    dir_fd: int = -1  # the lock directory, to remove the record without following any path again
    record: dict[str, Any] | None = None  # what the record says (for LeaseStore.rewrite)

    @property
    def info_fd(self) -> int:
        return self.fds[-1]

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        for fd in self.fds[:-1]:
            try:
                # The lock file's mtime says when the GPU's last lease ended: the load before then
                # was this job's, no reason to avoid the GPU now (see LeaseStore.release_times).
                os.utime(fd)
            except OSError:
                pass
        # Devices first: their close is what waiters are woken by (queue.LeaseWatch), and a record
        # whose devices are free no longer counts anyway.
        for fd in self.fds[:-1]:
            try:
                os.close(fd)  # closing drops the flock (unless a child still holds a copy)
            except OSError:
                pass
        try:
            if self.dir_fd >= 0:
                os.unlink(self.path.name, dir_fd=self.dir_fd)
        except OSError:
            pass
        for fd in (*self.fds[-1:], self.dir_fd):
            try:
                if fd >= 0:
                    os.close(fd)
            except OSError:
                pass
        self.fds = []
        self.dir_fd = -1

    def forget(self) -> None:
        """Close this process's descriptors without ending the lease: for when they were handed to
        another process (the daemon passing its leases to its clients as it stops), whose copies keep
        the locks held and the record valid."""
        for fd in (*self.fds, self.dir_fd):
            try:
                if fd >= 0:
                    os.close(fd)
            except OSError:
                pass
        self.fds, self.dir_fd, self.released = [], -1, True

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:  # a dropped Selection must not leak locks
        try:
            self.release()
        except Exception:
            pass


class LeaseStore:
    """The lock directory of this machine."""

    def __init__(self, directory: Path | str | None = None) -> None:
        self.dir = Path(directory) if directory is not None else lock_dir()

    # -- setup ----------------------------------------------------------------------------------
    def open(self, create: bool = True) -> int | None:
        """A descriptor of the (checked) lock directory; the caller closes it.  None when it does
        not exist and ``create`` is False."""
        return open_dir(self.dir, create)

    def _writable(self) -> int:
        fd = open_dir(self.dir, True)
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
            fd = open_lock_file(dfd, "select.lock", self.dir)
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

    # -- reading --------------------------------------------------------------------------------
    def leases(self, cleanup: bool = False) -> list[LeaseInfo]:
        """Live leases, one :class:`LeaseInfo` per leased device.  A lease file whose holder died
        is skipped (and removed when ``cleanup`` and permissions allow); so is a record the kernel
        does not confirm (see the module docstring)."""
        dfd = self.open(create=False)
        if dfd is None:
            return []
        try:
            return self._leases(dfd, cleanup)
        finally:
            os.close(dfd)

    def _leases(self, dfd: int, cleanup: bool) -> list[LeaseInfo]:
        out: list[LeaseInfo] = []
        try:
            names = os.listdir(dfd)
        except OSError:
            return out
        table: dict[str, list[tuple[int, bool]]] | None = None
        table_read = False
        seen = 0
        for name in names:
            m = _LEASE_NAME.match(name)
            if not m:
                continue
            seen += 1
            if seen > MAX_LEASE_FILES:  # one per lease: more is someone filling the directory
                log.warning("more than %d lease files in %s: the rest are ignored", MAX_LEASE_FILES, self.dir)
                break
            got = read_live(dfd, name, MAX_LEASE_BYTES, cleanup, single_link=False)  # released meanwhile: None
            if got is None:
                continue
            st, raw = got
            if len(raw) > MAX_LEASE_BYTES:
                log.warning("skipping lease file %s of %s: %d bytes (at most %d)", name, user_name(st.st_uid),
                            st.st_size, MAX_LEASE_BYTES)
                continue
            record = self._parse(name, raw)
            if record is None:
                continue
            if not table_read:
                table, table_read = flock_table(), True
            out.extend(self._believe(dfd, name, m.group(1), st, record, table))
        return out

    @staticmethod
    def _parse(name: str, raw: bytes) -> dict[str, Any] | None:
        """The fields of a lease record, typed and bounded; None (logged) when it is not one."""
        try:
            d = json.loads(raw)
            if not isinstance(d, dict):
                raise ValueError("not an object")
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
            remote_from, expires = d.get("remote_from"), d.get("expires")  # a daemon's remote lease
            if expires is not None and (type(expires) not in (int, float) or not math.isfinite(expires)):
                raise ValueError("bad expiry time")
            return {
                "pid": pid, "memory": memory, "started": started, "shared": d.get("shared") is True,
                "devices": devices, "user": user[:64] if isinstance(user, str) else None,
                "command": command[:1024] if isinstance(command, str) else None,
                "remote_from": remote_from[:128] if isinstance(remote_from, str) else None,
                "expires": float(expires) if expires is not None else None,
                "job": job if isinstance(job := d.get("job"), str) and _JOB_ID.match(job) else None,
            }
        except (ValueError, TypeError, RecursionError) as exc:
            log.warning("skipping unreadable lease file %s: %s", name, exc)
            return None

    def _believe(self, dfd: int, name: str, lease_id: str, st: os.stat_result, rec: dict[str, Any],
                 table: dict[str, list[tuple[int, bool]]] | None) -> list[LeaseInfo]:
        """The part of a live record the kernel confirms, attributed to the file's owner."""
        holders = [pid for pid, _ in table.get(lock_key(st), [])] if table is not None else []
        if holders:  # /proc/locks sees this file system: check every device claimed
            for dev in rec["devices"]:
                try:
                    dst = os.stat(f"gpu-{_safe(dev)}.lock", dir_fd=dfd, follow_symlinks=False)
                except OSError:
                    dst = None
                locks = table.get(lock_key(dst), []) if (table is not None and dst is not None) else []
                if not any(pid in holders and excl != rec["shared"] for pid, excl in locks):
                    log.debug("ignoring lease file %s of %s: it claims %s, which its holder does not hold",
                                name, user_name(st.st_uid), _safe(dev)[:64])
                    return []
        pid, user = rec["pid"], rec["user"]
        if st.st_uid != 0:  # only root (the lease authority) may write a record for someone else
            user = user_name(st.st_uid)
            if process_uid(pid) != st.st_uid:
                pid = holders[0] if holders and holders[0] > 0 else 0
        base = {"lease_id": lease_id, "pid": pid, "user": user, "started": rec["started"],
                "memory": rec["memory"], "shared": rec["shared"], "command": rec["command"],
                "remote_from": rec["remote_from"], "expires": rec["expires"], "job": rec.get("job")}
        return [LeaseInfo.from_dict({**base, "device": dev}) for dev in rec["devices"]]

    def release_times(self, within: float = 60.0) -> dict[str, float]:
        """Device UUID -> when its last gpusd lease ended (the lock file's mtime), for leases that
        ended in the last ``within`` seconds.  Selection ignores utilisation samples from before."""
        out: dict[str, float] = {}
        horizon = time.time() - within
        try:
            dfd = self.open(create=False)
        except GpusdError:
            return out
        if dfd is None:
            return out
        try:
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
        return out

    def attach(self, snap: HostSnapshot) -> HostSnapshot:
        """Add the live leases to the GPUs of ``snap`` (a MIG slice's lease to its parent GPU)."""
        try:
            leases = self.leases()
        except GpusdError as exc:  # a refused lock directory: say so, but show the GPUs
            log.warning("%s", exc)
            return snap
        if not leases:
            return snap
        owner: dict[str, int] = {}
        for i, g in enumerate(snap.gpus):
            owner[g.uuid] = i
            for m in g.mig_instances:
                owner[m.uuid] = i
        for lease in leases:
            at = owner.get(lease.device or "")
            if at is not None:
                snap.gpus[at].leases.append(lease)
        return snap

    # -- taking ---------------------------------------------------------------------------------
    def acquire(self, devices: list[str], *, shared: bool = False, memory: int | None = None,
                command: str | None = None, pid: int | None = None, user: str | None = None,
                remote: dict[str, Any] | None = None) -> Lease | None:
        """Lock ``devices`` (all or nothing, without blocking) and record the lease.  Returns None
        when one of them is held in a conflicting mode.  Call under :meth:`mutex` for atomicity
        with the choice of devices.  ``pid`` and ``user`` name the job when it is not this process
        (the daemon taking a lease for a client); only root's records are believed to name others.
        ``remote``: ``remote_from`` and ``expires`` of a lease the daemon holds for a remote holder
        (docs/pool.md), and ``job``, the id of the gpusd job the lease is for, written into the record."""
        dfd = self._writable()
        fds: list[int] = []
        try:
            for dev in devices:
                fd = open_lock_file(dfd, f"gpu-{_safe(dev)}.lock", self.dir)
                fds.append(fd)
                if not try_lock(fd, shared):
                    for f in fds:
                        os.close(f)
                    os.close(dfd)
                    return None
            lease_id = os.urandom(6).hex()
            record = {
                "format": LEASE_FORMAT,
                "lease_id": lease_id,
                "pid": pid or os.getpid(),
                "user": user or current_user(),
                "started": time.time(),
                "memory": memory,
                "shared": shared,
                "command": command,
                "devices": list(devices),
                **{k: v for k, v in (remote or {}).items() if k in ("remote_from", "expires", "job")},
            }
            final = f"lease-{lease_id}.json"
            tmp = f".lease-{lease_id}.tmp"
            info_fd = create_exclusive(dfd, tmp, self.dir)
            fds.append(info_fd)
            fcntl.flock(info_fd, fcntl.LOCK_EX)  # locked before it is visible: never seen as stale
            os.write(info_fd, json.dumps(record).encode())
            os.rename(tmp, final, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            for f in (*fds, dfd):
                try:
                    os.close(f)
                except OSError:
                    pass
            raise
        return Lease(lease_id, list(devices), shared, memory, self.dir / final, fds, dir_fd=dfd, record=record)

    def rewrite(self, lease: Lease, **changes: Any) -> None:
        """Replace ``lease``'s record with one where ``changes`` apply (a remote lease's new expiry):
        a new file, locked before it is renamed over the old one, so no reader ever sees a lease
        without a locked record.  Call under :meth:`mutex` (a stale-record cleanup must not run
        between the rename and the old file's close).  GpusdError/OSError when it cannot."""
        if lease.released or lease.dir_fd < 0 or lease.record is None:
            raise GpusdError("the lease is no longer held")
        record = {**lease.record, **changes}
        tmp = f".lease-{lease.lease_id}.{os.urandom(3).hex()}.tmp"
        fd = create_exclusive(lease.dir_fd, tmp, self.dir)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(fd, json.dumps(record).encode())
            os.rename(tmp, lease.path.name, src_dir_fd=lease.dir_fd, dst_dir_fd=lease.dir_fd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=lease.dir_fd)
            except OSError:
                pass
            os.close(fd)
            raise
        old, lease.fds[-1] = lease.fds[-1], fd
        lease.record = record
        os.close(old)

    def join(self, lease: Lease, extra: Lease) -> None:
        """``extra``'s devices join ``lease`` (a job grown under its lease): one record names them
        all, ``extra``'s record goes.  The record is rewritten before anything else changes, and it
        never names a device its holder does not hold.  Call under :meth:`mutex`, like
        :meth:`rewrite`; on an error nothing has changed (the caller releases ``extra``)."""
        if extra.released or extra.shared != lease.shared:
            raise GpusdError("cannot join these leases")
        devices = [*lease.devices, *extra.devices]
        self.rewrite(lease, devices=devices)
        lease.fds = [*lease.fds[:-1], *extra.fds[:-1], lease.fds[-1]]
        lease.devices = devices
        extra.fds, extra.devices = extra.fds[-1:], []
        extra.release()  # only its record now

    def drop(self, lease: Lease, device: str) -> None:
        """Free one device of ``lease`` at once (a job shrunk): the record stops naming it first,
        then its lock is closed.  Call under :meth:`mutex`.  GpusdError when the lease does not
        hold it or it is the last one (a lease ends with its holder's release, not here)."""
        if device not in lease.devices or lease.released:
            raise GpusdError(f"the lease does not hold {device[:128]}")
        if len(lease.devices) == 1:
            raise GpusdError("a lease keeps at least one device")
        at = lease.devices.index(device)
        devices = [d for d in lease.devices if d != device]
        self.rewrite(lease, devices=devices)
        fd = lease.fds.pop(at)
        lease.devices = devices
        try:
            os.utime(fd)  # when the GPU's lease ended (LeaseStore.release_times)
        except OSError:
            pass
        os.close(fd)


def _safe(device: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in device)
