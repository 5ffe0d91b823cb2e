"""Issue 22 benchmark: placement under a contention model, in simulated time (no GPU, no sleeping).

    python bench/bench_placement.py [--seeds 5] [--jobs 60] [--gap 240] [--mix mixed|handover|all]

The model (``gpusd.inventory.contention``, docs/simulation.md "Contention"): jobs sharing a GPU
time-slice it (rate ``1 / (1 + others' utilisation / 100)``), a job whose memory does not fit when it
allocates (20 s after its start) fails like an OOM, and a 2-GPU job all-reduces at 208 GB/s over NVLink,
20 GB/s over PCIe, 10 GB/s across sockets (nccl-tests #178; the last an assumption).

``mixed``: on an 8-GPU box with NVLink pairs (0,1) (2,3) (4,5) (6,7) and on a PCIe-only one (pairs
under one switch, two NUMA nodes), 80 GiB per GPU, GPUs 2 and 5 busy with another user's process (90 %,
30 GiB), ``--jobs`` jobs arriving as a Poisson process (mean gap ``--gap`` s): 50 % single-GPU training
(300-1800 s, 70-100 %, 8-40 GiB), 30 % 2-GPU data-parallel (600-2400 s compute, 90 %, 20-40 GiB per GPU,
all-reduce traffic worth 10 % of the compute at NVLink speed), 20 % memory-heavy single-GPU (300-1200 s,
60 %, 50-70 GiB).  Placed by gpusd (``gpusd run --wait --memory M``: ``choose()`` itself, on a
snapshot of the simulated state, with ``--topology auto`` and ``--topology any``), round-robin, random,
first-fit (the lowest-index GPUs whose free memory fits), nvitop's ``select_devices`` order
(``--min-free-memory M``: most free memory first), and a lower bound (every job alone on its best
GPUs from its arrival, and all work spread evenly at full speed).  gpusd's jobs hold exclusive leases
and queue (first come, first served); the others share GPUs and start at once where they may.

``handover``: bench_alloc.py's makespan mix (40 jobs of 0.3-1.5 s, 4-24 GiB, 90 %, all submitted at
once; GPUs 2 and 5 at 95 % with 40 GiB) with gpusd's ``--max-util 50`` and round-robin lanes, here with
no process start-up and no sampling lag: the placement's makespan without the hand-over costs.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from gpusd.alloc.select import Constraints, choose  # noqa: E402
from gpusd.errors import NoGpuAvailable  # noqa: E402
from gpusd.inventory.contention import NVLINK_BW, Box, Gpu, Job, State, lower_bound, run  # noqa: E402
from gpusd.inventory.simulated import default_topology  # noqa: E402
from gpusd.model import GpuInfo, HostSnapshot, LeaseInfo, ProcessInfo  # noqa: E402
from gpusd.topology import link_between, rank  # noqa: E402

GiB = 2**30
N = 8
BUSY = (2, 5)


def make_box(kind: str, busy_util: float = 90.0, busy_memory: int = 30 * GiB) -> tuple[Box, list[GpuInfo]]:
    topo = default_topology(["H100-80GB"] * N, "pairs" if kind == "nvlink-pairs" else "pcie")
    infos = [GpuInfo(i, f"GPU-sim-{i}", name="NVIDIA H100 PCIe", memory_total=80 * GiB, links=topo.links(i))
             for i in range(N)]
    gpus = [Gpu(i, 80 * GiB, busy_util if i in BUSY else 0.0, busy_memory if i in BUSY else 0) for i in range(N)]

    def worst(idx: Sequence[int]) -> int:
        return max((rank(link_between(infos[a], infos[b])) for a in idx for b in idx if a < b), default=0)

    best = min(worst([a, b]) for a in range(N) for b in range(a + 1, N))
    return Box(gpus, worst, best), infos


# -- policies ---------------------------------------------------------------------------------------
def gpusd(infos: list[GpuInfo], topology: str, max_util: float | None = None,
          share: bool = False) -> Callable[[State, Job], Any]:
    """gpusd run --wait --memory M [--max-util U] [--share] --topology T: alloc.select.choose on the state."""
    def place(state: State, job: Job) -> list[int] | None:
        gpus, leases = [], []
        for i, info in enumerate(infos):
            procs = [ProcessInfo(pid=10_000_000 + k, used_memory=j.memory if j.allocated else 0)
                     for k, j in enumerate(state.running) if i in j.placed]
            if state.box.gpus[i].background_util:
                procs.append(ProcessInfo(pid=9_000_000 + i, used_memory=state.box.gpus[i].background_memory))
            used = state.memory_used(i)
            gpus.append(GpuInfo(i, info.uuid, name=info.name, memory_total=info.memory_total, memory_used=used,
                                memory_free=info.memory_total - used if info.memory_total else None,
                                utilization_gpu=state.util(i), processes=procs, links=info.links))
        for k, j in enumerate(state.running):  # every running job is a gpusd job holding its lease
            leases += [LeaseInfo(f"l{k}-{i}", 10_000_000 + k, memory=j.memory, device=infos[i].uuid, shared=share)
                       for i in j.placed]
        snap = HostSnapshot("sim", "sim", state.time, gpus=gpus, backend="simulated")
        c = Constraints.build(count=job.gpus, memory=job.memory, max_util=max_util, topology=topology, shared=share)
        try:
            return [x.gpu.index for x in choose(snap, c, leases=leases, env={})]
        except NoGpuAvailable:
            return None
    return place


def round_robin() -> Callable[[State, Job], Any]:
    nxt = [0]

    def place(state: State, job: Job) -> list[int]:
        out = [(nxt[0] + k) % N for k in range(job.gpus)]
        nxt[0] = (nxt[0] + job.gpus) % N
        return out
    return place


def rr_lanes() -> Callable[[State, Job], Any]:
    """bench_alloc.py's static round-robin: job i waits for GPU i mod 8 to finish its previous job."""
    lane: dict[str, int] = {}

    def place(state: State, job: Job) -> list[int] | None:
        g = lane.setdefault(job.name, len(lane) % N)
        return None if state.jobs_on(g) else [g]
    return place


