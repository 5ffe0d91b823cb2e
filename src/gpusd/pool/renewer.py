"""The background renewer of ``gpusd reserve`` (docs/pool.md): ``python -m gpusd.pool.renewer``.

Reads one JSON object on stdin — ``{"secret": ..., "until": <epoch>, "leases": [<HostLease.to_dict()>]}``
(the fleet secret travels through the pipe, never argv or the environment) — then renews the leases
every ttl/3 seconds until ``until`` (then releases them), SIGTERM (releases them), a daemon
answering that a lease is gone, or no renewal getting through for longer than the TTL (the daemons
have expired the leases by then: a holder cut off from them, or whose daemons are gone, stops).
Started in its own session, detached from the terminal; says
``renewing`` on stdout once its signal handlers are set and the first renewal was sent.

While it runs, each lease it holds is remembered where it was made (:func:`remember`): a record
``reservations/<lease id>.json`` in the user's state directory (mode 0600, in a 0700 directory of
the user's own: one that is a link, another user's or open to others is neither written nor read) with
the host's API address, node id and certificate pin as they were when the host granted the lease, so
``gpusd release ID`` finds a host that was reached with ``--peer`` or DNS-SD without those options
(docs/pool.md).  The record holds no secret and goes when the renewer ends.

Optional fields: ``"at_end": "expire"`` — at ``until`` stop renewing but do not release: the leases
end with their TTL, which is what the host-side guards of ``gpusd ray up`` (gpusd.engines.hold) watch,
so the engine is stopped on every host before its GPUs are free (a release would free them at once);
``"forget": [PATH, ...]`` — files that describe the reservation (a job record of ``gpusd hostfile``),
removed when the renewer ends, however it ends (but SIGKILL).  SIGUSR1 ends the renewer without
releasing (the leases end with their TTL: ``gpusd ray down`` when a host could not be reached, whose
guard then stops Ray there before its lease ends).
"""

# Imports inside functions: optional or heavy packages.
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..identity import state_dir
from ..ids import LeaseId
from .client import HostLease, Reservation

# under gpusd's state directory (gpusd.identity.state_dir)
RECORD_DIR = "reservations"
MAX_RECORD = 1 << 20


def _record_dir() -> Path:
    return state_dir() / RECORD_DIR


def _open_record_dir(create: bool) -> int | None:
    """A descriptor of the record directory, or None where it is not ours alone: a symbolic link, another
    user's, or writable by others (``$GPUSD_STATE_DIR`` in a shared place, made first by someone else)
    is neither written (it would tell them where our reservations are) nor read."""
    d = _record_dir()
    if create:
        try:
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError:
            return None
    try:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        os.close(fd)
        return None
    return fd


def remember(parts: list[dict[str, Any]], pid: int, until: float) -> None:
    """Record each lease (``HostLease.to_dict()``) of a reservation held by renewer ``pid``."""
    dfd = _open_record_dir(create=True)
    if dfd is None:
        # nowhere to remember it: gpusd release then looks for it on the fleet
        return
    try:
        for part in parts:
            lease_id = str(part.get("lease_id"))
            if not LeaseId.is_valid(lease_id):
                continue
            tmp = f".{lease_id}.{os.getpid()}.tmp"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dfd)
                with os.fdopen(fd, "w") as f:
                    json.dump({"lease": part, "renewer_pid": pid, "until": until}, f)
                os.replace(tmp, f"{lease_id}.json", src_dir_fd=dfd, dst_dir_fd=dfd)
            except OSError:
                try:
                    os.unlink(tmp, dir_fd=dfd)
                except OSError:
                    pass
                continue
    finally:
        os.close(dfd)


def recall(lease_id: str) -> dict[str, Any] | None:
    """The record of the lease ``lease_id`` (``{"lease": HostLease dict, "renewer_pid", "until"}``), or None."""
    if not LeaseId.is_valid(lease_id):
        return None
    dfd = _open_record_dir(create=False)
    if dfd is None:
        return None
    try:
        fd = os.open(f"{lease_id}.json", os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dfd)
        with os.fdopen(fd, "rb") as f:
            if os.fstat(f.fileno()).st_uid != os.geteuid():
                # not ours: never acted on
                return None
            d = json.loads(f.read(MAX_RECORD))
    except (OSError, ValueError):
        return None
    finally:
        os.close(dfd)
    if not isinstance(d, dict) or not isinstance(d.get("lease"), dict) or d["lease"].get("lease_id") != lease_id:
        return None
    return d


def forget(lease_id: str) -> None:
    if not LeaseId.is_valid(lease_id):
        return
    dfd = _open_record_dir(create=False)
    if dfd is None:
        return
    try:
        os.unlink(f"{lease_id}.json", dir_fd=dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)

if TYPE_CHECKING:
    from .client import Reservation


def main() -> int:
    from ..wire.signing import FleetKey

    try:
        d = json.loads(sys.stdin.read(1 << 20))
        key = FleetKey(str(d["secret"]))
        until = float(d["until"])
        res = Reservation([HostLease.from_dict(x) for x in d["leases"]], key)
        # the daemons show when the reservation ends, not only the TTL
        res.until = until
        expire = d.get("at_end") == "expire"
        forget_paths = [str(x) for x in d.get("forget") or []]
    except (ValueError, KeyError, TypeError):
        return 2
    remember([p.to_dict() for p in res.parts], os.getpid(), until)
    try:
        return _renew(res, until, expire)
    finally:
        for p in res.parts:
            forget(p.lease_id)
        for path in forget_paths:
            try:
                # never follows a link: removes the name only
                os.unlink(path)
            except OSError:
                pass


def _renew(res: "Reservation", until: float, expire: bool) -> int:
    done = threading.Event()
    let_expire: list[bool] = []

    def expire_now(_s: int, _f: object) -> None:
        let_expire.append(True)
        done.set()

    signal.signal(signal.SIGTERM, lambda _s, _f: done.set())
    signal.signal(signal.SIGUSR1, expire_now)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    period = max(0.5, min(p.ttl for p in res.parts) / 3)
    # no heartbeat got through for this long: expired
    give_up = max(p.ttl for p in res.parts) + period
    last_ok = time.monotonic()
    ready = True
    while True:
        # until, on the monotonic clock (Reservation.until)
        left = res.left()
        if left is not None and left <= 0:
            break
        try:
            res.renew()
            last_ok = time.monotonic()
        except Exception:  # noqa: BLE001 - a missed heartbeat is allowed; a lost lease ends us
            if res.lost.is_set() or time.monotonic() - last_ok > give_up:
                return 0
        # handlers installed, first renewal sent: gpusd reserve may return
        if ready:
            ready = False
            try:
                sys.stdout.write("renewing\n")
                sys.stdout.close()
            except OSError:
                pass
        left = res.left()
        if done.wait(period if left is None else min(period, left)):
            break
    # --for is over, or SIGUSR1: they end with their TTL
    if (expire and not done.is_set()) or let_expire:
        return 0
    res.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
