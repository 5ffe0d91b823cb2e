"""The offline checker of the fault campaign (bench/bench_faults.py, docs/faults.md).

It reads what the campaign wrote down, never what gpusd says about itself: the jobs' own start/end
lines (written by each job's command, with ``time.monotonic_ns()``, which is one clock for every
namespace of the machine), the launchers' outcomes, the faults injected, the leases seen on each host
and the hosts' usage history, and counts violations of gpusd's promises:

* **double grant**: two jobs used one GPU at overlapping times;
* **lost job**: a job printed ``start`` but neither ``end`` nor a failure of its launcher with a reason;
* **lost lease**: a running job's GPU was not shown leased on its host (``gpusd leases``' view);
* **stale lease**: a lease was seen longer than TTL + the documented delay after its holder ended;
* **history miss**: a finished job (from a sample) has no matching record in its host's usage history;
* **second daemon up**: a second daemon started on a host's lock directory came up instead of refusing;
* **daemon death**: a daemon died of a fault it should have survived (and was restarted by the campaign).

Each violation is put down to one fault: of the faults on its host whose window (from the fault's start
to its end plus TTL, the delay and a margin) holds the moment of the violation, the one that began last
before it; else to ``none``.  Pure functions on plain data, so that
tests/faults/test_campaign_checker.py can feed it synthetic logs.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

NS = 1_000_000_000
COLUMNS = ("double_grants", "lost_jobs", "lost_leases", "stale_leases", "history_misses", "second_daemons",
           "daemon_deaths")


@dataclass
class Job:
    job: str
    kind: str = "?"
    host: str | None = None  # the host it ran on (from its GPUs), when known
    gpus: list[str] = field(default_factory=list)
    start: int | None = None  # monotonic ns, from the job's own lines
    end: int | None = None
    wall_start: float | None = None
    wall_end: float | None = None
    end_how: str = ""  # "end" or the signal the job caught
    launch_t0: int | None = None  # the launcher's run, monotonic ns
    launch_t1: int | None = None
    rc: int | None = None
    reason: str = ""
    holder_end: int | None = None  # when the lease's holder ended (reserve: the release)


@dataclass
class Violation:
    what: str  # one of COLUMNS
    t: int  # monotonic ns
    detail: str
    host: str | None = None  # where it happened, when known
    faults: list[str] = field(default_factory=list)  # the fault kind it is put down to (none: empty)


@dataclass
class Fault:
    kind: str
    host: str | None
    t0: int
    t1: int


@dataclass
class Report:
    violations: list[Violation]
    injected: dict[str, int]
    recover_s: dict[str, list[float]]
    jobs: int
    started: int
    sampled: int

    def counts(self) -> dict[str, dict[str, int]]:
        """Per fault kind (and ``none``): the count of each violation kind."""
        out: dict[str, dict[str, int]] = {k: dict.fromkeys(COLUMNS, 0) for k in [*self.injected, "none"]}
        for v in self.violations:
            for k in v.faults or ["none"]:
                out.setdefault(k, dict.fromkeys(COLUMNS, 0))[v.what] += 1
        return out

    def total(self) -> int:
        return len(self.violations)

    def table(self) -> str:
        head = ["fault kind", "injected", "double grants", "lost jobs", "lost leases", "stale leases",
                "history misses", "2nd daemon up", "daemon died", "recover p50 s"]
        rows = []
        for kind, c in self.counts().items():
            rec = sorted(self.recover_s.get(kind, []))
            p50 = f"{rec[len(rec) // 2]:.1f}" if rec else "-"
            rows.append([kind, str(self.injected.get(kind, 0)), *(str(c[k]) for k in COLUMNS), p50])
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in [head, *rows]]
        lines.append(f"jobs launched {self.jobs}, started {self.started}, history sample {self.sampled}; "
                     f"violations {self.total()}")
        return "\n".join(lines)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of ``path``, one a line; a torn or foreign line is skipped."""
    out = []
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    for line in text.splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