def randomly(seed: int) -> Callable[[State, Job], Any]:
    rng = random.Random(seed)
    return lambda state, job: rng.sample(range(N), job.gpus)


def _free(state: State, i: int) -> int:
    return state.box.gpus[i].memory_total - state.memory_used(i)


def first_fit() -> Callable[[State, Job], Any]:
    def place(state: State, job: Job) -> list[int] | None:
        fits = [i for i in range(N) if _free(state, i) >= job.memory][: job.gpus]
        return fits if len(fits) == job.gpus else None
    return place


def nvitop_order() -> Callable[[State, Job], Any]:
    """nvitop.select_devices(min_count=k, max_count=k, min_free_memory=M) order: most free memory,
    then most memory used, then least utilisation, then the highest index (nvitop/select.py)."""
    def place(state: State, job: Job) -> list[int] | None:
        ok = [i for i in range(N) if _free(state, i) >= job.memory]
        ok.sort(key=lambda i: (-_free(state, i), -state.memory_used(i), state.util(i), -i))
        return ok[: job.gpus] if len(ok) >= job.gpus else None
    return place


# -- job mixes ----------------------------------------------------------------------------------------
def mixed(seed: int, n: int, gap: float) -> list[Job]:
    rng = random.Random(seed)
    t, jobs = 0.0, []
    for i in range(n):
        t += rng.expovariate(1 / gap)
        kind = rng.random()
        if kind < 0.5:
            jobs.append(Job(f"t{i:03d}", t, 1, rng.uniform(300, 1800), rng.uniform(70, 100), rng.randint(8, 40) * GiB))
        elif kind < 0.8:
            work = rng.uniform(600, 2400)
            jobs.append(Job(f"d{i:03d}", t, 2, work, 90.0, rng.randint(20, 40) * GiB, 0.10 * work * NVLINK_BW))
        else:
            jobs.append(Job(f"m{i:03d}", t, 1, rng.uniform(300, 1200), 60.0, rng.randint(50, 70) * GiB))
    return jobs


def handover_mix() -> list[Job]:
    rng = random.Random(7)  # bench_alloc.py's makespan mix, same seed, same draws
    specs = [(f"j{i:02d}", round(rng.uniform(0.3, 1.5), 2), rng.choice([4, 8, 16, 24]) * GiB) for i in range(40)]
    return [Job(name, 0.0, 1, dur, 90.0, mem) for name, dur, mem in specs]


def _change(value: float, base: float) -> str:
    pct = 100 * (value - base) / base
    return f"{abs(pct):.0f} % {'shorter' if pct < 0 else 'longer'}"


