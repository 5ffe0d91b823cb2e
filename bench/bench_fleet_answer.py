"""The fleet view's answer (``GET /api/v1/fleet``) in-process, at 32, 100 and 1,000 hosts of 8 GPUs: the CPU
of one answer after a second of a fleet's life (a fifth of the hosts parsed anew, as the daemon's deferred
parsing does beyond 100 hosts, and a heartbeat from every host), three ways in the same run:

* ``kept``: the daemon's (:meth:`gpusd.daemon.fleet.Fleet.answer`): each new snapshot encoded when it came
  (that cost printed apart: it is paid on arrival, not by the GET), the answer joining the bytes kept;
* ``by GET``: a fleet view told of no snapshot on arrival (no reader in the last ``WARM`` s, or before this
  change): its answer encodes the snapshots new since the last one, each once;
* ``afresh``: the same document encoded afresh, every snapshot and head (``FleetView.to_json()``);
* ``floor``: joining bytes already made (one ``b"".join`` of every host's part): what no cache beats.

    python bench/bench_fleet_answer.py [--sizes 32,100,1000] [--rounds 5] [--redact]

CPU time (``time.process_time``), min and median of ``--rounds`` answers; the load average beside.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))


class Client:
    """What the fleet view reads of its discovery client."""

    dropped_hosts = 0

    def __init__(self, followed: list[Any]) -> None:
        self.followed = followed

    def host_list(self, catch_up: Any = True) -> list[Any]:
        return sorted(self.followed, key=_by_name)


def _by_name(host: Any) -> tuple[str, str]:
    return host.hostname, host.node_id


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="32,100,1000")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--redact", action="store_true", help="the redacted answer (a reader without the fleet secret)")
    args = ap.parse_args()

    from gpusd.daemon.config import DaemonConfig
    from gpusd.daemon.fleet import Fleet
    from gpusd.discovery.types import RemoteHost
    from gpusd.inventory.simulated import SimulatedBackend
    from gpusd.model import HostSnapshot
    from gpusd.wire.fleet import FleetView
    from gpusd.wire.txt import TxtRecord

    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; CPU ms of one answer, min / median of "
          f"{args.rounds}; {'redacted' if args.redact else 'with private fields'}")
    print(f"{'hosts':>5s} {'MB':>6s} {'kept':>13s} {'by GET':>13s} {'afresh':>13s} {'floor':>13s} "
          f"{'on arrival, per snapshot':>25s}")
    for n in [int(x) for x in args.sizes.split(",") if x.strip()]:
        hosts: list[RemoteHost] = []
        texts: list[str] = []
        for i in range(n):
            snap = SimulatedBackend("8xH100", host=f"fake-{i:04d}", node=f"{i:016x}").snapshot()
            texts.append(snap.to_json())
            txt = TxtRecord(node_id=snap.node_id, hostname=snap.hostname, session="s", count=8, simulated=True)
            h = RemoteHost(key=f"fake-{i:04d}._gpusd._tcp.local.", txt=txt, url=f"http://198.18.{i // 250}.{i % 250}"
                           ":4780/api/v1", snapshot=snap, alive=True, verified=True)
            h.heard()
            hosts.append(h)

        fleet = Fleet(DaemonConfig(session="s", interfaces=["127.0.0.1"], fleet="on", peers=[]), None)
        fleet.client = Client(hosts)  # type: ignore[assignment]
        fleet.answer(redact=args.redact)
        lazy = Fleet(DaemonConfig(session="s", interfaces=["127.0.0.1"], fleet="on", peers=[]), None)
        lazy.client = Client(hosts)  # type: ignore[assignment]
        lazy.answer(redact=args.redact)
        kept, by_get, afresh, floor, arrival = [], [], [], [], []
        body = b""
        for r in range(args.rounds):
            new = range(r * n // 5 % n, r * n // 5 % n + max(1, n // 5))
            for j in new:  # a second of the fleet's life: a fifth parsed anew, a heartbeat from all
                h = hosts[j % n]
                h.snapshot = HostSnapshot.from_json(texts[j % n])
                t = time.process_time()
                fleet._snapshot_came(h)  # what the discovery client calls on each new snapshot
                arrival.append(time.process_time() - t)
            for h in hosts:
                h.heard()
            t = time.process_time()
            body = fleet.answer(redact=args.redact)
            kept.append(time.process_time() - t)
            t = time.process_time()
            lazy.answer(redact=args.redact)
            by_get.append(time.process_time() - t)
            view = FleetView(session="s", hosts=[h.record() for h in Client(hosts).host_list()])
            t = time.process_time()
            fresh = view.to_json()
            afresh.append(time.process_time() - t)
            parts = [fresh[i:i + 10_000] for i in range(0, len(fresh), 10_000)]
            t = time.process_time()
            b"".join(parts)
            floor.append(time.process_time() - t)

        def cell(xs: list[float]) -> str:
            return f"{min(xs) * 1e3:5.1f} / {statistics.median(xs) * 1e3:5.1f}"

        print(f"{n:5d} {len(body) / 1e6:6.2f} {cell(kept):>13s} {cell(by_get):>13s} {cell(afresh):>13s} "
              f"{cell(floor):>13s} "
              f"{statistics.median(arrival) * 1e3:22.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
