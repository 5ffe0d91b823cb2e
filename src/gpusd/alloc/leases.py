"""GPU leases on one machine, held with ``flock`` so the kernel frees them when the holder dies.

The lock directory (``$GPUSD_LOCK_DIR``, default ``/tmp/gpusd-locks``) is shared by every user of the
machine.  gpusd creates it with mode ``1777`` (world-writable, sticky, like ``/tmp``): anyone may take a
lease, nobody may delete another user's files.  An administrator may create it beforehand, e.g.
``install -d -m 1777 /var/lib/gpusd/locks`` and ``GPUSD_LOCK_DIR=/var/lib/gpusd/locks`` in
``/etc/environment``.  It holds:

``select.lock``
    A mutex around "read leases, choose GPUs, take leases", so selection plus lease is atomic across
    processes.  Held for about a millisecond.
``gpu-<UUID>.lock`` (mode 0666, never deleted)
    One per GPU or MIG slice.  An exclusive lease holds ``LOCK_EX`` on it, a shared lease ``LOCK_SH``:
    the kernel itself refuses a second exclusive holder, whatever any process believes.
``lease-<ID>.json``
    What a lease is: pid, user, start time, command, the memory the job asked for, shared or not, the
    devices.  Its holder keeps ``LOCK_EX`` on it; a file that can be locked by someone else belongs to a
    dead holder and is ignored (and removed when permissions allow).
``queue-<SEQ>-<PID>.ticket``, ``queue.seq``
    The first-come-first-served wait queue (:mod:`gpusd.alloc.queue`).

Lock files are opened with ``O_CLOEXEC`` except where ``gpusd run`` passes them to its command on
purpose: the lease then lasts as long as the job's processes do, even if ``gpusd run`` itself is
killed with SIGKILL.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from ..errors import GpusdError
from ..model import HostSnapshot, LeaseInfo

DEFAULT_LOCK_DIR = "/tmp/gpusd-locks"
LEASE_FORMAT = 1


def lock_dir() -> Path:
    return Path(os.environ.get("GPUSD_LOCK_DIR") or DEFAULT_LOCK_DIR)


def _user() -> str | None:
    try:
        import pwd

        return pwd.getpwuid(os.geteuid()).pw_name
    except (KeyError, ImportError):
        return os.environ.get("USER")


def _open_shared_file(path: Path) -> int:
    """Open (creating with mode 0666) a lock file every user of the machine can lock."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except PermissionError:
        # Created by another user and not writable by us: flock works on a read-only descriptor.
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if os.fstat(fd).st_uid == os.geteuid():
            os.fchmod(fd, 0o666)  # the umask must not keep other users out
    except OSError:
        pass
    return fd


