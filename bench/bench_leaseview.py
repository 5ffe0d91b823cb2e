"""Issue 24 benchmark: ``gpusd.select()`` in process with N leases held, this tree against a base tree.

    python bench/bench_leaseview.py [--base /tmp/lv-base] [--n 0,100,1000] [--calls 300] [--rounds 3]

Helper processes hold N leases in a temporary lock directory (each an exclusive lease, taken with
``LeaseStore.acquire``, on a device of its own that is not one of the 8 fake GPUs: real flocks on
real records, as ``gpusd run`` leaves them).  For each N, one process per tree (``PYTHONPATH`` =
this tree's ``src`` or the base's) times ``gpusd.select(count=1)`` (lease taken under the mutex and
released: the path of a job) and ``gpusd.select(count=1, lease=False)`` (the view only), p50 of
``--calls`` calls after a warm-up; the trees alternate, ``--rounds`` times, and the medians of the
rounds are printed side by side with the growth per lease against N = 0.  Make the base with
``git worktree add /tmp/lv-base 4cfe727``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import REPO, FakeEnv, make_gpus

HOLDER = r"""
import os, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (4096, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from gpusd.alloc.handle import Holder
from gpusd.alloc.leases import LeaseStore
store = LeaseStore()
first, count = int(sys.argv[1]), int(sys.argv[2])
who = Holder(command="bench holder")
held = [store.acquire([f"GPU-held-{i:05d}"], holder=who) for i in range(first, first + count)]
assert all(held)
print("ready", flush=True)
sys.stdin.read()  # hold until the bench closes our stdin
"""

TIMER = r"""
import json, os, resource, statistics, sys, time
import gpusd
calls = int(sys.argv[1])
def once(fn):
    for _ in range(20):
        fn()
    out = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)
lease = once(lambda: gpusd.select(count=1).release())
view = once(lambda: gpusd.select(count=1, lease=False))
print(json.dumps({"lease": lease, "view": view, "file": gpusd.__file__}))
"""


def hold(env: dict[str, str], n: int, per_process: int = 250) -> list[subprocess.Popen[str]]:
    procs = []
    for first in range(0, n, per_process):
        procs.append(subprocess.Popen([sys.executable, "-c", HOLDER, str(first), str(min(per_process, n - first))],
                                      env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready", "a holder failed"
    return procs


def release(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        assert p.stdin is not None
        p.stdin.close()
    for p in procs:
        p.wait(timeout=30)


def time_tree(src: Path, env: dict[str, str], calls: int) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", TIMER, str(calls)], env=dict(env, PYTHONPATH=str(src)),
                         capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise SystemExit(f"timer failed in {src}: {out.stderr[-2000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["file"].startswith(str(src)), got["file"]
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, default=Path("/tmp/lv-base"), help="a worktree of the base commit")
    ap.add_argument("--n", default="0,100,1000", help="lease counts, comma-separated")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 65536), hard))
    fake = FakeEnv(make_gpus(8, mig_mode=0))
    env = dict(fake.env, GPUSD_LEASE_SOCKET="off")
    trees = {"this tree": REPO / "src", "base": args.base / "src"}
    if not (args.base / "src" / "gpusd").is_dir():
        raise SystemExit(f"no base tree at {args.base}: git worktree add {args.base} 4cfe727")
    counts = [int(x) for x in args.n.split(",")]
    results: dict[tuple[str, int], list[dict[str, float]]] = {}
    print(f"fake NVML: 8 GPUs; lock dir {env['GPUSD_LOCK_DIR']}; {args.calls} calls per figure, "
          f"{args.rounds} rounds, trees alternating; load average {os.getloadavg()[0]:.1f}")
    for n in counts:
        procs = hold(dict(env, PYTHONPATH=str(REPO / "src")), n)
        try:
            for r in range(args.rounds):
                order = list(trees.items()) if r % 2 == 0 else list(trees.items())[::-1]
                for name, src in order:
                    results.setdefault((name, n), []).append(time_tree(src, env, args.calls))
        finally:
            release(procs)
    print(f"\n{'N leases held':>13s}  {'tree':10s} {'select() + release ms':>22s} {'select(lease=False) ms':>23s}"
          f" {'growth us/lease (lease, view)':>30s}")
    for name in trees:
        zero = {k: statistics.median(x[k] for x in results[(name, counts[0])]) for k in ("lease", "view")}
        for n in counts:
            med = {k: statistics.median(x[k] for x in results[(name, n)]) for k in ("lease", "view")}
            growth = (f"{(med['lease'] - zero['lease']) / n * 1e6:8.2f} {(med['view'] - zero['view']) / n * 1e6:8.2f}"
                      if n and counts[0] == 0 else "")
            print(f"{n:13d}  {name:10s} {med['lease'] * 1e3:22.3f} {med['view'] * 1e3:23.3f} {growth:>30s}")
    print(f"(load average at the end {os.getloadavg()[0]:.1f}; {time.strftime('%H:%M:%S')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
