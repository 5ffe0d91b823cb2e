"""Issue 13: jobs that adapt — static vs round-robin vs gpusd FIFO vs gpusd with preemption and
rebalancing, on the fake NVML, with jobs that are scripts speaking the job protocol (docs/jobs.md).

    PYTHONPATH=src python3 bench/bench_jobs.py [--jobs 24] [--gpus 4] [--unit 0.25] [--seed 7] [--repeat 5]

The model (a simulation, said plainly): a job needs WORK units of GPU time (UNIT seconds each on a GPU
of its own).  A GPU's time is shared equally by the jobs on it and reduced by background load (a file
per GPU the bench writes, mirrored into the fake NVML's utilisation so that gpusd sees it).  Jobs
checkpoint every 0.5 unit and on SIGTERM (then exit 75); work lost = progress past the last checkpoint
when a job is killed or restarted.  Background load: GPU 3 is 90 % busy for the first half, then GPU 0
for the rest (a shift the rebalancer can react to).  Jobs arrive over the first seconds; a quarter of
them are short high-priority jobs, the rest normal (half of those --preemptible, priority low).

Policies: static (every job on GPU 0), round-robin, gpusd FIFO (``--wait``, every job normal),
gpusd priority (``--wait --priority``: the queue's classes alone) and gpusd preempt (priorities,
``--preemptible`` low jobs, a daemon with ``--rebalance-policy``).  Printed side by side: makespan,
mean completion time (arrival -> end) of the high-priority jobs and of all jobs, work lost (units),
restarts/moves; then the migration time measured by the supervisor (from the rebalancing decision
until the command runs on its new GPU, less the job's own checkpoint time), and how soon a
high-priority job starts when the only GPU runs a long preemptible job (against FIFO, where it waits).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time

from _common import REPO, FakeEnv, make_gpus

JOB = r'''
import json, os, sys, time
from pathlib import Path
from gpusd.job import Job, RESTART_ME
job = Job()
d = Path(os.environ["BENCH_DIR"]); name = os.environ["JOB_NAME"]; unit = float(os.environ["UNIT"])
work = float(os.environ["WORK"]); tick = 0.05
ck = d / "ck" / name
progress = float(ck.read_text()) if ck.exists() else 0.0
gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
reg = d / "on" / gpu / f"{name}.{os.getpid()}"
reg.parent.mkdir(parents=True, exist_ok=True); reg.touch()
reached = d / "reached" / name
if reached.exists():  # a restart: the progress past the checkpoint is lost work
    lost = max(0.0, float(reached.read_text()) - progress)
    with open(d / "lost" / name, "a") as f:
        f.write(f"{lost}\n")
def save(p):
    tmp = ck.with_suffix(".tmp"); tmp.write_text(repr(p)); os.replace(tmp, ck)
try:
    last = progress
    while progress < work:
        if job.should_stop:
            save(progress)
            sys.exit(RESTART_ME)
        time.sleep(tick)
        try:
            n = max(1, len(os.listdir(d / "on" / gpu)))
            bg = float((d / "bg" / gpu).read_text() or 0)
        except (OSError, ValueError):
            n, bg = 1, 0.0
        progress += tick * (1.0 - bg) / n / unit
        reached.write_text(repr(progress))
        if progress - last >= 0.5:
            save(progress); last = progress
finally:
    reg.unlink(missing_ok=True)
(d / "done" / name).write_text(json.dumps({"end": time.time(), "gpu": gpu,
                                           "restarts": int(os.environ.get("GPUSD_RESTART_COUNT") or 0)}))
'''


def mix(n: int, seed: int) -> list[dict[str, object]]:
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        high = i % 4 == 3
        jobs.append({"name": f"j{i:02d}", "arrive": round(rng.uniform(0, 3.0), 2),
                     "work": 1.0 if high else rng.choice([1.0, 2.0, 3.0, 4.0]),
                     "priority": "high" if high else ("low" if i % 2 == 0 else "normal"),
                     "preemptible": (not high) and i % 2 == 0})
    jobs.sort(key=lambda j: float(j["arrive"]))  # type: ignore[arg-type]
    return jobs


class Run:
    def __init__(self, fake: FakeEnv, gpus: int, unit: float, policy: str, attempt: int = 0) -> None:
        self.fake, self.gpus, self.unit, self.policy = fake, gpus, unit, policy
        self.dir = fake.tmp / (f"{policy}.{attempt}" if attempt else policy)  # fresh checkpoints every run
        for sub in ("ck", "on", "bg", "done", "reached", "err", "lost"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        self.script = self.dir / "job.py"
        self.script.write_text(JOB)
        self.env = dict(fake.env, BENCH_DIR=str(self.dir), UNIT=str(unit), PYTHONPATH=str(REPO / "src"),
                        GPUSD_LOCK_DIR=str(self.dir / "locks"), GPUSD_STATE_DIR=str(self.dir / "state"),
                        GPUSD_INTERFACES="127.0.0.1", GPUSD_MDNS_FAST="1")

    def background(self, hot: int) -> None:
        for g in range(self.gpus):
            (self.dir / "bg" / str(g)).write_text("0.9" if g == hot else "0")
        state = make_gpus(self.gpus, util_gpu=0)
        state[hot].util_gpu = 95
        self.fake.write(state)

    def command(self, job: dict[str, object], i: int) -> tuple[list[str], dict[str, str]]:
        env = dict(self.env, JOB_NAME=str(job["name"]), WORK=str(job["work"]))
        py = [sys.executable, str(self.script)]
        if self.policy == "static":
            return py, dict(env, CUDA_VISIBLE_DEVICES="0")
        if self.policy == "round-robin":
            return py, dict(env, CUDA_VISIBLE_DEVICES=str(i % self.gpus))
        run = [sys.executable, "-m", "gpusd", "run", "--wait", "--max-util", "80"]
        if self.policy == "gpusd-priority":  # the queue's priority classes alone: no preemption, no moves
            run += ["--priority", str(job["priority"])]
        if self.policy == "gpusd-preempt":
            run += ["--priority", str(job["priority"]), "--grace", "5"]
            if job["preemptible"]:
                run.append("--preemptible")
        return [*run, "--", *py], env

    def go(self, jobs: list[dict[str, object]], limit: float) -> dict[str, float]:
        daemon = None
        if self.policy == "gpusd-preempt":
            policy = self.dir / "policy.json"
            policy.write_text(json.dumps({"util_above": 90, "hot_for": 0.5, "idle_below": 10, "min_interval": 30}))
            r = subprocess.run([sys.executable, "-m", "gpusd", "start", "--interface", "127.0.0.1", "--port", "0",
                                "--session", f"bench-{os.getpid()}", "--interval", "0.2", "--fleet-view", "off",
                                "--no-record", "--rebalance-policy", str(policy)], env=self.env, capture_output=True,
                               text=True, timeout=60)
            if r.returncode != 0:
                raise SystemExit(f"daemon did not start: {r.stderr}")
            daemon = True
        self.background(3)
        procs: list[tuple[subprocess.Popen[bytes], object]] = []
        t0 = time.time()
        shifted = False
        pending = list(enumerate(jobs))
        try:
            while pending or any(p.poll() is None for p, _ in procs):
                now = time.time() - t0
                if now > limit:
                    break
                while pending and float(pending[0][1]["arrive"]) <= now:  # type: ignore[arg-type]
                    i, job = pending.pop(0)
                    cmd, env = self.command(job, i)
                    err = open(self.dir / "err" / str(job["name"]), "wb")
                    procs.append((subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err), err))
                if not shifted and now > 4.0:
                    self.background(0)  # the background load moves from GPU 3 to GPU 0
                    shifted = True
                time.sleep(0.05)
        finally:
            for p, err in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
                err.close()  # type: ignore[attr-defined]
            if daemon:
                subprocess.run([sys.executable, "-m", "gpusd", "stop", "--force"], env=self.env,
                               capture_output=True, timeout=60)
        return self.measure(jobs, t0)

    def measure(self, jobs: list[dict[str, object]], t0: float) -> dict[str, float]:
        ends, high, alls, restarts = [], [], [], 0
        done = 0
        for job in jobs:
            f = self.dir / "done" / str(job["name"])
            if not f.exists():
                continue
            done += 1
            d = json.loads(f.read_text())
            took = d["end"] - t0 - float(job["arrive"])  # type: ignore[arg-type]
            ends.append(d["end"] - t0)
            alls.append(took)
            restarts += d["restarts"]
            if job["priority"] == "high":
                high.append(took)
        lost = 0.0
        migrations: list[float] = []
        moves = 0
        for job in jobs:
            e = (self.dir / "err" / str(job["name"])).read_text(errors="replace")
            moves += e.count(": moving to GPU")
            for part in e.split("(restarted in ")[1:]:
                try:
                    migrations.append(float(part.split(" ms")[0]) / 1000)
                except ValueError:
                    pass
        for job in jobs:  # work past the last checkpoint when a job was stopped and restarted
            f = self.dir / "lost" / str(job["name"])
            if f.exists():
                lost += sum(float(x) for x in f.read_text().split())
        return {"done": done, "makespan": max(ends) if ends else float("nan"),
                "high_mean": sum(high) / len(high) if high else float("nan"),
                "all_mean": sum(alls) / len(alls) if alls else float("nan"),
                "lost": lost, "restarts": restarts, "moves": moves,
                "migration_max": max(migrations) if migrations else float("nan")}


def migrations(fake: FakeEnv, unit: float, n: int, limit: float) -> list[tuple[float, float]]:
    """n moves of a lone preemptible job off a GPU made hot: (decision -> SIGTERM sent, command exit ->
    running on the new GPU), in seconds; the job's own checkpoint time (between the two) is excluded."""
    run = Run(fake, 4, unit, "migration")
    policy = run.dir / "policy.json"
    policy.write_text(json.dumps({"util_above": 90, "hot_for": 0.2, "idle_below": 10, "min_interval": 600}))
    r = subprocess.run([sys.executable, "-m", "gpusd", "start", "--interface", "127.0.0.1", "--port", "0",
                        "--session", f"bench-m-{os.getpid()}", "--interval", "0.2", "--fleet-view", "off",
                        "--no-record", "--rebalance-policy", str(policy)], env=run.env, capture_output=True, text=True,
                       timeout=60)
    if r.returncode != 0:
        raise SystemExit(f"daemon did not start: {r.stderr}")
    out: list[tuple[float, float]] = []
    try:
        for k in range(n):
            fake.write(make_gpus(4, util_gpu=0))
            for g in range(4):
                (run.dir / "bg" / str(g)).write_text("0")
            name = f"m{k}"
            env = dict(run.env, JOB_NAME=name, WORK="1000")
            err = run.dir / "err" / name
            with open(err, "wb") as f:
                p = subprocess.Popen([sys.executable, "-m", "gpusd", "run", "--preemptible", "--", sys.executable,
                                      str(run.script)], env=env, stdout=subprocess.DEVNULL, stderr=f)
            t = time.time()
            while not list((run.dir / "on").glob(f"*/{name}.*")) and time.time() - t < limit:
                time.sleep(0.05)
            gpus = make_gpus(4, util_gpu=0)
            first = int(list((run.dir / "on").glob(f"*/{name}.*"))[0].parent.name)
            gpus[first].util_gpu = 99
            fake.write(gpus)
            while "restarted in" not in err.read_text(errors="replace") and time.time() - t < limit:
                time.sleep(0.05)
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=60)
            text = err.read_text(errors="replace")
            log = (run.dir / "state" / "gpusd.log").read_text(errors="replace")
            asked = [float(x.split(" ms)")[0]) / 1000 for x in log.split("asked in ")[1:]]
            if "(restarted in " in text and len(asked) > k:
                out.append((asked[k], float(text.split("(restarted in ")[1].split(" ms")[0]) / 1000))
    finally:
        subprocess.run([sys.executable, "-m", "gpusd", "stop", "--force"], env=run.env, capture_output=True,
                       timeout=60)
    return out


