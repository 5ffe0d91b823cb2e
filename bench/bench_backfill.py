"""Backfill before bookings: a synthetic day of jobs with time limits and three bookings on 8 GPUs.

    python bench/bench_backfill.py [--seed 1] [--days 1] [--load 0.9] [--runs 5]

Simulated, compressed time (an event-driven schedule, no processes): each job asks 1 or 2 GPUs with a
``--time`` limit and runs at most that long (it is stopped at its limit, as ``gpusd run --time``
stops it); three bookings (4 GPUs 10:00-12:00, all 8 GPUs 14:00-15:00, 2 GPUs 20:00-23:00) are made
the evening before (they are known all day).  Jobs queue first come, first served, and any job that
fits starts (first fit).
Which GPUs a job may take is decided by gpusd's own rule (``gpusd.alloc.bookings.in_the_way``, the
function every lease request calls) in the ``backfill`` schedule; side by side, in the same run:

* ``no backfill`` — the floor it is measured against: a booked GPU is lent to nobody from the moment
  it is booked until its booking ends (what a booking system without time limits must do to start
  bookings on time);
* ``no rule`` — bookings ignored until their start (a job without a limit may run into them): the
  bookings then start late, waiting for the jobs on their GPUs.

It prints, per schedule, the GPU-hours the jobs used within the day, the GPUs' busy share in the day
(jobs and bookings), the jobs finished within the day, their mean wait, and how many bookings started
late (the goal: 0 with backfill).
"""

from __future__ import annotations

import argparse
import heapq
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from gpusd.alloc.bookings import Booking, in_the_way  # noqa: E402

GPUS = 8
HOUR = 3600.0
DAY = 24 * HOUR


@dataclass
class Job:
    jid: int
    arrive: float
    gpus: int
    limit: float  # --time
    runs: float  # how long it would run (it is stopped at its limit)
    user: str = "others"
    start: float | None = None
    end: float | None = None


@dataclass
class World:
    jobs: list[Job]
    bookings: list[Booking]
    booked_at: float  # when the bookings were made
    span: float = DAY  # the simulated time the figures count


def make_world(seed: int, days: float, load: float) -> World:
    rng = random.Random(seed)
    jobs = []
    t = 0.0
    span = days * DAY
    # mean GPU-seconds asked per job: 1.5 GPUs x ~1.6 h; arrivals sized for `load` of the 8 GPUs
    mean_gpu_s = 1.5 * 1.6 * HOUR
    rate = load * GPUS / mean_gpu_s
    jid = 0
    while True:
        t += rng.expovariate(rate)
        if t >= span:
            break
        limit = rng.choice([0.5, 1, 1, 2, 2, 3, 4, 6]) * HOUR  # the --time users give
        runs = limit * rng.uniform(0.3, 1.0)  # most jobs end before their limit
        jobs.append(Job(jid, t, rng.choice([1, 1, 2]), limit, runs))
        jid += 1
    uuids = [f"GPU-{i}" for i in range(GPUS)]
    b = [Booking("aaaaaaaaaaa1", "alice", tuple(uuids[:4]), 10 * HOUR, 12 * HOUR, (0, 1, 2, 3)),
         Booking("aaaaaaaaaaa2", "bob", tuple(uuids), 14 * HOUR, 15 * HOUR, tuple(range(8))),
         Booking("aaaaaaaaaaa3", "carol", tuple(uuids[6:]), 20 * HOUR, 23 * HOUR, (6, 7))]
    return World(jobs, b, 0.0, span)


@dataclass(order=True)
class _Ev:
    t: float
    kind: int  # 0 a job ends, 1 a booking starts or ends, 2 a job arrives (ends first: GPUs free)
    what: object = field(compare=False)


