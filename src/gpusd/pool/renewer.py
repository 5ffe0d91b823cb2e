"""The background renewer of ``gpusd reserve`` (docs/pool.md): ``python -m gpusd.pool.renewer``.

Reads one JSON object on stdin — ``{"secret": ..., "until": <epoch>, "leases": [<HostLease.to_dict()>]}``
(the fleet secret travels through the pipe, never argv or the environment) — then renews the leases
every ttl/3 seconds until ``until`` (then releases them), SIGTERM (releases them), a daemon
answering that a lease is gone, or no renewal getting through for longer than the TTL (the daemons
have expired the leases by then: a holder cut off from them, or whose daemons are gone, stops).
Started in its own session, detached from the terminal; says
``renewing`` on stdout once its signal handlers are set and the first renewal was sent.

While it runs, each lease it holds is remembered where it was made (:func:`remember`): a record
``reservations/<lease id>.json`` in the user's state directory (mode 0600, in a 0700 directory) with
the host's API address, node id and certificate pin as they were when the host granted the lease, so
``gpusd release ID`` finds a host that was reached with ``--peer`` or DNS-SD without those options
(docs/pool.md).  The record holds no secret and goes when the renewer ends.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

RECORD_DIR = "reservations"  # under gpusd's state directory (gpusd.identity.state_dir)
_LEASE_ID = re.compile(r"^[0-9a-f]{8,32}$")  # as gpusd.pool.client.LEASE_ID
MAX_RECORD = 1 << 20


def _record_dir() -> Path:
    from ..identity import state_dir

    return state_dir() / RECORD_DIR


def remember(parts: list[dict[str, Any]], pid: int, until: float) -> None:
    """Record each lease (``HostLease.to_dict()``) of a reservation held by renewer ``pid``."""
    d = _record_dir()
    try:
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError:
        return  # nowhere to remember it: gpusd release then looks for it on the fleet
    for part in parts:
        lease_id = str(part.get("lease_id"))
        if not _LEASE_ID.match(lease_id):
            continue
        tmp = d / f".{lease_id}.{os.getpid()}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({"lease": part, "renewer_pid": pid, "until": until}, f)
            os.replace(tmp, d / f"{lease_id}.json")
        except OSError:
            continue


def recall(lease_id: str) -> dict[str, Any] | None:
    """The record of the lease ``lease_id`` (``{"lease": HostLease dict, "renewer_pid", "until"}``), or None."""
    if not _LEASE_ID.match(lease_id):
        return None
    try:
        fd = os.open(_record_dir() / f"{lease_id}.json", os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            if os.fstat(f.fileno()).st_uid != os.geteuid():
                return None  # not ours: never acted on
            d = json.loads(f.read(MAX_RECORD))
    except (OSError, ValueError):
        return None
    if not isinstance(d, dict) or not isinstance(d.get("lease"), dict) or d["lease"].get("lease_id") != lease_id:
        return None
    return d


def forget(lease_id: str) -> None:
    if _LEASE_ID.match(lease_id):
        try:
            (_record_dir() / f"{lease_id}.json").unlink()
        except OSError:
            pass


def main() -> int:
    from ..wire.signing import FleetKey
    from .client import HostLease, Reservation

    try:
        d = json.loads(sys.stdin.read(1 << 20))
        key = FleetKey(str(d["secret"]))
        until = float(d["until"])
        res = Reservation([HostLease.from_dict(x) for x in d["leases"]], key)
    except (ValueError, KeyError, TypeError):
        return 2
    remember([p.to_dict() for p in res.parts], os.getpid(), until)
    try:
        return _renew(res, until)
    finally:
        for p in res.parts:
            forget(p.lease_id)


def _renew(res: Any, until: float) -> int:
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda _s, _f: done.set())
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    period = max(0.5, min(p.ttl for p in res.parts) / 3)
    give_up = max(p.ttl for p in res.parts) + period  # no heartbeat got through for this long: expired
    last_ok = time.monotonic()
    ready = True
    while True:
        if time.time() >= until:
            break
        try:
            res.renew()
            last_ok = time.monotonic()
        except Exception:  # noqa: BLE001 - a missed heartbeat is allowed; a lost lease ends us
            if res.lost.is_set() or time.monotonic() - last_ok > give_up:
                return 0
        if ready:  # handlers installed, first renewal sent: gpusd reserve may return
            ready = False
            try:
                sys.stdout.write("renewing\n")
                sys.stdout.close()
            except OSError:
                pass
        if done.wait(min(period, max(0.0, until - time.time()))):
            break
    res.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