VICTIM = r'''
import os, sys, time
from pathlib import Path
from gpusd.job import Job, RESTART_ME
job = Job(); d = Path(os.environ["BENCH_DIR"])
if job.restarts:
    (d / "resumed").write_text(repr(time.time())); sys.exit(0)
(d / "started").write_text(repr(time.time()))
end = time.time() + float(os.environ["RUN_S"])
while time.time() < end:
    if job.should_stop:
        t = time.time(); time.sleep(float(os.environ["CKPT_S"]))  # its own checkpoint
        (d / "checkpoint").write_text(repr(time.time() - t)); sys.exit(RESTART_ME)
    time.sleep(0.01)
'''


def preemption(fake: FakeEnv, unit: float, rounds: int, limit: float, grace: float = 5.0,
               ckpt: float = 0.5, run_s: float = 20.0) -> list[tuple[float, float, float]]:
    """A high-priority job arrives while the only GPU runs a long preemptible low job: (seconds from its
    ``gpusd run`` to its command running, the victim's own checkpoint time, and the same start with a
    victim that is not preemptible, i.e. FIFO: it waits for the job to end, cut at ``limit``)."""
    out: list[tuple[float, float, float]] = []
    for k in range(rounds):
        got = []
        for preemptible in (True, False):
            run = Run(fake, 1, unit, f"preempt{k}{'p' if preemptible else 'f'}")
            fake.write(make_gpus(1, util_gpu=0))
            (run.dir / "victim.py").write_text(VICTIM)
            env = dict(run.env, RUN_S=str(run_s if preemptible else min(run_s, limit)), CKPT_S=str(ckpt))
            victim = subprocess.Popen([sys.executable, "-m", "gpusd", "run", "--priority", "low", "--grace", str(grace),
                                       *(["--preemptible"] if preemptible else []), "--", sys.executable,
                                       str(run.dir / "victim.py")], env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL)
            try:
                t = time.time()
                while not (run.dir / "started").exists() and time.time() - t < limit:
                    time.sleep(0.02)
                t0 = time.time()
                high = subprocess.run([sys.executable, "-m", "gpusd", "run", "--priority", "high", "--wait",
                                       "--timeout", str(limit + run_s), "--", sys.executable, "-c",
                                       "import sys, time; open(sys.argv[1], 'w').write(repr(time.time()))",
                                       str(run.dir / "high")], env=env, capture_output=True, timeout=limit + run_s + 60)
                if high.returncode == 0:
                    got.append(float((run.dir / "high").read_text()) - t0)
                    if preemptible:
                        got.append(float((run.dir / "checkpoint").read_text()))
            finally:
                victim.terminate()
                victim.wait(timeout=60)
        if len(got) == 3:
            out.append((got[0], got[1], got[2]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=24)
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--unit", type=float, default=0.25, help="seconds of GPU time per work unit")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--limit", type=float, default=30.0, help="seconds per policy at most")
    ap.add_argument("--no-migration", action="store_true", help="skip the migration-time measurement")
    ap.add_argument("--policies", default="static,round-robin,gpusd-fifo,gpusd-priority,gpusd-preempt")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each gpusd policy (median and range shown)")
    args = ap.parse_args()
    fake = FakeEnv(make_gpus(args.gpus, util_gpu=0))
    jobs = mix(args.jobs, args.seed)
    total = sum(float(j["work"]) for j in jobs) * args.unit  # type: ignore[arg-type]
    print(f"{len(jobs)} jobs ({sum(j['priority'] == 'high' for j in jobs)} high), {total:.1f} GPU-seconds of work "
          f"on {args.gpus} GPUs (ideal makespan ~{total / (args.gpus - 0.9):.1f}s with 0.9 GPU of background load)")
    rows = []
    for policy in args.policies.split(","):
        runs = []
        for attempt in range(max(1, args.repeat) if policy.startswith("gpusd") else 1):
            res = Run(fake, args.gpus, args.unit, policy, attempt).go(jobs, args.limit)
            runs.append(res)
            span = f"{res['makespan']:6.1f}s" if res["done"] == len(jobs) else f">{args.limit:.0f}s  "
            print(f"  {policy:14s} done {res['done']:.0f}/{len(jobs)}  makespan {span}  "
                  f"high-priority mean {res['high_mean']:5.1f}s  all mean {res['all_mean']:5.1f}s  "
                  f"work lost {res['lost']:.2f}u  restarts {res['restarts']:.0f}  moves {res['moves']:.0f}  "
                  f"migration max {res['migration_max'] * 1000:.0f} ms", flush=True)
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        if len(runs) > 1:
            print(f"  {policy:14s} median of {len(runs)}: " + "  ".join(
                f"{what} {med[k]:.1f}s [{min(r[k] for r in runs):.1f}-{max(r[k] for r in runs):.1f}]"
                for k, what in (("makespan", "makespan"), ("high_mean", "high-priority mean"),
                                ("all_mean", "all mean"))), flush=True)
        rows.append((policy, med))
    if not args.no_migration:
        moves = migrations(fake, args.unit, 3, args.limit)
        for asked, restart in moves:
            print(f"  migration: decision -> SIGTERM {asked * 1000:.0f} ms (leasing the new GPU included), "
                  f"exit -> running on the new GPU {restart * 1000:.0f} ms: total {(asked + restart) * 1000:.0f} ms "
                  f"(goal < 1000 ms, the job's checkpoint excluded)")
        if not moves:
            print("  migration: no move observed within the limit")
        for latency, ck, fifo in preemption(fake, args.unit, 3, min(args.limit, 20.0)):
            print(f"  preemption: a high-priority job started {latency:.2f} s after its gpusd run (goal: within "
                  f"the 5 s grace + 1 s), of which {ck:.2f} s was the victim's own checkpoint; without preemption "
                  f"(FIFO) it started after {fifo:.1f} s, when the running job ended")
    base = dict(rows)
    if "gpusd-fifo" in base:
        for ref in ("static", "round-robin"):
            if ref in base:
                unfinished = base[ref]["done"] < len(jobs)
                a, b = (args.limit if unfinished else base[ref]["makespan"]), base["gpusd-fifo"]["makespan"]
                print(f"gpusd FIFO vs {ref}: makespan {'at least ' if unfinished else ''}{100 * (a - b) / a:.0f}% "
                      "shorter" + (f" ({ref} had not finished at the {args.limit:g}s limit)" if unfinished else ""))
        for other, name in (("gpusd-priority", "priority classes"), ("gpusd-preempt", "preempt+rebalance")):
            if other not in base:
                continue
            for key, what in (("makespan", "makespan"), ("high_mean", "mean completion of high-priority jobs"),
                              ("all_mean", "mean completion of all jobs")):
                a, b = base["gpusd-fifo"][key], base[other][key]
                print(f"gpusd {name} vs FIFO: {what} {100 * (a - b) / a:+.0f}% shorter (negative: longer)")
    shutil.rmtree(fake.tmp, ignore_errors=True)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
