"""Issue 31's cost: the grant latency through the daemon (the lease authority), this tree against a base tree.

    sudo python bench/bench_grant.py [--base /tmp/grant-base/src] [--calls 300] [--rounds 3]

Since 0.4 the daemon passes the lease's lock descriptors with the grant (``SCM_RIGHTS``) and writes the
record through a second descriptor (its lock is held through a read-only one): this measures what that
costs a client.  For each tree (``PYTHONPATH`` = this tree's ``src`` or ``--base``), one process serves
the lease socket in-process (``LeaseServer``, 2 simulated GPUs, a lock directory and socket of its own
under /tmp) and times, from its main thread, a client's ``connect`` + ``lease_through`` (the request,
the grant, the descriptors received) of one GPU, then releases it: p50 and p90 of ``--calls`` grants
after 20 of warm-up.  The trees alternate, ``--rounds`` times; the medians of the rounds are printed.
As root (the authority's own directory, whose descriptors are passed, exists only for root).  Make the
base with ``mkdir /tmp/grant-base && git archive 4566c9a src | tar -x -C /tmp/grant-base``.  Nothing
leaves the machine: a Unix socket.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

WORKER = r"""
import asyncio, os, shutil, sys, tempfile, threading, time
calls = int(sys.argv[1])
d = tempfile.mkdtemp(prefix="gpusd-grant-", dir="/tmp")
os.environ.update(GPUSD_LOCK_DIR=f"{d}/locks", GPUSD_STATE_DIR=f"{d}/state", GPUSD_LEASE_SOCKET=f"{d}/run/lease.sock")
from gpusd.alloc.authority import connect, lease_through, socket_path
from gpusd.alloc.handle import Holder
from gpusd.alloc.select import Constraints
from gpusd.daemon.leasesock import LeaseServer
loop = asyncio.new_event_loop()
server = LeaseServer(socket_path(), "2xT4")
threading.Thread(target=loop.run_forever, daemon=True).start()
asyncio.run_coroutine_threadsafe(server.start(), loop).result(30)
times = []
try:
    for i in range(calls + 20):
        t0 = time.perf_counter()
        sock = connect()
        assert sock is not None
        _, lease = lease_through(sock, Constraints(count=1), wait=False, timeout=None, holder=Holder(command="bench"))
        t1 = time.perf_counter()
        lease.release()
        if i >= 20:
            times.append(t1 - t0)
        time.sleep(0.002)  # the daemon sees the release before the next request
finally:
    asyncio.run_coroutine_threadsafe(server.stop(), loop).result(30)
    shutil.rmtree(d, ignore_errors=True)
times.sort()
print(times[len(times) // 2] * 1e3, times[int(len(times) * 0.9)] * 1e3)
"""


def run(src: Path, calls: int) -> tuple[float, float]:
    env = dict(os.environ, PYTHONPATH=str(src))
    r = subprocess.run([sys.executable, "-c", WORKER, str(calls)], env=env, capture_output=True, text=True,
                       timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"the worker failed ({src}):\n{r.stderr[-3000:]}")
    p50, p90 = map(float, r.stdout.split())
    return p50, p90


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, help="the src/ directory of the code before (e.g. commit 4566c9a)")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: the lease authority's own directory is root's")
    trees = [("this tree", REPO / "src")] + ([("base", args.base)] if args.base else [])
    got: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in trees}
    for _ in range(args.rounds):
        for name, src in trees:
            got[name].append(run(src, args.calls))
    for name, rounds in got.items():
        p50 = statistics.median(r[0] for r in rounds)
        p90 = statistics.median(r[1] for r in rounds)
        each = ", ".join(f"{r[0]:.2f}" for r in rounds)
        print(f"{name:10s} grant p50 {p50:.2f} ms  p90 {p90:.2f} ms  (p50 per round: {each})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
