"""The remote leases written down, so that a restarted daemon takes them back (docs/pool.md).

One file per lease, ``STATE_DIR/remote-leases/<ID>.json`` (mode 0600 in a 0700 directory of the
daemon's own; a directory that is a link, another user's or open to others is neither written nor
read): the lease's terms, the boot it was granted in (``/proc/sys/kernel/random/boot_id``) and its
expiry on the boot-time clock (``CLOCK_BOOTTIME``, which a wall-clock step does not move and a
restarted process reads the same), rewritten at every renewal.  A damaged record costs that record:
it is logged and removed.  Standard library only (the keeper reads expiries too).
"""

from __future__ import annotations

import json
import logging
import math
import os
import stat
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

from ..ids import LeaseId
from ..sanitize import json_object

log = logging.getLogger("gpusd.pool")
T = TypeVar("T")

DIR_NAME = "remote-leases"
FORMAT = 1
MAX_RECORD = 65536
MAX_RECORDS = 4096


_boot_id: list[str | None] = []


def boot_id() -> str | None:
    """This boot's id (None where the kernel does not say); read once."""
    if not _boot_id:
        _boot_id.append(_read_boot_id())
    return _boot_id[0]


def _read_boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            raw = f.read(64).strip().decode("ascii", "replace")
    except OSError:
        return None
    return raw if raw and all(c in "0123456789abcdef-" for c in raw) else None