def simulate(world: World, mode: str) -> dict[str, float]:
    jobs = [Job(j.jid, j.arrive, j.gpus, j.limit, j.runs) for j in world.jobs]
    free = {f"GPU-{i}" for i in range(GPUS)}
    holder: dict[str, int] = {}  # GPU -> job id
    events: list[_Ev] = []
    for j in jobs:
        heapq.heappush(events, _Ev(j.arrive, 2, j))
    for b in world.bookings:
        heapq.heappush(events, _Ev(b.start, 1, ("start", b)))
        heapq.heappush(events, _Ev(b.end, 1, ("end", b)))
    queue: list[Job] = []
    held_by_booking: set[str] = set()
    waiting_bookings: list[Booking] = []  # started, some GPU still held by a job
    late = 0
    late_s = 0.0
    booked_s = 0.0
    active = {b.booking_id: b for b in world.bookings}

    def allowed(now: float, j: Job) -> set[str]:
        if mode == "no rule":
            blocked = {u for b in active.values() if b.start <= now < b.end for u in b.devices}
        elif mode == "no backfill":
            blocked = {u for b in active.values() if world.booked_at <= now < b.end for u in b.devices}
        else:  # gpusd's rule, as every lease request applies it (a job's limit: its --time)
            known = [b for b in active.values() if now >= world.booked_at]
            blocked = {u for b in in_the_way(known, j.user, j.limit, now) for u in b.devices}
        return free - blocked - held_by_booking

    def dispatch(now: float) -> None:
        for j in list(queue):
            ok = sorted(allowed(now, j))
            if len(ok) >= j.gpus:
                take = ok[:j.gpus]
                for u in take:
                    free.discard(u)
                    holder[u] = j.jid
                j.start = now
                j.end = now + min(j.runs, j.limit)
                heapq.heappush(events, _Ev(j.end, 0, (j, take)))
                queue.remove(j)

    def try_bookings(now: float) -> None:
        nonlocal late, late_s, booked_s
        for b in list(waiting_bookings):
            if all(u in free for u in b.devices):
                for u in b.devices:
                    free.discard(u)
                    held_by_booking.add(u)
                if now > b.start:
                    late += 1
                    late_s += now - b.start
                booked_s += (b.end - now) * len(b.devices)
                waiting_bookings.remove(b)

    while events:
        ev = heapq.heappop(events)
        now = ev.t
        if ev.kind == 0:
            j, take = ev.what  # type: ignore[misc]
            for u in take:
                free.add(u)
                holder.pop(u, None)
        elif ev.kind == 1:
            what, b = ev.what  # type: ignore[misc]
            if what == "start":
                waiting_bookings.append(b)
            else:
                if b in waiting_bookings:  # never started: all of it late
                    waiting_bookings.remove(b)
                    late += 1
                    late_s += b.end - b.start
                for u in b.devices:
                    if u in held_by_booking:
                        held_by_booking.discard(u)
                        free.add(u)
                active.pop(b.booking_id, None)
        else:
            queue.append(ev.what)  # type: ignore[arg-type]
        try_bookings(now)
        dispatch(now)
    span = world.span  # what happened within the day(s) simulated; the queue left then is not counted
    ran = [j for j in jobs if j.start is not None and j.end is not None and j.start < span]
    job_s = sum((min(j.end, span) - j.start) * j.gpus for j in ran if j.end is not None and j.start is not None)
    waits = [j.start - j.arrive for j in ran if j.start is not None]
    return {"job_gpu_h": job_s / HOUR, "booked_gpu_h": booked_s / HOUR, "busy": (job_s + booked_s) / (span * GPUS),
            "jobs": sum(1 for j in ran if j.end is not None and j.end <= span),
            "wait_h": sum(waits) / len(waits) / HOUR if waits else 0.0, "late": late, "late_h": late_s / HOUR}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--days", type=float, default=1.0)
    ap.add_argument("--load", type=float, default=0.9, help="offered load, a share of the 8 GPUs (default 0.9)")
    ap.add_argument("--runs", type=int, default=5, help="days simulated, each with its own seed")
    a = ap.parse_args()
    modes = ("backfill", "no backfill", "no rule")
    totals: dict[str, dict[str, float]] = {m: {} for m in modes}
    for r in range(a.runs):
        world = make_world(a.seed + r, a.days, a.load)
        for m in modes:
            for k, v in simulate(world, m).items():
                totals[m][k] = totals[m].get(k, 0.0) + v
    print(f"{a.runs} synthetic day(s), 8 GPUs, offered load {a.load:.0%}, three bookings (4 GPUs 10-12h, "
          "8 GPUs 14-15h, 2 GPUs 20-23h, booked the evening before); means per day")
    print(f"{'schedule':<12} {'job GPU-h':>10} {'booked GPU-h':>13} {'busy':>6} {'jobs':>6} {'wait h':>7} "
          f"{'late bookings':>14} {'late GPU-h':>11}")
    for m in modes:
        t = {k: v / a.runs for k, v in totals[m].items()}
        print(f"{m:<12} {t['job_gpu_h']:>10.1f} {t['booked_gpu_h']:>13.1f} {t['busy']:>6.1%} {t['jobs']:>6.0f} "
              f"{t['wait_h']:>7.2f} {t['late']:>14.2f} {t['late_h']:>11.2f}")
    gain = totals["backfill"]["job_gpu_h"] / max(1e-9, totals["no backfill"]["job_gpu_h"]) - 1
    print(f"backfill vs no backfill: {gain:+.1%} job GPU-hours; bookings started late with backfill: "
          f"{totals['backfill']['late']:.0f} in {a.runs} day(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