def gpus_of(cvd: str) -> list[str]:
    return [g.strip() for g in cvd.split(",") if g.strip()]


def resolve_indices(lines: list[dict[str, Any]], indices: dict[str, dict[str, str]]) -> list[dict[str, Any]]:
    """Job lines whose ``cvd`` holds GPU indices get UUIDs instead, through ``indices``: the job's
    network namespace (``net``, the inode of /proc/self/ns/net) -> index -> UUID of that host."""
    out = []
    for line in lines:
        table = indices.get(str(line.get("net")))
        gpus = gpus_of(str(line.get("cvd", "")))
        if table is not None and gpus and all(g in table for g in gpus):
            line = {**line, "cvd": ",".join(table[g] for g in gpus), "cvd_indices": line.get("cvd")}
        out.append(line)
    return out


def merge_jobs(lines: Iterable[dict[str, Any]], launches: Iterable[dict[str, Any]],
               gpu_host: dict[str, str]) -> dict[str, Job]:
    """One :class:`Job` per job id, from the jobs' own lines and the launchers' records."""
    jobs: dict[str, Job] = {}
    for rec in launches:
        j = jobs.setdefault(str(rec["job"]), Job(str(rec["job"])))
        j.kind = str(rec.get("kind", "?"))
        j.launch_t0, j.launch_t1 = rec.get("t0"), rec.get("t1")
        j.rc, j.reason = rec.get("rc"), str(rec.get("reason") or "")
        j.holder_end = rec.get("holder_end")
    for line in lines:
        j = jobs.setdefault(str(line.get("job")), Job(str(line.get("job"))))
        if line.get("ev") == "start" and j.start is None:
            j.start, j.wall_start = int(line["t"]), float(line.get("wall", 0.0))
            j.gpus = gpus_of(str(line.get("cvd", "")))
            hosts = {gpu_host[g] for g in j.gpus if g in gpu_host}
            j.host = hosts.pop() if len(hosts) == 1 else None
        elif line.get("ev") == "end" and j.end is None:
            j.end, j.wall_end = int(line["t"]), float(line.get("wall", 0.0))
            j.end_how = str(line.get("how", "end"))
    return jobs


def _used_until(j: Job, horizon: int) -> int:
    """Until when the job may have used its GPUs: its end line, else its launcher's end, else the horizon."""
    if j.end is not None:
        return j.end
    return j.launch_t1 if j.launch_t1 is not None else horizon


def double_grants(jobs: dict[str, Job], horizon: int, gpu_host: dict[str, str] | None = None) -> list[Violation]:
    by_gpu: dict[str, list[tuple[int, int, str]]] = {}
    for j in jobs.values():
        if j.start is None:
            continue
        for g in j.gpus:
            by_gpu.setdefault(g, []).append((j.start, _used_until(j, horizon), j.job))
    out = []
    for gpu, spans in by_gpu.items():
        spans.sort()
        active: list[tuple[int, int, str]] = []
        for start, end, job in spans:
            active = [a for a in active if a[1] > start]
            for _a_start, a_end, a_job in active:
                out.append(Violation("double_grants", start,
                                     f"GPU {gpu}: job {job} started while job {a_job} used it "
                                     f"({(min(end, a_end) - start) / NS:.1f} s overlap)",
                                     host=(gpu_host or {}).get(gpu)))
            active.append((start, end, job))
    return out


def lost_jobs(jobs: dict[str, Job], horizon: int) -> list[Violation]:
    out = []
    for j in jobs.values():
        if j.start is None or j.end is not None:
            continue
        if j.rc not in (None, 0) and j.reason.strip():
            continue  # its launcher said it failed, and why
        said = "no launcher outcome" if j.rc is None else f"launcher exit {j.rc} {j.reason.strip()!r}"
        out.append(Violation("lost_jobs", j.launch_t1 or horizon,
                             f"job {j.job} ({j.kind}) started on {j.gpus} and never ended ({said})", host=j.host))
    return out