def _try_lock(fd: int, shared: bool) -> bool:
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise


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

    @property
    def info_fd(self) -> int:
        return self.fds[-1]

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        try:
            self.path.unlink()
        except OSError:
            pass
        for fd in self.fds[:-1]:
            try:
                # The lock file's mtime says when the GPU's last lease ended: the load before then
                # was this job's, no reason to avoid the GPU now (see LeaseStore.release_times).
                os.utime(fd)
            except OSError:
                pass
        for fd in self.fds:
            try:
                os.close(fd)  # closing drops the flock (unless a child still holds a copy)
            except OSError:
                pass
        self.fds = []

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
    def ensure(self) -> None:
        d = self.dir
        if d.is_dir():
            if not os.access(d, os.W_OK | os.X_OK):
                st = d.stat()
                raise GpusdError(
                    f"the lock directory {d} is not writable for you (mode {st.st_mode & 0o7777:o}, uid "
                    f"{st.st_uid}): its owner should `chmod 1777 {d}`, or set GPUSD_LOCK_DIR for every user")
            return
        try:
            d.mkdir(parents=True, exist_ok=True)
            os.chmod(d, 0o1777)
        except PermissionError:
            raise GpusdError(f"cannot create the lock directory {d}: permission denied (set GPUSD_LOCK_DIR)") from None
        except OSError as exc:
            raise GpusdError(f"cannot create the lock directory {d}: {exc.strerror}") from None

    @contextmanager
    def mutex(self) -> Iterator[None]:
        """The machine-wide selection mutex (blocking)."""
        self.ensure()
        fd = _open_shared_file(self.dir / "select.lock")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    # -- reading --------------------------------------------------------------------------------
    def leases(self, cleanup: bool = False) -> list[LeaseInfo]:
        """Live leases, one :class:`LeaseInfo` per leased device.  A lease file whose holder died
        is skipped (and removed when ``cleanup`` and permissions allow)."""
        out: list[LeaseInfo] = []
        try:
            names = os.listdir(self.dir)
        except OSError:
            return out
        for name in names:
            if not (name.startswith("lease-") and name.endswith(".json")):
                continue
            path = self.dir / name
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue  # released meanwhile
            try:
                if _try_lock(fd, shared=True):
                    # Nobody holds it: the holder died without cleaning up.
                    if cleanup:
                        try:
                            path.unlink()
                        except OSError:
                            pass
                    continue
                raw = os.read(fd, 65536)
            except OSError:
                continue
            finally:
                os.close(fd)
            out.extend(self._parse(name, raw))
        return out

    @staticmethod
    def _parse(name: str, raw: bytes) -> list[LeaseInfo]:
        import logging

        try:
            d = json.loads(raw)
            if not isinstance(d, dict) or not isinstance(d.get("devices"), list):
                raise ValueError("no device list")
            base = {k: d.get(k) for k in ("lease_id", "pid", "user", "started", "memory", "shared", "command")}
            return [LeaseInfo.from_dict({**base, "device": str(dev)}) for dev in d["devices"]]
        except (ValueError, TypeError) as exc:
            logging.getLogger(__name__).warning("skipping unreadable lease file %s: %s", name, exc)
            return []

    def release_times(self, within: float = 60.0) -> dict[str, float]:
        """Device UUID -> when its last gpusd lease ended (the lock file's mtime), for leases that
        ended in the last ``within`` seconds.  Selection ignores utilisation samples from before."""
        out: dict[str, float] = {}
        horizon = time.time() - within
        try:
            entries = os.scandir(self.dir)
        except OSError:
            return out
        with entries:
            for entry in entries:
                name = entry.name
                if name.startswith("gpu-") and name.endswith(".lock"):
                    try:
                        mtime = entry.stat().st_mtime
                    except OSError:
                        continue
                    if mtime >= horizon:
                        out[name[4:-5]] = mtime
        return out

    def attach(self, snap: HostSnapshot) -> HostSnapshot:
        """Add the live leases to the GPUs of ``snap`` (a MIG slice's lease to its parent GPU)."""
        leases = self.leases()
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
                command: str | None = None, pid: int | None = None) -> Lease | None:
        """Lock ``devices`` (all or nothing, without blocking) and record the lease.  Returns None
        when one of them is held in a conflicting mode.  Call under :meth:`mutex` for atomicity
        with the choice of devices."""
        self.ensure()
        fds: list[int] = []
        try:
            for dev in devices:
                fd = _open_shared_file(self.dir / f"gpu-{_safe(dev)}.lock")
                fds.append(fd)
                if not _try_lock(fd, shared):
                    for f in fds:
                        os.close(f)
                    return None
            lease_id = os.urandom(6).hex()
            record = {
                "format": LEASE_FORMAT,
                "lease_id": lease_id,
                "pid": pid or os.getpid(),
                "user": _user(),
                "started": time.time(),
                "memory": memory,
                "shared": shared,
                "command": command,
                "devices": list(devices),
            }
            final = self.dir / f"lease-{lease_id}.json"
            tmp = self.dir / f".lease-{lease_id}.tmp"
            info_fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            fds.append(info_fd)
            fcntl.flock(info_fd, fcntl.LOCK_EX)  # locked before it is visible: never seen as stale
            os.write(info_fd, json.dumps(record).encode())
            os.rename(tmp, final)
        except BaseException:
            for f in fds:
                try:
                    os.close(f)
                except OSError:
                    pass
            raise
        return Lease(lease_id, list(devices), shared, memory, final, fds)


def _safe(device: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in device)