# -- the runs ------------------------------------------------------------------------------------------
def run_mixed(seeds: int, n: int, gap: float) -> None:
    print(f"Mixed: {n} jobs (50% 1-GPU training, 30% 2-GPU all-reduce, 20% memory-heavy), Poisson arrivals "
          f"every {gap:g} s on average; 8 x 80 GiB, GPUs {list(BUSY)} busy (90 %, 30 GiB); seeds 1-{seeds}")
    for kind in ("nvlink-pairs", "pcie-only"):
        rows: dict[str, list[tuple[float, float, int, int, int]]] = {}
        bounds = []
        for seed in range(1, seeds + 1):
            box, infos = make_box(kind)
            jobs = mixed(seed, n, gap)
            bounds.append(lower_bound(box, jobs))
            policies: list[tuple[str, Callable[[State, Job], Any], bool]] = [
                ("gpusd --topology auto", gpusd(infos, "auto"), True),
                ("gpusd --topology any", gpusd(infos, "any"), True),
                ("gpusd --max-util 50", gpusd(infos, "auto", max_util=50), True),
                ("gpusd --share", gpusd(infos, "auto", share=True), True),
                ("round-robin", round_robin(), True),
                ("random", randomly(seed), True),
                ("first-fit", first_fit(), True),
                ("nvitop select_devices", nvitop_order(), True),
            ]
            for name, policy, fifo in policies:
                r = run(box, jobs, policy, fifo=fifo)
                split = sum(1 for j in r.jobs if j.gpus == 2 and not j.oom and j.placed
                            and box.worst_rank(j.placed) > box.best_rank)
                assert r.completed + r.given_up == n, (name, r.completed, r.given_up)
                rows.setdefault(name, []).append((r.makespan, r.mean_jct, r.oom, split, r.given_up))
        print(f"\n{kind + ' box':24s} {'makespan h (min-max)':22s} {'mean completion h':22s} {'OOM kills':>9s} "
              f"{'given up':>8s} {'2-GPU off best link':>19s}")
        peer = rows["nvitop select_devices"]  # the peer that, like gpusd, finishes every job
        base = statistics.mean(x[0] for x in peer), statistics.mean(x[1] for x in peer)
        for name, vals in rows.items():
            ms = [v[0] / 3600 for v in vals]
            jc = [v[1] / 3600 for v in vals]
            mark = "*" if sum(v[4] for v in vals) else " "
            print(f"{name:24s}{mark}{statistics.mean(ms):5.2f} ({min(ms):.2f}-{max(ms):.2f})     "
                  f"{statistics.mean(jc):5.2f} ({min(jc):.2f}-{max(jc):.2f})     "
                  f"{sum(v[2] for v in vals):9d} {sum(v[4] for v in vals):8d} {sum(v[3] for v in vals):19d}"
                  + (f"   against nvitop: makespan {_change(statistics.mean(ms) * 3600, base[0])}, "
                     f"completion {_change(statistics.mean(jc) * 3600, base[1])}"
                     if name.startswith("gpusd") else ""))
        lb_ms = [b[0] / 3600 for b in bounds]
        lb_jc = [b[1] / 3600 for b in bounds]
        print(f"{'lower bound':24s} {statistics.mean(lb_ms):5.2f} ({min(lb_ms):.2f}-{max(lb_ms):.2f})     "
              f"{statistics.mean(lb_jc):5.2f} ({min(lb_jc):.2f}-{max(lb_jc):.2f})     {0:9d} {0:8d} {0:19d}")


def run_handover() -> None:
    box, infos = make_box("nvlink-pairs", busy_util=95.0, busy_memory=40 * GiB)
    jobs = handover_mix()
    print("\nHand-over: bench_alloc.py's 40-job makespan mix in simulated time (no start-up, no sampling lag)")
    for name, policy, fifo in (("gpusd run --wait --max-util 50", gpusd(infos, "auto", max_util=50), True),
                               ("round-robin lanes", rr_lanes(), False)):
        r = run(box, jobs, policy, fifo=fifo, ramp=0.0)
        on_busy = sum(1 for j in r.jobs if set(j.placed) & set(BUSY))
        print(f"{name:32s} makespan {r.makespan:5.2f} s   jobs on busy GPUs {on_busy:2d}   finished {r.completed}/40")
    six = sum(j.work for j in jobs) / (N - len(BUSY))
    print(f"{'work / 6 usable GPUs':32s} {six:5.2f} s (no schedule does better without the busy GPUs)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--jobs", type=int, default=60)
    ap.add_argument("--gap", type=float, default=240.0, help="mean seconds between arrivals")
    ap.add_argument("--mix", choices=("mixed", "handover", "all"), default="all")
    args = ap.parse_args()
    t0 = time.perf_counter()
    if args.mix in ("mixed", "all"):
        run_mixed(args.seeds, args.jobs, args.gap)
    if args.mix in ("handover", "all"):
        run_handover()
    print("\n* jobs were given up after repeated OOM kills: the times cover the jobs that finished only")
    print(f"(wall-clock {time.perf_counter() - t0:.1f} s; all times above are simulated)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
