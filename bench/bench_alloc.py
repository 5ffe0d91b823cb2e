"""Issue 3 benchmark: collisions, selection latency and makespan, on a fake NVML with 8 GPUs.

    python bench/bench_alloc.py [--rounds 20] [--n 2000] [--runs 15] [--jobs 40] [--handovers 20]
                                [--skip collisions|latency|handover|makespan] [--tree DIR ...] [--repeat N]

Collisions: 16 processes, started and initialised beforehand, are released at the same instant by a
barrier and each asks for one GPU; we count the GPUs given to more than one process.  gpusd
(``gpusd.select(count=1)``, with its lease) versus nvitop's ``select_devices`` and a GPUtil-style
"least loaded" pick (GPUtil itself needs nvidia-smi; its rule is reproduced on NVML readings).

Latency: in-process ``gpusd.select(count=1, lease=False)`` and select + lease + release versus
``nvitop.select_devices(min_count=1)``, on two rigs: ``samples`` (the driver keeps a utilisation sample
buffer) and ``no-samples`` (``nvmlDeviceGetSamples`` answers NOT_SUPPORTED, so gpusd builds its 5 s
window from its own readings, one per call; processes on 5 of the 8 GPUs); whole process
``gpusd select -n 1`` versus ``nvisel -n 1`` (first rig).

Hand-over: one GPU, leased by this process; a second process waits for it at the head of the queue
(``gpusd.select(wait=True)``).  We release the lease at a random moment and measure how long until the
waiter has it: the queue's wake-up, isolated from process start-up and from utilisation readings.  Then
the same through ``gpusd run --wait`` (a job), split at the moment its lease is taken (inotify on the lock
directory), beside the floor: the same command started by a plain ``Popen``.

Makespan: 40 jobs of mixed length and memory on 8 GPUs, two of them busy with background load (jobs
there run at half speed); each job, while it runs, adds its load and memory to the fake state.
``gpusd run --wait --max-util 50`` per job versus a static round-robin assignment.  Knobs for finding where
a hand-over goes: ``$BENCH_MAX_UTIL`` (the jobs' ``--max-util``, default 50; 100: utilisation never holds a
job back), ``$KEEPER_POLL`` (the fake state keeper's longest wait between two looks at the running jobs,
default 0.05 s) and ``$KEEPER_EVENTS=0`` (the keeper polls only, instead of waking on inotify when a job
starts or ends: a job's load and memory then stay in the fake NVML up to KEEPER_POLL after it ends).
Each hand-over is split (job end -> its lease ends -> the next lease is taken -> the next job starts), the
fake's lag is given apart, and the ideal (a zero-overhead FIFO list schedule on the usable GPUs) beside.

``--tree DIR`` (repeatable): run the hand-over's and makespan's waiters and jobs with that tree's gpusd
(``DIR/src``) as well as this one's, alternating, ``--repeat`` rounds (e.g. a worktree of the base commit).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from _common import (
    REPO,
    FakeEnv,
    FakeProcess,
    make_gpus,
    p50,
    timeit_each,
    whole_process,
    write_state,
)

GiB = 2**30


def fleet():
    gpus = make_gpus(8, memory_used=2 * GiB, util_gpu=5, mig_mode=0)
    for i, g in enumerate(gpus):  # varied, so "least loaded" is not simply GPU 0
        g.util_gpu = [12, 3, 25, 7, 18, 9, 30, 15][i]
        g.memory_used = [4, 1, 9, 2, 6, 3, 12, 5][i] * GiB
    return gpus


def fleet_no_samples():
    """The same load on a driver without a sample buffer; processes on GPUs 0-4."""
    gpus = fleet()
    for i, g in enumerate(gpus):
        g.errors = {"nvmlDeviceGetSamples": 3}
        if i < 5:
            g.processes = [FakeProcess(os.getpid(), 1 * GiB), FakeProcess(os.getppid(), 1 * GiB)]
    return gpus


# -- collisions --------------------------------------------------------------------------------------

def _worker(kind: str, env: dict, start: "mp.synchronize.Barrier", done: "mp.synchronize.Barrier",
            out: "mp.Queue") -> None:
    os.environ.update(env)
    sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
    from fakenvml import preload

    preload(env["LD_LIBRARY_PATH"].split(":")[0])
    pick = None
    if kind == "gpusd":
        import gpusd

        gpusd.local_snapshot()  # NVML initialised before the start signal, as for the others
        start.wait()
        try:
            sel = gpusd.select(count=1)
            pick = sel.indices[0]
        except gpusd.NoGpuAvailable:
            sel = None
    elif kind == "nvitop":
        from nvitop import Device, select_devices

        Device.count()
        start.wait()
        picks = select_devices(min_count=1, max_count=1)
        pick = picks[0] if picks else None
    else:  # GPUtil's rule: sort by load (utilisation), then take the first
        import pynvml

        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        start.wait()
        loads = [(pynvml.nvmlDeviceGetUtilizationRates(h).gpu, i) for i, h in enumerate(handles)]
        pick = min(loads)[1]
    out.put(pick)
    done.wait()  # hold the GPU (and the lease) until every worker has picked


def collisions(fake: FakeEnv, rounds: int) -> None:
    ctx = mp.get_context("spawn")
    print(f"\nCollisions: 16 processes ask for 1 GPU each at the same instant, 8 GPUs, {rounds} rounds")
    print(f"{'tool':28s} {'GPUs shared, per round':>24s} {'rounds with 0':>14s} {'processes given a GPU':>22s}")
    for kind in ("gpusd", "nvitop", "gputil-style"):
        if kind == "nvitop" and shutil.which("nvisel") is None:
            print(f"{kind:28s} not installed")
            continue
        shared_counts, given = [], []
        for _ in range(rounds):
            start, done, q = ctx.Barrier(17), ctx.Barrier(17), ctx.Queue()
            procs = [ctx.Process(target=_worker, args=(kind, fake.env, start, done, q)) for _ in range(16)]
            for p in procs:
                p.start()
            start.wait()
            picks = [q.get(timeout=60) for _ in range(16)]
            done.wait()
            for p in procs:
                p.join(30)
            got = [p for p in picks if p is not None]
            shared_counts.append(sum(1 for g in set(got) if got.count(g) > 1))
            given.append(len(got))
        spread = (f"min {min(shared_counts)}, max {max(shared_counts)}, "
                  f"mean {sum(shared_counts) / rounds:.1f}")
        print(f"{kind:28s} {spread:>24s}"
              f" {sum(1 for c in shared_counts if c == 0):>8d}/{rounds:<5d} {p50(given):>14.0f} of 16")
    print("(gpusd gives each of the 8 GPUs to one process and tells the other 8 that no GPU is free;\n"
          " with --wait they would queue.)")


# -- latency -----------------------------------------------------------------------------------------

def latency(fake: FakeEnv, n: int, runs: int, rigs: list[str]) -> None:
    import gpusd
    from gpusd.alloc import api

    def ours() -> None:
        gpusd.select(count=1, lease=False)

    def ours_lease() -> None:
        gpusd.select(count=1).release()

    for rig in rigs:
        rig_fake = fake if rig == "samples" else FakeEnv(fleet_no_samples())
        rig_fake.activate_in_process()
        for backend in api._backends.values():  # a fresh backend per rig (it remembers what is unsupported)
            backend.close()
        api._backends.clear()
        rows = [("gpusd.select(count=1, lease=False)", p50(timeit_each(ours, n))),
                ("gpusd.select(count=1) + lease + release", p50(timeit_each(ours_lease, n)))]
        try:
            from nvitop import select_devices

            rows.append(("nvitop.select_devices(min_count=1)", p50(timeit_each(lambda: select_devices(min_count=1),
                                                                               max(100, n // 10)))))
        except ImportError:
            pass
        base = rows[0][1]
        print(f"\nSelection latency, in-process (p50), rig: {rig}")
        for name, t in rows:
            print(f"{name:44s} {t * 1e3:8.3f} ms  {t / base:6.2f}x gpusd select")
        if rig_fake is not fake:
            shutil.rmtree(rig_fake.tmp, ignore_errors=True)
    fake.activate_in_process()
    if runs <= 0:
        return
    print(f"\nWhole process, median of {runs} runs")
    cmds = [("gpusd select -n 1", [sys.executable, "-m", "gpusd", "select", "-n", "1"])]
    if shutil.which("nvisel"):
        cmds.append(("nvisel -n 1", [shutil.which("nvisel"), "-n", "1"]))
    for name, cmd in cmds:
        times, last = whole_process(cmd, fake.env, runs)
        print(f"{name:44s} {p50(times) * 1e3:8.1f} ms  (min {min(times) * 1e3:.1f}, rc {last.returncode})")


# -- hand-over --------------------------------------------------------------------------------------

WAITER = r"""
import sys, time
import gpusd
sel = gpusd.select(count=1, wait=True, timeout=60)
print(time.time(), flush=True)
"""


def handover(fake: FakeEnv, rounds: int) -> None:
    fake.activate_in_process()
    os.environ.update(fake.env)
    from gpusd.alloc import queue
    from gpusd.alloc.leases import LeaseStore

    write_state(fake.state, make_gpus(1, mig_mode=0))
    env = dict(fake.env, GPUSD_LEASE_SOCKET="off")
    store = LeaseStore(env["GPUSD_LOCK_DIR"])
    rng = random.Random(3)
    delays = []
    for _ in range(rounds):
        lease = store.acquire([make_gpus(1)[0].uuid])
        assert lease is not None
        p = subprocess.Popen([sys.executable, "-c", WAITER], env=env, stdout=subprocess.PIPE, text=True)
        while not queue.waiting(store):
            time.sleep(0.01)
        time.sleep(rng.uniform(0.2, 0.5))  # the waiter is at the head, between two looks
        t = time.time()
        lease.release()
        got = float(p.stdout.readline())
        p.wait()
        delays.append(got - t)
    # The same through `gpusd run --wait` (a job: the supervisor, its records, the command's start) against
    # the floor, the same command started by a plain Popen; where the time goes: lease end -> the next
    # lease taken (the queue) -> the command's first line (the supervisor's start of it + the interpreter)
    log = LeaseLog(Path(env["GPUSD_LOCK_DIR"]), [make_gpus(1)[0].uuid])
    log.start()
    job = [sys.executable, "-c", "import time; print(time.time(), flush=True)"]
    runs, floor = [], []
    for _ in range(rounds):
        lease = store.acquire([make_gpus(1)[0].uuid])
        assert lease is not None
        p = subprocess.Popen([sys.executable, "-m", "gpusd", "run", "-n", "1", "--wait", "--timeout", "60", "--", *job],
                             env=env, stdout=subprocess.PIPE, text=True)
        while not queue.waiting(store):
            time.sleep(0.01)
        time.sleep(rng.uniform(0.2, 0.5))
        t = time.time()
        lease.release()
        got = float(p.stdout.readline())
        p.wait()
        taken = _after(log.taken, 0, t, got)
        runs.append((got - t, (taken - t) if taken else float("nan"), (got - taken) if taken else float("nan")))
        t = time.time()
        q = subprocess.Popen(job, env=env, stdout=subprocess.PIPE, text=True)
        floor.append(float(q.stdout.readline()) - t)
        q.wait()
    log.stop.set()
    log.join()
    write_state(fake.state, fleet())
    print(f"\nHand-over: a lease ends, the waiter at the head of the queue gets the GPU ({rounds} rounds)")
    print(f"{'':44s} {'p50 ms':>8s} {'p90 ms':>8s} {'max ms':>8s}")
    for name, vals in (("gpusd.select(wait=True), in process", delays),
                       ("gpusd run --wait: lease end -> command runs", [r[0] for r in runs]),
                       ("  of which: lease end -> next lease taken", [r[1] for r in runs]),
                       ("  of which: lease taken -> command runs", [r[2] for r in runs]),
                       ("floor: Popen of the same command -> runs", floor)):
        vals = sorted(vals)
        print(f"{name:44s} {p50(vals) * 1e3:8.1f} {vals[int(0.9 * (len(vals) - 1))] * 1e3:8.1f} {vals[-1] * 1e3:8.1f}")


# -- makespan ----------------------------------------------------------------------------------------

JOB = r"""
import json, os, sys, time
run_dir, job_id, duration, mem = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
gpu = int(os.environ["CUDA_VISIBLE_DEVICES"])
busy = json.load(open(os.path.join(run_dir, "busy.json")))
start = time.time()
path = os.path.join(run_dir, "running", job_id)
with open(path + ".tmp", "w") as f:
    json.dump({"gpu": gpu, "util": 90, "memory": mem}, f)