def lost_leases(jobs: dict[str, Job], observations: Iterable[dict[str, Any]], gpu_host: dict[str, str],
                grace_ns: int = NS) -> list[Violation]:
    """A job's GPU missing from its host's leases while the job surely ran (``grace_ns`` inside its
    start and end): once per job."""
    obs_by_host: dict[str, list[tuple[int, set[str]]]] = {}
    for o in observations:
        if not o.get("ok", True):
            continue
        devs = {str(le.get("device")) for le in o.get("leases") or []}
        obs_by_host.setdefault(str(o["host"]), []).append((int(o["t"]), devs))
    out = []
    for j in jobs.values():
        if j.start is None or j.end is None:
            continue
        for g in j.gpus:
            host = gpu_host.get(g)
            miss = next((t for t, devs in obs_by_host.get(host or "", [])
                         if j.start + grace_ns <= t <= j.end - grace_ns and g not in devs), None)
            if miss is not None:
                out.append(Violation("lost_leases", miss, f"job {j.job} ({j.kind}) ran on {g} ({host}) but "
                                     f"{host} showed no lease on it {(miss - j.start) / NS:.1f} s after its start",
                                     host=host))
                break
    return out


def stale_leases(jobs: dict[str, Job], observations: Iterable[dict[str, Any]], gpu_host: dict[str, str],
                 allowance_ns: int) -> list[Violation]:
    """A lease seen when no launcher that could hold it ran (nor ended within ``allowance_ns``: TTL plus
    the documented delay): once per lease and GPU."""
    windows_by_gpu: dict[str, list[tuple[int, int]]] = {}
    unknown: list[tuple[int, int]] = []  # launches whose GPUs nobody knows (no start line)
    for j in jobs.values():
        if j.launch_t0 is None:
            continue
        until = max(x for x in (j.launch_t1, j.holder_end, j.end) if x is not None) \
            if any(x is not None for x in (j.launch_t1, j.holder_end, j.end)) else None
        span = (j.launch_t0, (until if until is not None else 1 << 62) + allowance_ns)
        if j.gpus:
            for g in j.gpus:
                windows_by_gpu.setdefault(g, []).append(span)
        else:
            unknown.append(span)
    seen: set[tuple[str, str]] = set()
    out = []
    for o in observations:
        if not o.get("ok", True):
            continue
        t = int(o["t"])
        for le in o.get("leases") or []:
            dev, lid = str(le.get("device")), str(le.get("lease_id"))
            if (lid, dev) in seen:
                continue
            if any(a <= t <= b for a, b in windows_by_gpu.get(dev, []) + unknown):
                continue
            seen.add((lid, dev))
            out.append(Violation("stale_leases", t, f"lease {lid} on {dev} ({o.get('host')}) held by pid "
                                 f"{le.get('pid')} with no live holder", host=str(o.get("host"))))
    return out


def history_misses(jobs: dict[str, Job], rows: list[dict[str, Any]], sample: int, seed: int,
                   slack_s: float = 3.0, min_s: float = 1.5,
                   skewed: Sequence[Fault] = ()) -> tuple[list[Violation], int]:
    """Jobs (a seeded sample of those that ran at least ``min_s``) with no history record of a lease or
    process on their GPU overlapping their run (wall clock, ``slack_s`` either side).  A job that ran on
    a host while one of ``skewed`` (its daemon's wall clock stepped, not the job's) is not compared: the
    two sides' wall clocks differ then, where a real step moves both."""
    def comparable(j: Job) -> bool:
        return not any(f.host in (None, j.host) and j.start is not None and j.end is not None
                       and j.start <= f.t1 + 2 * NS and j.end >= f.t0 for f in skewed)

    done = sorted((j for j in jobs.values() if j.start is not None and j.end is not None and j.gpus
                   and j.wall_start and j.wall_end and j.wall_end - j.wall_start >= min_s and comparable(j)),
                  key=lambda j: j.job)
    picked = random.Random(seed).sample(done, min(sample, len(done)))
    out = []
    for j in picked:
        assert j.wall_start is not None and j.wall_end is not None
        for g in j.gpus:
            hit = any(g in (r.get("gpus") or []) and float(r["start"]) <= j.wall_end + slack_s
                      and float(r.get("ended") or r.get("last") or r["start"]) >= j.wall_start - slack_s
                      for r in rows)
            if not hit:
                out.append(Violation("history_misses", j.start or 0, f"job {j.job} ({j.kind}) on {g} "
                                     "is missing from the usage history", host=j.host))
                break
    return out, len(picked)


