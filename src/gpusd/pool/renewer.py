"""The background renewer of ``gpusd reserve`` (docs/pool.md): ``python -m gpusd.pool.renewer``.

Reads one JSON object on stdin — ``{"secret": ..., "until": <epoch>, "leases": [<HostLease.to_dict()>]}``
(the fleet secret travels through the pipe, never argv or the environment) — then renews the leases
every ttl/3 seconds until ``until`` (then releases them), SIGTERM (releases them), a daemon
answering that a lease is gone, or no renewal getting through for longer than the TTL (the daemons
have expired the leases by then: a holder cut off from them, or whose daemons are gone, stops).
Started in its own session, detached from the terminal; says
``renewing`` on stdout once its signal handlers are set and the first renewal was sent.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time


def main() -> int:
    from ..wire.signing import FleetKey
    from .client import HostLease, Reservation

    try:
        d = json.loads(sys.stdin.read(1 << 20))
        key = FleetKey(str(d["secret"]))
        until = float(d["until"])
        res = Reservation([HostLease.from_dict(x) for x in d["leases"]], key)
        res.until = until  # the daemons show when the reservation ends, not only the TTL
    except (ValueError, KeyError, TypeError):
        return 2
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
