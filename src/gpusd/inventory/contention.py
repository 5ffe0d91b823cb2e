"""A contention model for simulated GPUs (docs/simulation.md, "Contention"): what happens to jobs that
share a GPU, run out of its memory, or all-reduce across a slow link.  Pure and in simulated time: an
event-driven run of a job mix under a placement policy, for ``bench/bench_placement.py``.

The model, and where its numbers come from:

* **Sharing.** A GPU time-slices between the jobs on it.  A job progresses at rate
  ``1 / (1 + sum(u_other) / 100)`` where ``u_other`` are the utilisations (percent, as each drives the
  GPU alone) of everything else on the GPU: other jobs and background processes.  Two jobs that each
  keep a GPU 100 % busy run at half speed; a job beside a 30 % process at 77 %.  A multi-GPU job is
  synchronous (data parallel): it progresses at the rate of its slowest GPU.
* **Memory.** A job allocates its memory ``ramp`` seconds after it starts (framework start-up, data
  loading: :data:`RAMP`, an assumption); NVML shows it only then.  If the GPU's memory in use would
  then exceed its total, the job fails like an out-of-memory error: its work is lost, it counts as an
  OOM failure, and it is submitted again at once (as its user would), at the back of the queue, up to
  :data:`RETRIES` times; its completion time still counts from its first arrival.  A reservation
  (a gpusd lease's ``--memory``) is visible to gpusd at once.
* **Communication.** A k-GPU job spends ``comm_bytes / bandwidth(link)`` seconds all-reducing, on top
  of its compute, where the link is the worst between its GPUs: NVLink 208 GB/s, PCIe 20 GB/s (one A100
  node, NVIDIA/nccl-tests #178: two ranks on an NVLink pair against three crossing PCIe), across
  sockets 10 GB/s (NVIDIA/nccl #428 reports a degradation there without one number: an assumption).
  Contention slows communication like compute (the rate applies to the whole job).

Utilisation and memory a policy sees are the instantaneous sums (no sampling window, no lag); the
hand-over from one job to the next is instant.  Everything else a real machine adds (process start-up,
the CUDA context, the driver's sampling) is left out on purpose: this is the placement's effect alone.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

GB = 1e9
# bytes/s all-reduce, NVLink pair (nccl-tests #178)
NVLINK_BW = 208 * GB
# bytes/s across PCIe (nccl-tests #178)
PCIE_BW = 20 * GB
# bytes/s across sockets (assumption; nccl #428 reports it lower than PCIe)
SYS_BW = 10 * GB
# seconds from a job's start to its memory allocation (assumption)
RAMP = 20.0
# an OOM-failed job is submitted again this many times, then given up
RETRIES = 50


def bandwidth(rank: int) -> float:
    """All-reduce bandwidth for the worst link rank of a set (:func:`gpusd.topology.rank`: 0 NVLink,
    1-5 PCIe levels, 6 across sockets or unknown)."""
    if rank == 0:
        return NVLINK_BW
    return SYS_BW if rank >= 6 else PCIE_BW


def rate(others_util: float) -> float:
    """A job's speed (1 = alone) beside ``others_util`` percent of other work on its GPU."""
    return 1.0 / (1.0 + max(0.0, others_util) / 100.0)


@dataclass
class Job:
    name: str
    arrival: float  # seconds
    gpus: int
    # seconds of compute, alone on a GPU
    work: float
    # percent it drives its GPUs at, alone
    util: float
    memory: int  # bytes per GPU
    # bytes all-reduced over the whole run (multi-GPU jobs)
    comm_bytes: float = 0.0
    # filled by the run
    placed: list[int] = field(default_factory=list)
    start: float | None = None
    end: float | None = None
    # given up after RETRIES out-of-memory failures
    oom: bool = False
    # out-of-memory failures
    ooms: int = 0
    # standalone seconds left (compute + communication)
    remaining: float = 0.0
    # its memory is in use (after the ramp)
    allocated: bool = False

    def standalone(self, worst_rank: int) -> float:
        """Seconds alone on GPUs whose worst link has ``worst_rank``."""
        return self.work + (self.comm_bytes / bandwidth(worst_rank) if self.gpus > 1 else 0.0)


@dataclass
class Gpu:
    index: int
    memory_total: int
    # another user's process, outside any placement
    background_util: float = 0.0
    background_memory: int = 0


@dataclass
class Box:
    gpus: list[Gpu]
    # worst link rank among GPU indices
    worst_rank: Callable[[Sequence[int]], int]
    # the best worst-link a 2-GPU set can have on this box
    best_rank: int