def boottime() -> float:
    """Seconds on the boot-time clock: monotonic, counts suspend, the same for every process of this boot."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def _name(lease_id: str) -> str:
    return f"{lease_id}.json"


def _open_dir(state_dir: Path, create: bool, dir_name: str = DIR_NAME) -> int | None:
    """A descriptor of the records' directory (``dir_name``: the bookings' too, daemon/bookings.py),
    ours and private; None when absent (and not ``create``) or unfit (logged)."""
    path = Path(state_dir) / dir_name
    if create:
        try:
            os.makedirs(state_dir, mode=0o700, exist_ok=True)
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            log.warning("cannot create %s: %s", path, exc.strerror)
            return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        os.close(fd)
        log.warning("not using %s for remote leases: uid %d, mode %o (it must be ours and private)", path,
                    st.st_uid, stat.S_IMODE(st.st_mode))
        return None
    return fd


def write(state_dir: Path, lease_id: str, data: dict[str, Any], dir_name: str = DIR_NAME) -> bool:
    """Write (replace) the record of ``lease_id``; False (logged) when it cannot."""
    dfd = _open_dir(state_dir, True, dir_name)
    if dfd is None:
        return False
    tmp = f".{_name(lease_id)}.{os.urandom(3).hex()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        try:
            os.write(fd, json.dumps({"format": FORMAT, **data}).encode())
        finally:
            os.close(fd)
        os.rename(tmp, _name(lease_id), src_dir_fd=dfd, dst_dir_fd=dfd)
        return True
    except OSError as exc:
        log.warning("cannot write the record of remote lease %s: %s", lease_id, exc.strerror or exc)
        try:
            os.unlink(tmp, dir_fd=dfd)
        except OSError:
            pass
        return False
    finally:
        os.close(dfd)


def remove(state_dir: Path, lease_id: str, dir_name: str = DIR_NAME) -> None:
    dfd = _open_dir(state_dir, False, dir_name)
    if dfd is None:
        return
    try:
        os.unlink(_name(lease_id), dir_fd=dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


def _read(dfd: int, name: str) -> dict[str, Any] | None:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        raw = os.read(fd, MAX_RECORD + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        return json_object(raw, MAX_RECORD)
    except ValueError:
        return None


def read_expiry(state_dir: Path, lease_id: str) -> float | None:
    """The boot-time expiry the record of ``lease_id`` says (None: no such readable record, or
    one of another boot)."""
    dfd = _open_dir(state_dir, False)
    if dfd is None:
        return None
    try:
        d = _read(dfd, _name(lease_id))
    finally:
        os.close(dfd)
    if d is None or d.get("boot_id") != boot_id():
        return None
    expires = d.get("expires_boot")
    if not isinstance(expires, (int, float)) or isinstance(expires, bool) or not math.isfinite(expires):
        return None
    return float(expires)


def _number(d: dict[str, Any], key: str, optional: bool = False) -> None:
    v = d.get(key)
    if v is None and optional:
        return
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise ValueError(f"bad {key!r}")


def _check(d: dict[str, Any], lease_id: str) -> None:
    """Raise ValueError unless ``d`` is a record this module wrote for ``lease_id``."""
    if d.get("format") != FORMAT or d.get("lease_id") != lease_id:
        raise ValueError("not a remote lease record of this version")
    for key in ("ttl", "started", "born_boot", "expires_boot"):
        _number(d, key)
    _number(d, "ends", optional=True)
    for key in ("holder", "identity", "boot_id", "store"):
        if not isinstance(d.get(key), str):
            raise ValueError(f"bad {key!r}")
    for key in ("note", "remote_from", "job", "claimed"):
        if d.get(key) is not None and not isinstance(d.get(key), str):
            raise ValueError(f"bad {key!r}")
    if not isinstance(d.get("devices"), list) or not all(isinstance(x, dict) for x in d["devices"]):
        raise ValueError("bad 'devices'")
    env = d.get("env")
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ValueError("bad 'env'")
    rec = d.get("record")
    if not isinstance(rec, dict) or not isinstance(rec.get("devices"), list) or not rec["devices"] or \
            not all(isinstance(x, str) for x in rec["devices"]):
        raise ValueError("bad 'record'")


def load(state_dir: Path) -> dict[str, dict[str, Any]]:
    """Every readable record, by lease id; a damaged one is logged and removed."""
    def check(name: str, d: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
        lease_id = name[:-5]
        if not LeaseId.is_valid(lease_id) or d is None:
            raise ValueError("unreadable")
        _check(d, lease_id)
        return lease_id, d

    return dict(load_records(state_dir, DIR_NAME, MAX_RECORDS, check, "the remote leases' records",
                             "record %s of a remote lease"))


def load_records(state_dir: Path, dir_name: str, most: int,
                 check: Callable[[str, dict[str, Any] | None], T], what: str, one: str) -> list[T]:
    """``check(name, record)`` of each of the first ``most`` records of ``dir_name`` in the state
    directory (the record None when unreadable); one that ``check`` refuses (ValueError) is logged
    (``one`` names it, with ``%s`` for its file name) and removed, as is a write cut short."""
    dfd = _open_dir(state_dir, False, dir_name)
    if dfd is None:
        return []
    out: list[T] = []
    try:
        for name in sorted(os.listdir(dfd))[:most]:
            if name.startswith(".") and name.endswith(".tmp"):  # a write cut short
                try:
                    os.unlink(name, dir_fd=dfd)
                except OSError:
                    pass
                continue
            if not name.endswith(".json"):
                continue
            try:
                out.append(check(name, _read(dfd, name)))
            except ValueError as exc:
                log.warning("dropping the damaged " + one + ": %s", name[:80], exc)
                try:
                    os.unlink(name, dir_fd=dfd)
                except OSError:
                    pass
    except OSError as exc:
        log.warning("cannot read %s: %s", what, exc.strerror or exc)
    finally:
        os.close(dfd)
    return out


class Adopted:
    """A remote lease taken back after a restart: what :class:`gpusd.daemon.pool.Held` keeps of a
    grant's Selection (the lease handle, its devices' UUIDs, the variables of its answer)."""

    def __init__(self, lease: Any, env: dict[str, str]) -> None:
        self.lease = lease
        self._env = dict(env)

    @property
    def uuids(self) -> list[str]:
        return list(self.lease.devices)

    def env(self) -> dict[str, str]:
        return dict(self._env)

    def release(self) -> None:
        self.lease.release()