os.replace(path + ".tmp", path)
time.sleep(duration * (2.0 if gpu in busy else 1.0))   # background load halves the speed
os.unlink(path)
with open(os.path.join(run_dir, "done", job_id), "w") as f:
    json.dump({"gpu": gpu, "start": start, "end": time.time()}, f)
"""


class _DirWatch:
    """inotify on a directory (any entry created, renamed in or removed): the state keeper wakes when a
    job starts or ends instead of polling (``$KEEPER_EVENTS=0``: poll only, as before)."""

    def __init__(self, directory: Path) -> None:
        import ctypes
        import ctypes.util

        self.fd = -1
        if os.environ.get("KEEPER_EVENTS", "1") == "0":
            return
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd >= 0 and libc.inotify_add_watch(fd, os.fsencode(directory), 0x100 | 0x80 | 0x200) >= 0:
            self.fd = fd  # IN_CREATE | IN_MOVED_TO | IN_DELETE

    def wait(self, timeout: float) -> None:
        import select

        if self.fd < 0:
            time.sleep(timeout)
            return
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if ready:
            with contextlib.suppress(BlockingIOError):
                os.read(self.fd, 65536)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)


class StateKeeper(threading.Thread):
    """Writes the fake NVML state: base fleet + background load + the load of running jobs.  It wakes when a
    job starts or ends (inotify on ``running/``), and every ``$KEEPER_POLL`` s (default 0.05) at the latest."""

    def __init__(self, fake: FakeEnv, run_dir: Path, busy: list[int]) -> None:
        super().__init__(daemon=True)
        self.fake, self.run_dir, self.busy = fake, run_dir, busy
        self.stop = threading.Event()
        self.writes: list[float] = []  # when the fake state was written (its lag after a job ends)

    def run(self) -> None:
        last = None
        watch = _DirWatch(self.run_dir / "running")
        try:
            self._loop(watch, last)
        finally:
            watch.close()

    def _loop(self, watch: _DirWatch, last: object) -> None:
        while not self.stop.is_set():
            gpus = make_gpus(8, memory_used=GiB, util_gpu=0, mig_mode=0)
            for b in self.busy:
                gpus[b].util_gpu, gpus[b].memory_used = 95, 40 * GiB
            for f in (self.run_dir / "running").iterdir():
                try:
                    job = json.loads(f.read_text())
                except (OSError, ValueError):
                    continue
                g = gpus[job["gpu"]]
                g.util_gpu = min(100, g.util_gpu + job["util"])
                g.memory_used = min(g.memory_total, g.memory_used + job["memory"])
            key = [(g.util_gpu, g.memory_used) for g in gpus]
            if key != last:
                write_state(self.fake.state, gpus)
                self.writes.append(time.time())
                last = key
            watch.wait(float(os.environ.get("KEEPER_POLL", "0.05")))


class LeaseLog(threading.Thread):
    """When each lease began and ended, as the kernel tells (inotify on the lock directory: a record renamed
    into place, a record removed), with the GPU it names: where a hand-over's time goes."""

    def __init__(self, directory: Path, gpus: list[str]) -> None:
        super().__init__(daemon=True)
        from gpusd.alloc.inotify import IN_DELETE, IN_MOVED_TO, Inotify

        directory.mkdir(parents=True, exist_ok=True)
        self.dir, self.index = directory, {uuid: i for i, uuid in enumerate(gpus)}
        self.ino = Inotify()
        self.ino.watch(directory, IN_DELETE | IN_MOVED_TO)
        self.kinds = (IN_MOVED_TO, IN_DELETE)
        self.gpu_of: dict[str, int] = {}
        self.taken: list[tuple[float, int]] = []  # (time, gpu)
        self.ended: list[tuple[float, int]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            if not self.ino.wait(0.1):
                continue
            now = time.time()
            for _, mask, raw in self.ino.read():
                name = raw.decode()
                if not (name.startswith("lease-") and name.endswith(".json")):
                    continue
                if mask & self.kinds[0]:
                    try:
                        dev = json.loads((self.dir / name).read_text())["devices"][0]
                    except (OSError, ValueError, KeyError, IndexError):
                        continue
                    if dev in self.index:
                        self.gpu_of[name] = self.index[dev]
                        self.taken.append((now, self.index[dev]))
                elif name in self.gpu_of:
                    self.ended.append((now, self.gpu_of.pop(name)))


def _after(events: list[tuple[float, int]], gpu: int, t: float, until: float) -> float | None:
    """The first time in ``events`` on ``gpu`` within [t, until]."""
    return min((e for e, g in events if g == gpu and t - 0.002 <= e <= until), default=None)


def makespan(fake: FakeEnv, jobs: int) -> None:
    rng = random.Random(7)
    specs = [(f"j{i:02d}", round(rng.uniform(0.3, 1.5), 2), rng.choice([4, 8, 16, 24]) * GiB) for i in range(jobs)]
    busy = [2, 5]
    print(f"\nMakespan: {jobs} jobs (0.3-1.5 s, 4-24 GiB) on 8 GPUs, GPUs {busy} busy with background load")
    results = {}
    for mode in ("round-robin", "gpusd run --wait"):
        run_dir = fake.tmp / f"makespan-{mode.split()[0]}"
        shutil.rmtree(run_dir, ignore_errors=True)
        (run_dir / "running").mkdir(parents=True)
        (run_dir / "done").mkdir()
        (run_dir / "busy.json").write_text(json.dumps(busy))
        (run_dir / "job.py").write_text(JOB)
        keeper = StateKeeper(fake, run_dir, busy)
        keeper.start()
        log = LeaseLog(Path(fake.env["GPUSD_LOCK_DIR"]), [g.uuid for g in make_gpus(8)])
        log.start()
        time.sleep(0.3)
        t0 = time.time()
        if mode == "round-robin":
            def lane(gpu: int) -> None:
                for jid, dur, mem in specs[gpu::8]:
                    subprocess.run([sys.executable, str(run_dir / "job.py"), str(run_dir),  # noqa: B023
                                    jid, str(dur), str(mem)],
                                   env=dict(fake.env, CUDA_VISIBLE_DEVICES=str(gpu)), check=True)
            lanes = [threading.Thread(target=lane, args=(g,)) for g in range(8)]
            for t in lanes:
                t.start()
            for t in lanes:
                t.join()
        else:
            procs = []
            for jid, dur, mem in specs:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "gpusd", "run", "-n", "1", "--wait",
                     "--max-util", os.environ.get("BENCH_MAX_UTIL", "50"),
                     "--memory", f"{mem}B", "--", sys.executable, str(run_dir / "job.py"), str(run_dir), jid, str(dur),
                     str(mem)], env=fake.env))
                time.sleep(0.01)  # submission order = queue order
            for p in procs:
                p.wait()
        end = time.time()
        keeper.stop.set()
        keeper.join()
        log.stop.set()
        log.join()
        done = [json.loads(f.read_text()) for f in (run_dir / "done").iterdir()]
        waits = [d["start"] - t0 for d in done]
        on_busy = sum(1 for d in done if d["gpu"] in busy)
        # hand-over: from the end of one job to the start of the next on the same GPU (the job's
        # own process start included), the time the scheduler leaves a GPU idle
        gaps, parts, lags = [], {"exit": [], "queue": [], "start": []}, []
        for g in {d["gpu"] for d in done}:
            runs = sorted((d["start"], d["end"]) for d in done if d["gpu"] == g)
            gaps += [b[0] - a[1] for a, b in zip(runs, runs[1:])]
            for a, b in zip(runs, runs[1:]):
                # job ends -> its lease ends (the job's exit, gpusd run's release) -> the next lease is
                # taken (the queue's wake-up and look) -> the next job starts (spawn, interpreter start)
                released = _after(log.ended, g, a[1], b[0])
                taken = _after(log.taken, g, released or a[1], b[0])
                if released is not None and taken is not None:
                    parts["exit"].append(released - a[1])
                    parts["queue"].append(taken - released)
                    parts["start"].append(b[0] - taken)
        for d in done:  # the fake's lag: a job's load stays in the fake NVML until the keeper writes again
            later = [w for w in keeper.writes if w >= d["end"]]
            if later:
                lags.append(later[0] - d["end"])
        results[mode] = (end - t0, sum(waits) / len(waits) if waits else float("nan"), on_busy, len(done),
                         p50(gaps) if gaps else 0.0, {k: p50(v) if v else float("nan") for k, v in parts.items()},
                         p50(lags) if lags else float("nan"))
    usable = [g for g in range(8) if g not in busy]
    free_at = dict.fromkeys(usable, 0.0)
    for _, dur, _ in specs:  # a zero-overhead first-come-first-served list schedule on the usable GPUs
        g = min(free_at, key=lambda k: free_at[k])
        free_at[g] += dur
    ideal = max(free_at.values())
    print(f"{'scheduler':22s} {'makespan s':>11s} {'mean wait s':>12s} {'jobs on busy GPUs':>18s} {'finished':>9s}"
          f" {'hand-over p50 ms':>17s}  {'exit/queue/start p50 ms':>24s} {'fake lag p50 ms':>16s}")
    for mode, (ms, mw, ob, nd, gap, part, lag) in results.items():
        split = "/".join(f"{part[k] * 1e3:.0f}" for k in ("exit", "queue", "start"))
        print(f"{mode:22s} {ms:11.2f} {mw:12.2f} {ob:18d} {nd:>5d}/{jobs} {gap * 1e3:17.0f}  {split:>24s}"
              f" {lag * 1e3:16.0f}")
    print(f"ideal (FIFO list schedule on the {len(usable)} usable GPUs, no overhead): {ideal:.2f} s; gpusd "
          f"{results['gpusd run --wait'][0] / ideal:.2f}x; the hand-over's floor is round-robin's (a job's exit "
          "and the next one's interpreter start, no scheduler)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--jobs", type=int, default=40)
    ap.add_argument("--handovers", type=int, default=20)
    ap.add_argument("--skip", action="append", default=[],
                    choices=["collisions", "latency", "handover", "makespan"])
    ap.add_argument("--rig", action="append", choices=["samples", "no-samples"],
                    help="latency rig(s) (default: both)")
    ap.add_argument("--tree", type=Path, action="append",
                    help="hand-over and makespan: a gpusd source tree (its src/) to run the waiters and jobs with, "
                         "beside this one's; repeatable, the trees alternate (e.g. a worktree of the base commit)")
    ap.add_argument("--repeat", type=int, default=1, help="hand-over and makespan: rounds (trees alternating)")
    args = ap.parse_args()
    fake = FakeEnv(fleet())
    print(f"fake NVML: 8 x NVIDIA A100-SXM4-80GB, lock dir {fake.env['GPUSD_LOCK_DIR']}")
    if "collisions" not in args.skip:
        collisions(fake, args.rounds)
    if "latency" not in args.skip:
        latency(fake, args.n, args.runs, args.rig or ["samples", "no-samples"])
    trees = [REPO / "src", *(t.resolve() / "src" for t in args.tree or [])]
    for r in range(args.repeat):
        for tree in trees if r % 2 == 0 else trees[::-1]:
            fake.env["PYTHONPATH"] = str(tree)  # the waiters' and jobs' gpusd (this process's stays this tree's)
            if len(trees) > 1:
                print(f"\n[tree {tree}]")
            if "handover" not in args.skip:
                handover(fake, args.handovers)
            if "makespan" not in args.skip:
                makespan(fake, args.jobs)
    shutil.rmtree(fake.tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
