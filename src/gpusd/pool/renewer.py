"""The background renewer of ``gpusd reserve`` (docs/pool.md): ``python -m gpusd.pool.renewer``.

Reads one JSON object on stdin — ``{"secret": ..., "until": <epoch>, "leases": [<HostLease.to_dict()>]}``
(the fleet secret travels through the pipe, never argv or the environment) — then renews the leases
every ttl/3 seconds until ``until`` (then releases them), SIGTERM (releases them), a daemon
answering that a lease is gone, or no renewal getting through for longer than the TTL (the daemons
have expired the leases by then: a holder cut off from them, or whose daemons are gone, stops).
Started in its own session, detached from the terminal; says
``renewing`` on stdout once its signal handlers are set and the first renewal was sent.

Optional fields: ``"at_end": "expire"`` — at ``until`` stop renewing but do not release: the leases
end with their TTL, which is what the host-side guards of ``gpusd ray up`` (gpusd.engines.hold) watch,
so the engine is stopped on every host before its GPUs are free (a release would free them at once);
``"forget": [PATH, ...]`` — files that describe the reservation (a job record of ``gpusd hostfile``),
removed when the renewer ends, however it ends (but SIGKILL).  SIGUSR1 ends the renewer without
releasing (the leases end with their TTL: ``gpusd ray down`` when a host could not be reached, whose
guard then stops Ray there before its lease ends).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .client import Reservation


def main() -> int:
    from ..wire.signing import FleetKey
    from .client import HostLease, Reservation

    try:
        d = json.loads(sys.stdin.read(1 << 20))
        key = FleetKey(str(d["secret"]))
        until = float(d["until"])
        res = Reservation([HostLease.from_dict(x) for x in d["leases"]], key)
        expire = d.get("at_end") == "expire"
        forget = [str(x) for x in d.get("forget") or []]
    except (ValueError, KeyError, TypeError):
        return 2
    try:
        return _renew(res, until, expire)
    finally:
        for path in forget:
            try:
                os.unlink(path)  # never follows a link: removes the name only
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
    if (expire and not done.is_set()) or let_expire:  # --for is over, or SIGUSR1: they end with their TTL
        return 0
    res.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