@dataclass
class State:
    """What a placement policy sees (and the reservations gpusd's leases hold)."""

    time: float
    box: Box
    running: list[Job]

    def util(self, i: int) -> float:
        g = self.box.gpus[i]
        return min(100.0, g.background_util + sum(j.util for j in self.running if i in j.placed))

    def memory_used(self, i: int) -> int:
        g = self.box.gpus[i]
        return g.background_memory + sum(j.memory for j in self.running if i in j.placed and j.allocated)

    def jobs_on(self, i: int) -> list[Job]:
        return [j for j in self.running if i in j.placed]

    def others(self, i: int, job: Job) -> float:
        """Percent of other work on GPU ``i`` beside ``job`` (not capped: two full jobs are 200 %)."""
        return self.box.gpus[i].background_util + sum(j.util for j in self.running if i in j.placed and j is not job)


# A policy: given the state and the job, the GPUs to start it on now, or None to wait.
Policy = Callable[[State, Job], "list[int] | None"]


@dataclass
class Result:
    makespan: float
    mean_jct: float
    # out-of-memory failures (each retry counted)
    oom: int
    # jobs that failed RETRIES + 1 times
    given_up: int
    completed: int
    jobs: list[Job]


def run(box: Box, jobs: Sequence[Job], policy: Policy, *, fifo: bool = True, ramp: float = RAMP,
        limit: float = 1e7) -> Result:
    """Run ``jobs`` (copied) on ``box`` under ``policy`` in simulated time.  ``fifo``: a job that must
    wait holds back the jobs behind it (a queue served in order, as gpusd's); else later jobs may pass."""
    pending = sorted((Job(j.name, j.arrival, j.gpus, j.work, j.util, j.memory, j.comm_bytes) for j in jobs),
                     key=lambda j: (j.arrival, j.name))
    arrivals = list(pending)
    waiting: list[Job] = []
    running: list[Job] = []
    done: list[Job] = []
    t = 0.0
    # (time, seq, job): memory allocations due
    ramps: list[tuple[float, int, Job]] = []
    seq = 0
    while arrivals or waiting or running:
        # who arrived by now
        while arrivals and arrivals[0].arrival <= t + 1e-12:
            waiting.append(arrivals.pop(0))
        # allocations due now: the OOM rule
        while ramps and ramps[0][0] <= t + 1e-12:
            _, _, job = heapq.heappop(ramps)
            if job not in running:
                continue
            job.allocated = True
            state = State(t, box, running)
            if any(state.memory_used(i) > box.gpus[i].memory_total for i in job.placed):
                running.remove(job)
                job.ooms += 1
                job.allocated, job.start = False, None
                if job.ooms > RETRIES:
                    job.oom, job.end = True, t
                    done.append(job)
                else:
                    # its user runs it again
                    waiting.append(job)
        # placements
        for job in list(waiting):
            gpus = policy(State(t, box, running), job)
            if gpus is None:
                if fifo:
                    break
                continue
            waiting.remove(job)
            job.placed, job.start = list(gpus), t
            job.remaining = job.standalone(box.worst_rank(gpus))
            running.append(job)
            if ramp > 0:
                seq += 1
                heapq.heappush(ramps, (t + ramp, seq, job))
            else:
                job.allocated = True
        # the next event: an arrival, an allocation, a completion
        state = State(t, box, running)
        rates = {id(j): min(rate(state.others(i, j)) for i in j.placed) for j in running}
        horizon = [arrivals[0].arrival] if arrivals else []
        if ramps:
            horizon.append(ramps[0][0])
        horizon += [t + j.remaining / rates[id(j)] for j in running]
        if not horizon:
            # jobs wait for GPUs that no event will free: a policy that can never place them
            break
        nxt = max(t, min(horizon))
        if nxt > limit:
            break
        for j in running:
            j.remaining -= (nxt - t) * rates[id(j)]
        t = nxt
        for j in [j for j in running if j.remaining <= 1e-9]:
            j.end = t
            running.remove(j)
            done.append(j)
    finished = [j for j in done if not j.oom]
    makespan = max((j.end or 0.0) for j in finished) if finished else math.nan
    jct = sum((j.end or 0.0) - j.arrival for j in finished) / len(finished) if finished else math.nan
    return Result(makespan, jct, sum(j.ooms for j in done + waiting + running), sum(1 for j in done if j.oom),
                  len(finished), done + waiting + running)


def lower_bound(box: Box, jobs: Sequence[Job]) -> tuple[float, float]:
    """(makespan, mean completion time) no placement can beat: every job alone from its arrival on
    its best-connected GPUs, and all work spread evenly over every GPU at full speed."""
    alone = [j.standalone(box.best_rank if j.gpus > 1 else 0) for j in jobs]
    first = min(j.arrival for j in jobs)
    spread = first + sum(j.gpus * a for j, a in zip(jobs, alone)) / len(box.gpus)
    return max(max(j.arrival + a for j, a in zip(jobs, alone)), spread), sum(alone) / len(alone)