def fault_outcomes(faults: list[dict[str, Any]]) -> list[Violation]:
    """What the faults' own records show: a second daemon that came up on a lock directory in use, a
    daemon that died of a fault."""
    out = []
    for f in faults:
        host, t0 = f.get("host"), int(f["t0"])
        if f.get("second_started"):
            out.append(Violation("second_daemons", t0, f"a second daemon on {host}'s lock directory came up "
                                 "instead of refusing", host=host))
        if f.get("died"):
            out.append(Violation("daemon_deaths", t0, f"{host}'s daemon died of {f.get('kind')}", host=host))
    return out


def attribute(violations: list[Violation], faults: list[Fault], after_ns: int) -> None:
    """Put each violation down to one fault: of those on its host (or of unknown host) whose window
    [t0 - 1 s, t1 + ``after_ns``] holds it, the one that began last before it (else the first)."""
    for v in violations:
        near = [f for f in faults if f.t0 - NS <= v.t <= f.t1 + after_ns
                and (f.host is None or v.host is None or f.host == v.host)]
        before = [f for f in near if f.t0 <= v.t]
        pick = max(before, key=lambda f: f.t0) if before else min(near, key=lambda f: f.t0) if near else None
        v.faults = [pick.kind] if pick is not None else []


def recovery(faults: list[Fault], jobs: dict[str, Job]) -> dict[str, list[float]]:
    """Per fault kind: seconds from each fault's end to the next job start on its host (any host for a
    fault of the whole LAN)."""
    starts = sorted((j.start, j.host) for j in jobs.values() if j.start is not None)
    out: dict[str, list[float]] = {}
    for f in faults:
        nxt = next((s for s, h in starts if s >= f.t1 and (f.host is None or h == f.host)), None)
        if nxt is not None:
            out.setdefault(f.kind, []).append((nxt - f.t1) / NS)
    return out


def check(job_lines: list[dict[str, Any]], launches: list[dict[str, Any]], faults: list[dict[str, Any]],
          observations: list[dict[str, Any]], history: list[dict[str, Any]] | None, gpu_host: dict[str, str],
          ttl_s: float, delay_s: float, horizon: int, sample: int = 50, seed: int = 0,
          kinds: Iterable[str] = ()) -> Report:
    """Every check on one campaign's records (``history`` None: not checked)."""
    jobs = merge_jobs(job_lines, launches, gpu_host)
    allowance = int((ttl_s + delay_s) * NS)
    fs = [Fault(str(f["kind"]), f.get("host"), int(f["t0"]), int(f["t1"])) for f in faults]
    vs = [*double_grants(jobs, horizon, gpu_host), *lost_jobs(jobs, horizon),
          *lost_leases(jobs, observations, gpu_host), *stale_leases(jobs, observations, gpu_host, allowance),
          *fault_outcomes(faults)]
    sampled = 0
    if history is not None:
        miss, sampled = history_misses(jobs, history, sample, seed, skewed=[f for f in fs if f.kind == "clock_step"])
        vs += miss
    attribute(vs, fs, allowance + 5 * NS)
    injected = dict.fromkeys(kinds, 0)
    for f in fs:
        injected[f.kind] = injected.get(f.kind, 0) + 1
    return Report(sorted(vs, key=lambda v: v.t), injected, recovery(fs, jobs), len(jobs),
                  sum(1 for j in jobs.values() if j.start is not None), sampled)
