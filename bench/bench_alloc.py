"""Issue 3 benchmark: collisions, selection latency and makespan, on a fake NVML with 8 GPUs.

    python bench/bench_alloc.py [--rounds 20] [--n 2000] [--runs 15] [--jobs 40] [--handovers 20] [--starts 8]
                                [--skip collisions|latency|handover|start|makespan] [--tree DIR ...] [--repeat N]
                                [--round-robin] [--no-daemon] [--loads 0,3]

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
directory), taking its lease in the lock directory and through a daemon as the lease authority, beside
the floor: the same command started by a plain ``Popen``.

Start: the CPU one supervisor process spends to start (until it is queued) and each second it waits,
one process at a time: ``gpusd run --wait`` (its own lease; through a daemon) beside a minimal Python
wrapper that waits on a pipe and then runs the command with ``subprocess`` (the floor of a per-job Python
process) and ``python -c pass``.

Makespan: 40 jobs of mixed length and memory on 8 GPUs, two of them busy with background load (jobs
there run at half speed); each job, while it runs, adds its load and memory to the fake state.  Side by
side in each round: the ideal (a zero-overhead FIFO list schedule on the 6 usable GPUs); ``oracle``, the
practical floor of this machine (the bench starts each job, the same job.py and environment, with a
plain Popen on the usable GPU that frees first: nothing gpusd knows, the same process starts);
``oracle+wrappers`` (the same oracle through the minimal Python wrapper per job, all 40 started at
submission like the gpusd runs: the start-up storm and a Python parent per job, nothing of gpusd);
``gpusd run --wait --max-util 50`` per job (``gpusd``), and the same with a daemon as the lease authority
(``gpusd+daemon``); ``--round-robin``: a static round-robin assignment over all 8 GPUs.  Each run's
makespan is split for the GPU that finished last (its first job's start, the jobs' run time, the gaps
between jobs, the tail), each hand-over (job end -> its lease ends -> the next lease is taken -> the
next job starts, p50), and the supervisor processes' own CPU by phase (starting, queued, running; the
job's own CPU taken out; the scheduler's counters, /proc/PID/task/*/schedstat) with the daemon's CPU.
Knobs for finding where a hand-over goes: ``$BENCH_MAX_UTIL`` (the jobs' ``--max-util``, default 50;
100: utilisation never holds a job back), ``$KEEPER_POLL`` (the fake state keeper's longest wait between
two looks at the running jobs, default 0.05 s) and ``$KEEPER_EVENTS=0`` (the keeper polls only, instead of
waking on inotify when a job starts or ends: a job's load and memory then stay in the fake NVML up to
KEEPER_POLL after it ends).

``--tree DIR`` (repeatable): run the hand-over's, start's and makespan's gpusd processes with that tree's
gpusd (``DIR/src``) as well as this one's, alternating, ``--repeat`` rounds (e.g. a worktree of the base
commit).  The daemon modes start a daemon of each tree on 127.0.0.1 only (we run as root: it is the lease
authority of the bench's lease socket).
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
    start_ready,
    stop,
    timeit_each,
    whole_process,
    write_state,
)
from _load import busy_load

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
    from gpusd.alloc.backend import close_all

    def ours() -> None:
        gpusd.select(count=1, lease=False)

    def ours_lease() -> None:
        gpusd.select(count=1).release()

    for rig in rigs:
        rig_fake = fake if rig == "samples" else FakeEnv(fleet_no_samples())
        rig_fake.activate_in_process()
        close_all()  # a fresh backend per rig (it remembers what is unsupported)
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


def handover_run(fake: FakeEnv, rounds: int, tree: Path) -> dict[str, list[float]]:
    """``rounds`` hand-overs with ``tree``'s gpusd: in process, through ``gpusd run --wait`` (split at the
    lease taken) taking its lease in the lock directory and through a daemon as the lease authority, and
    the floor (a plain Popen of the same command) beside each."""
    fake.activate_in_process()
    os.environ.update(fake.env)
    from gpusd.alloc import queue
    from gpusd.alloc.leases import LeaseStore

    write_state(fake.state, make_gpus(1, mig_mode=0))
    env = dict(fake.env, GPUSD_LEASE_SOCKET="off", PYTHONPATH=str(tree))
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
    # lease taken (the queue) -> the command's first line (the supervisor's start of it + the interpreter).
    # Then through a daemon as the lease authority (it queues the job and takes its lease).
    job = [sys.executable, "-c", "import time; print(time.time(), flush=True)"]
    out: dict[str, list[float]] = {"gpusd.select(wait=True), in process": delays}
    floor: list[float] = []
    for via in ("gpusd run --wait", "daemon: gpusd run --wait"):
        daemon, lock_dir, run_env = None, Path(env["GPUSD_LOCK_DIR"]), env
        if via.startswith("daemon"):
            daemon, lock_dir = _daemon(fake, tree)
            run_env = dict(env, GPUSD_LEASE_SOCKET=fake.env["GPUSD_LEASE_SOCKET"])
        log = LeaseLog(lock_dir, [make_gpus(1)[0].uuid])
        log.start()
        runs = []
        for _ in range(rounds):
            lease = store.acquire([make_gpus(1)[0].uuid])
            assert lease is not None
            p = subprocess.Popen([sys.executable, "-m", "gpusd", "run", "-n", "1", "--wait", "--timeout", "60", "--",
                                  *job], env=run_env, stdout=subprocess.PIPE, text=True)
            while not queue.waiting(store):  # the shared directory's queue, or the authority's (its peer)
                time.sleep(0.01)
            time.sleep(rng.uniform(0.2, 0.5))
            t = time.time()
            lease.release()
            got = float(p.stdout.readline())
            p.wait()
            taken = _after(log.taken, 0, t, got)
            runs.append((got - t, (taken - t) if taken else float("nan"), (got - taken) if taken else float("nan")))
            if not daemon:
                t = time.time()
                q = subprocess.Popen(job, env=env, stdout=subprocess.PIPE, text=True)
                floor.append(float(q.stdout.readline()) - t)
                q.wait()
        log.stop.set()
        log.join()
        if daemon is not None:
            stop(daemon)
        tag = "daemon: " if daemon else ""
        out[f"{via}: lease end -> command runs"] = [r[0] for r in runs]
        out[f"  {tag}of which lease end -> next lease taken"] = [r[1] for r in runs]
        out[f"  {tag}of which lease taken -> command runs"] = [r[2] for r in runs]
    out["floor: Popen of the same command -> it runs"] = floor
    write_state(fake.state, fleet())
    return out


def handover(fake: FakeEnv, rounds: int, trees: list[Path], repeat: int) -> None:
    print(f"\nHand-over: a lease ends, the waiter at the head of the queue gets the GPU ({rounds} hand-overs a "
          f"column, p50 (p90) ms; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
    cols: list[tuple[str, dict[str, list[float]]]] = []
    for r in range(repeat):
        for tree in trees if r % 2 == 0 else trees[::-1]:
            cols.append((_tree_name(tree), handover_run(fake, rounds, tree)))
    print(f"{'':52s}" + "".join(f" {name[:16]:>16s}" for name, _ in cols))
    for key in cols[0][1]:
        cells = []
        for _, res in cols:
            vals = sorted(v for v in res[key] if v == v)
            cells.append(f"{p50(vals) * 1e3:.1f} ({vals[int(0.9 * (len(vals) - 1))] * 1e3:.1f})" if vals else "-")
        print(f"{key:52s}" + "".join(f" {c:>16s}" for c in cells))


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
    json.dump({"gpu": gpu, "start": start, "end": time.time(), "cpu": time.process_time(), "pid": os.getpid()}, f)
"""

# The second floor's supervisor: the least a Python process per job can be.  Started at submission like a
# `gpusd run`, it says when it is ready (its CPU then), sleeps on its pipe until the oracle names a GPU,
# then starts the job with subprocess.Popen and waits for it, as gpusd run does.
WRAPPER = r"""
import os, subprocess, sys, time
with open(sys.argv[1], "w") as f:
    f.write(repr(time.process_time()))
gpu = sys.stdin.readline().strip()
if gpu:
    sys.exit(subprocess.Popen(sys.argv[2:], env=dict(os.environ, CUDA_VISIBLE_DEVICES=gpu)).wait())
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


def _cpu(pid: int) -> tuple[float, float] | None:
    """(CPU seconds, seconds spent runnable but waiting for a CPU) of process ``pid`` so far, all its
    threads (the scheduler's own counters, /proc/PID/task/*/schedstat: nanoseconds)."""
    used = delay = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError):
                with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                    run, wait, _ = f.read().split()
                used, delay = used + int(run), delay + int(wait)
    except OSError:
        return None
    return used / 1e9, delay / 1e9


class LeaseLog(threading.Thread):
    """When each lease began and ended, as the kernel tells (inotify on the lock directory: a record renamed
    into place, a record removed), with the GPU it names: where a hand-over's time goes.  With ``sample``,
    also when each process joined the queue (its ticket renamed into place) and took its lease, and its CPU
    and its wait for a CPU (:func:`_cpu`) at those two moments."""

    def __init__(self, directory: Path, gpus: list[str], sample: bool = False) -> None:
        super().__init__(daemon=True)
        from gpusd.alloc.inotify import IN_DELETE, IN_MOVED_TO, Inotify

        directory.mkdir(parents=True, exist_ok=True)
        self.dir, self.index, self.sample = directory, {uuid: i for i, uuid in enumerate(gpus)}, sample
        self.ino = Inotify()
        self.ino.watch(directory, IN_DELETE | IN_MOVED_TO)
        self.kinds = (IN_MOVED_TO, IN_DELETE)
        self.gpu_of: dict[str, int] = {}
        self.taken: list[tuple[float, int]] = []  # (time, gpu)
        self.ended: list[tuple[float, int]] = []
        self.queued_at: dict[int, tuple[float, tuple[float, float] | None]] = {}  # pid -> (time, _cpu)
        self.leased_at: dict[int, tuple[float, tuple[float, float] | None]] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            if not self.ino.wait(0.1):
                continue
            now = time.time()
            for _, mask, raw in self.ino.read():
                name = raw.decode()
                if self.sample and mask & self.kinds[0] and name.startswith("queue-") and name.endswith(".ticket"):
                    with contextlib.suppress(IndexError, ValueError, OSError, KeyError):
                        pid = int(name.split("-")[2])
                        if self.dir.name == "authority":  # the daemon's ticket names the client inside
                            pid = int(json.loads((self.dir / name).read_text())["pid"])
                        self.queued_at.setdefault(pid, (now, _cpu(pid)))
                    continue
                if not (name.startswith("lease-") and name.endswith(".json")):
                    continue
                if mask & self.kinds[0]:
                    if name in self.gpu_of:
                        continue  # a record rewritten: not a new lease
                    try:
                        record = json.loads((self.dir / name).read_text())
                        dev = record["devices"][0]
                    except (OSError, ValueError, KeyError, IndexError):
                        continue
                    if dev in self.index:
                        self.gpu_of[name] = self.index[dev]
                        self.taken.append((now, self.index[dev]))
                        if self.sample and isinstance(record.get("pid"), int):
                            self.leased_at.setdefault(record["pid"], (now, _cpu(record["pid"])))
                elif name in self.gpu_of:
                    self.ended.append((now, self.gpu_of.pop(name)))


def _after(events: list[tuple[float, int]], gpu: int, t: float, until: float) -> float | None:
    """The first time in ``events`` on ``gpu`` within [t, until]."""
    return min((e for e, g in events if g == gpu and t - 0.002 <= e <= until), default=None)


def _machine_cpu() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot, every process on the machine counted."""
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    return sum(vals) - idle, sum(vals)


class Run:
    """What one makespan run measured."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.t0 = self.end = 0.0
        self.done: list[dict] = []
        self.cpu_busy = 0.0  # share of the machine's CPU time busy (any process) during the run
        self.own: list[dict] = []  # per supervisor process (gpusd run, the wrapper): its CPU by phase
        self.log: LeaseLog | None = None
        self.lags: list[float] = []
        self.daemon_cpu: float | None = None  # the lease authority's CPU seconds during the run

    @property
    def makespan(self) -> float:
        return self.end - self.t0


def _spawn_all(cmds: list[list[str]], env: dict, spawned: dict[int, float] | None = None,
               **kw) -> list[subprocess.Popen]:
    procs = []
    for cmd in cmds:
        procs.append(subprocess.Popen(cmd, env=env, **kw))
        if spawned is not None:
            spawned[procs[-1].pid] = time.time()
        time.sleep(0.01)  # submission order = queue order
    return procs


def _reap(proc: subprocess.Popen) -> float:
    """Wait for ``proc``; its CPU seconds and its waited-for children's."""
    _, status, ru = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return ru.ru_utime + ru.ru_stime


def _daemon(fake: FakeEnv, tree: Path) -> tuple[subprocess.Popen, Path]:
    """A gpusd daemon of ``tree`` on the fake NVML, on 127.0.0.1 only, serving the bench's lease socket:
    the lease authority (we run as root), which the jobs' ``gpusd run`` then ask for their leases."""
    state = fake.tmp / f"daemon-{random.getrandbits(32):08x}"
    state.mkdir()
    env = dict(fake.env, PYTHONPATH=str(tree), GPUSD_INTERFACES="127.0.0.1", GPUSD_STATE_DIR=str(state))
    proc, _ = start_ready([sys.executable, "-m", "gpusd", "start", "--foreground", "--interface", "127.0.0.1",
                           "--port", "0", "--session", f"bench-{random.getrandbits(24):06x}", "--interval", "1",
                           "--hostname", "bench-host", "--no-record"], env, state / "gpusd.log")
    if not Path(fake.env["GPUSD_LEASE_SOCKET"]).exists():
        stop(proc)
        tail = (state / "gpusd.log").read_text()[-3000:]
        raise SystemExit(f"the daemon did not become the lease authority; log:\n{tail}")
    return proc, Path(fake.env["GPUSD_LOCK_DIR"]) / "authority"


def makespan_run(fake: FakeEnv, mode: str, specs: list, busy: list[int], tree: Path | None = None) -> Run:
    """One run of the 40 jobs.  ``mode``: ``gpusd`` (a ``gpusd run --wait`` per job, from ``tree``, each
    taking its lease in the lock directory), ``gpusd+daemon`` (the same, with a daemon of ``tree`` as the
    lease authority: the jobs ask it for their leases, it queues them), ``oracle`` (the bench starts each
    job with a plain Popen on the usable GPU that frees first, in submission order: what this machine
    can do with no scheduler but the jobs' own process starts), ``oracle+wrappers`` (the same oracle, but
    through a minimal Python supervisor per job started at submission like a gpusd run: the start-up storm
    and the fork of a per-job Python process, nothing of gpusd) or ``round-robin`` (a static assignment
    over all 8 GPUs)."""
    run = Run(mode)
    run_dir = fake.tmp / f"makespan-{mode.replace('+', '-')}"
    shutil.rmtree(run_dir, ignore_errors=True)
    for sub in ("running", "done", "ready"):
        (run_dir / sub).mkdir(parents=True)
    (run_dir / "busy.json").write_text(json.dumps(busy))
    (run_dir / "job.py").write_text(JOB)
    (run_dir / "wrapper.py").write_text(WRAPPER)
    env = dict(fake.env)
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    daemon, lock_dir = None, Path(fake.env["GPUSD_LOCK_DIR"])
    if mode == "gpusd+daemon":
        assert tree is not None
        daemon, lock_dir = _daemon(fake, tree)
    keeper = StateKeeper(fake, run_dir, busy)
    keeper.start()
    log = LeaseLog(lock_dir, [g.uuid for g in make_gpus(8)], sample=mode.startswith("gpusd"))
    log.start()
    job = [sys.executable, str(run_dir / "job.py"), str(run_dir)]
    time.sleep(0.3)
    cpu0 = _machine_cpu()
    daemon_cpu0 = _cpu(daemon.pid) if daemon is not None else None
    run.t0 = time.time()
    lanes: list[threading.Thread] = []
    if mode == "round-robin":
        def lane(gpu: int) -> None:
            for jid, dur, mem in specs[gpu::8]:
                subprocess.run([*job, jid, str(dur), str(mem)],  # noqa: B023
                               env=dict(env, CUDA_VISIBLE_DEVICES=str(gpu)), check=True)
        lanes = [threading.Thread(target=lane, args=(g,)) for g in range(8)]
    elif mode.startswith("oracle"):
        todo = list(range(len(specs)))
        lock = threading.Lock()
        wrappers: list[subprocess.Popen] = []
        if mode == "oracle+wrappers":
            wrappers = _spawn_all([[sys.executable, str(run_dir / "wrapper.py"), str(run_dir / "ready" / jid), *job,
                                    jid, str(dur), str(mem)] for jid, dur, mem in specs], env, stdin=subprocess.PIPE)
        cpus: dict[int, float] = {}

        def lane(gpu: int) -> None:
            while True:
                with lock:  # noqa: B023
                    if not todo:  # noqa: B023
                        return
                    i = todo.pop(0)  # noqa: B023
                jid, dur, mem = specs[i]
                if wrappers:  # noqa: B023
                    w = wrappers[i]  # noqa: B023
                    assert w.stdin is not None
                    w.stdin.write(f"{gpu}\n".encode())
                    w.stdin.close()
                    cpus[i] = _reap(w)  # noqa: B023
                else:
                    cpus[i] = _reap(subprocess.Popen([*job, jid, str(dur), str(mem)],  # noqa: B023
                                                     env=dict(env, CUDA_VISIBLE_DEVICES=str(gpu))))
        lanes = [threading.Thread(target=lane, args=(g,)) for g in range(8) if g not in busy]
    else:
        spawned: dict[int, float] = {}
        procs = _spawn_all([[sys.executable, "-m", "gpusd", "run", "-n", "1", "--wait",
                             "--max-util", os.environ.get("BENCH_MAX_UTIL", "50"), "--memory", f"{mem}B", "--", *job,
                             jid, str(dur), str(mem)] for jid, dur, mem in specs], env, spawned)
        total = {p.pid: _reap(p) for p in procs}
    for t in lanes:
        t.start()
    for t in lanes:
        t.join()
    run.end = time.time()
    cpu1 = _machine_cpu()
    run.cpu_busy = (cpu1[0] - cpu0[0]) / max(1, cpu1[1] - cpu0[1])
    if daemon is not None:
        got = _cpu(daemon.pid)
        if got is not None and daemon_cpu0 is not None:
            run.daemon_cpu = got[0] - daemon_cpu0[0]
        stop(daemon)
    keeper.stop.set()
    keeper.join()
    log.stop.set()
    log.join()
    run.log = log
    by_jid = {f.name: json.loads(f.read_text()) for f in (run_dir / "done").iterdir()}
    run.done = list(by_jid.values())
    if mode.startswith("gpusd"):
        for p, (jid, _, _) in zip(procs, specs):
            d = by_jid.get(jid)
            q, le = log.queued_at.get(p.pid), log.leased_at.get(p.pid)
            if d is None or q is None or le is None or q[1] is None or le[1] is None:
                continue
            own = total[p.pid] - d["cpu"]
            run.own.append({"start": q[1][0], "delay": q[1][1], "wait": le[1][0] - q[1][0], "run": own - le[1][0],
                            "own": own})
    elif mode == "oracle+wrappers":
        for i, (jid, _, _) in enumerate(specs):
            d = by_jid.get(jid)
            try:
                ready = float((run_dir / "ready" / jid).read_text())
            except (OSError, ValueError):
                continue
            if d is not None and i in cpus:
                own = cpus[i] - d["cpu"]
                run.own.append({"start": ready, "wait": 0.0, "run": own - ready, "own": own})
    for d in run.done:  # the fake's lag: a job's load stays in the fake NVML until the keeper writes again
        later = [w for w in keeper.writes if w >= d["end"]]
        if later:
            run.lags.append(later[0] - d["end"])
    return run


def start_cost(fake: FakeEnv, trees: list[Path], n: int) -> None:
    """The CPU one supervisor process spends to start (until it is queued) and each second it waits, one
    process at a time (no storm): a minimal Python wrapper (the floor), ``gpusd run --wait`` taking its
    lease in the lock directory, and through a daemon as the lease authority; every GPU is leased by the
    bench meanwhile, so that each queues.  CPU time, not wall time: the other sessions' load moves it less."""
    from gpusd.alloc.leases import LeaseStore

    fake.activate_in_process()
    store = LeaseStore(fake.env["GPUSD_LOCK_DIR"])
    held = [store.acquire([g.uuid]) for g in make_gpus(8)]
    run_dir = fake.tmp / "start-cost"
    shutil.rmtree(run_dir, ignore_errors=True)
    (run_dir / "ready").mkdir(parents=True)
    (run_dir / "wrapper.py").write_text(WRAPPER)
    cmd = ["-m", "gpusd", "run", "-n", "1", "--wait", "--", "true"]
    rows: list[tuple[str, list[float], list[float], list[float]]] = []
    base = [_reap(subprocess.Popen([sys.executable, "-c", "pass"], env=fake.env)) for _ in range(n)]
    rows.append(("python -c pass (whole process)", base, [], []))
    starts, waits, totals = [], [], []
    for i in range(n):
        ready = run_dir / "ready" / str(i)
        w = subprocess.Popen([sys.executable, str(run_dir / "wrapper.py"), str(ready), "true"], env=fake.env,
                             stdin=subprocess.PIPE)
        while not ready.exists() or not ready.read_text():
            time.sleep(0.005)
        c0 = _cpu(w.pid)
        time.sleep(1.0)
        c1 = _cpu(w.pid)
        assert w.stdin is not None
        w.stdin.close()
        totals.append(_reap(w))
        starts.append(float(ready.read_text()))
        if c0 and c1:
            waits.append(c1[0] - c0[0])
    rows.append(("wrapper (the floor)", starts, waits, totals))
    for tree in trees:
        for mode in ("gpusd", "gpusd+daemon"):
            env = dict(fake.env, PYTHONPATH=str(tree))
            daemon, lock_dir = (_daemon(fake, tree) if mode == "gpusd+daemon"
                                else (None, Path(fake.env["GPUSD_LOCK_DIR"])))
            log = LeaseLog(lock_dir, [], sample=True)
            log.start()
            starts, waits, totals = [], [], []
            for _ in range(n):
                p = subprocess.Popen([sys.executable, *cmd], env=env, stderr=subprocess.DEVNULL)
                end = time.monotonic() + 30
                while p.pid not in log.queued_at and time.monotonic() < end:
                    time.sleep(0.005)
                c0 = log.queued_at.get(p.pid, (0.0, None))[1]
                time.sleep(1.0)
                c1 = _cpu(p.pid)
                p.send_signal(15)
                totals.append(_reap(p))
                if c0 and c1:
                    starts.append(c0[0])
                    waits.append(c1[0] - c0[0])
            log.stop.set()
            log.join()
            if daemon is not None:
                stop(daemon)
            rows.append((f"{mode} [{_tree_name(tree)}]", starts, waits, totals))
    for lease in held:
        if lease is not None:
            lease.release()
    print(f"\nOne supervisor process alone, CPU ms (p50 of {n}; min): to start until queued, each second queued, "
          f"whole process (stopped after 1 s queued); load average {os.getloadavg()[0]:.1f}")
    print(f"{'':34s} {'start':>16s} {'queued, per s':>16s} {'whole':>16s}")

    def cell(vals: list[float]) -> str:
        return f"{p50(vals) * 1e3:.1f} ({min(vals) * 1e3:.1f})" if vals else "-"

    for name, a_, b_, c_ in rows:
        print(f"{name:34s} {cell(a_):>16s} {cell(b_):>16s} {cell(c_):>16s}")


def _split(run: Run) -> dict:
    """Where the makespan goes, GPU by GPU: the first job's start (the ramp), the jobs' own run time,
    the gaps between one job's end and the next one's start (the hand-overs), and the tail (the last
    job's end -> every process exited); for the GPU that finished last, and the means."""
    per = {}
    for g in {d["gpu"] for d in run.done}:
        runs = sorted((d["start"], d["end"]) for d in run.done if d["gpu"] == g)
        gaps = [b[0] - a[1] for a, b in zip(runs, runs[1:])]
        per[g] = (runs[0][0] - run.t0, sum(e - s for s, e in runs), gaps, runs[-1][1])
    last = max(per, key=lambda g: per[g][3])
    ramp, busy, gaps, end = per[last]
    parts: dict[str, list[float]] = {"exit": [], "queue": [], "start": []}
    if run.log is not None and run.log.taken:
        for g in per:
            runs = sorted((d["start"], d["end"]) for d in run.done if d["gpu"] == g)
            for a, b in zip(runs, runs[1:]):
                # job ends -> its lease ends (the job's exit, gpusd run's release) -> the next lease is
                # taken (the queue's wake-up and look) -> the next job starts (spawn, interpreter start)
                released = _after(run.log.ended, g, a[1], b[0])
                taken = _after(run.log.taken, g, released or a[1], b[0])
                if released is not None and taken is not None:
                    parts["exit"].append(released - a[1])
                    parts["queue"].append(taken - released)
                    parts["start"].append(b[0] - taken)
    all_gaps = [x for v in per.values() for x in v[2]]
    return {"ramp": ramp, "busy": busy, "gaps": sum(gaps), "n_gaps": len(gaps), "tail": run.end - end,
            "ramp_mean": sum(v[0] for v in per.values()) / len(per),
            "ramp_max": max(v[0] for v in per.values()),
            "gap_p50": p50(all_gaps) if all_gaps else float("nan"),
            "parts": {k: p50(v) if v else float("nan") for k, v in parts.items()}}


def makespan(fake: FakeEnv, jobs: int, trees: list[Path], rounds: int, round_robin: bool = False,
             daemon: bool = True) -> None:
    """The makespan of ``jobs`` queued jobs, gpusd (each tree) beside the ideal and two floors measured
    in the same run, ``rounds`` times, the order of the trees alternating."""
    rng = random.Random(7)
    specs = [(f"j{i:02d}", round(rng.uniform(0.3, 1.5), 2), rng.choice([4, 8, 16, 24]) * GiB) for i in range(jobs)]
    busy = [2, 5]
    usable = [g for g in range(8) if g not in busy]
    free_at = dict.fromkeys(usable, 0.0)
    for _, dur, _ in specs:  # a zero-overhead first-come-first-served list schedule on the usable GPUs
        g = min(free_at, key=lambda k: free_at[k])
        free_at[g] += dur
    ideal = max(free_at.values())
    print(f"\nMakespan: {jobs} jobs (0.3-1.5 s, 4-24 GiB) on 8 GPUs, GPUs {busy} busy with background load; "
          f"ideal (FIFO list schedule on the {len(usable)} usable GPUs, no overhead) {ideal:.2f} s")
    print("  oracle: the bench starts each job (plain Popen) on the usable GPU that frees first; oracle+wrappers: "
          "the same, through a minimal\n  Python supervisor per job started at submission like a gpusd run "
          "(the start-up storm and a per-job Python parent, nothing of gpusd)")
    head = (f"{'':28s} {'makespan':>8s} {'x ideal':>7s} {'mean':>5s} {'ramp':>5s} {'ramp':>5s}"
            f" {'crit. GPU: ramp+run+gaps+tail':>31s} {'gap':>4s} {'exit/queue/start':>16s} {'CPU':>4s} {'lag':>4s}")
    head2 = (f"{'':28s} {'s':>8s} {'':>7s} {'wait':>5s} {'mean':>5s} {'max':>5s} {'s':>31s} {'p50':>4s} {'p50 ms':>16s}"
             f" {'busy':>4s} {'ms':>4s}")
    cpu_rows: list[str] = []
    for r in range(rounds):
        print(f"\nround {r + 1}/{rounds}, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        print(head)
        print(head2)
        order = trees if r % 2 == 0 else trees[::-1]
        modes: list[tuple[str, Path | None]] = [("oracle", None), ("oracle+wrappers", None)]
        modes += [(m, t) for t in order for m in ("gpusd", "gpusd+daemon")[:2 if daemon else 1]]
        if round_robin:
            modes.append(("round-robin", None))
        for mode, tree in modes:
            run = makespan_run(fake, mode, specs, busy, tree)
            s = _split(run)
            label = mode if tree is None else f"{mode} [{_tree_name(tree)}]"
            waits = [d["start"] - run.t0 for d in run.done]
            parts = "/".join(f"{s['parts'][k] * 1e3:.0f}" for k in ("exit", "queue", "start"))
            crit = f"{s['ramp']:.2f}+{s['busy']:.2f}+{s['gaps']:.2f}({s['n_gaps']})+{s['tail']:.2f}"
            lag = p50(run.lags) * 1e3 if run.lags else float("nan")
            print(f"{label:28s} {run.makespan:8.2f} {run.makespan / ideal:7.2f} {sum(waits) / len(waits):5.2f}"
                  f" {s['ramp_mean']:5.2f} {s['ramp_max']:5.2f} {crit:>31s} {s['gap_p50'] * 1e3:4.0f}"
                  f" {parts if run.log and run.log.taken else '':>16s} {run.cpu_busy * 100:3.0f}% {lag:4.0f}"
                  + ("" if len(run.done) == jobs else f"  only {len(run.done)}/{jobs} finished")
                  + (f"  {sum(1 for d in run.done if d['gpu'] in busy)} on busy GPUs"
                     if mode != "round-robin" and any(d["gpu"] in busy for d in run.done) else ""))
            if run.own:
                own = run.own
                med = {k: p50([o[k] for o in own]) * 1e3 for k in own[0]}
                cpu_rows.append(f"{label:28s} {len(own):3d} {med['own']:7.1f} {med['start']:7.1f}"
                                f" {med.get('delay', float('nan')):7.1f} {med['wait']:7.1f} {med['run']:7.1f}"
                                f" {sum(o['own'] for o in own):7.2f}"
                                + (f" {run.daemon_cpu:7.2f}" if run.daemon_cpu is not None else ""))
    print("\nThe supervisor processes' own CPU (the job's own CPU taken out), p50 per process, ms; and the sum, s")
    print("  start: until it joined the queue (gpusd: its ticket; the wrapper: ready); cpu-wait: how long it was")
    print("  runnable but waiting for a CPU during its start; waiting: in the queue; run: its lease taken -> its exit")
    print("  daemon: the lease authority's own CPU during the run, s")
    print(f"{'':28s} {'n':>3s} {'own':>7s} {'start':>7s} {'cpu-wait':>7s} {'waiting':>7s} {'run':>7s} {'sum s':>7s}"
          f" {'daemon':>7s}")
    for row in cpu_rows:
        print(row)
    print("the hand-over's floor is oracle's gap (a job's exit and the next one's interpreter start, no scheduler)")


def _tree_name(tree: Path) -> str:
    return "this tree" if tree == REPO / "src" else tree.parent.name


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--jobs", type=int, default=40)
    ap.add_argument("--handovers", type=int, default=20)
    ap.add_argument("--skip", action="append", default=[],
                    choices=["collisions", "latency", "handover", "start", "makespan"])
    ap.add_argument("--loads", default="0", help="start and makespan: busy loops running meanwhile, comma-separated "
                    "(e.g. 0,3: at rest, then beside three busy loops the bench starts and stops, bench/_load.py)")
    ap.add_argument("--starts", type=int, default=8, help="start: processes measured one at a time, per kind")
    ap.add_argument("--rig", action="append", choices=["samples", "no-samples"],
                    help="latency rig(s) (default: both)")
    ap.add_argument("--tree", type=Path, action="append",
                    help="hand-over and makespan: a gpusd source tree (its src/) to run the waiters and jobs with, "
                         "beside this one's; repeatable, the trees alternate (e.g. a worktree of the base commit)")
    ap.add_argument("--repeat", type=int, default=1, help="hand-over and makespan: rounds (trees alternating)")
    ap.add_argument("--round-robin", action="store_true",
                    help="makespan: a static round-robin assignment over the 8 GPUs too (the floor of issue 3's table)")
    ap.add_argument("--no-daemon", action="store_true",
                    help="makespan: not through a daemon as the lease authority (only each job's own lease)")
    args = ap.parse_args()
    fake = FakeEnv(fleet())
    print(f"fake NVML: 8 x NVIDIA A100-SXM4-80GB, lock dir {fake.env['GPUSD_LOCK_DIR']}")
    if "collisions" not in args.skip:
        collisions(fake, args.rounds)
    if "latency" not in args.skip:
        latency(fake, args.n, args.runs, args.rig or ["samples", "no-samples"])
    trees = [REPO / "src", *(t.resolve() / "src" for t in args.tree or [])]
    if "handover" not in args.skip:
        handover(fake, args.handovers, trees, args.repeat)
    for load in [int(x) for x in args.loads.split(",") if x.strip()] or [0]:
        with busy_load(load):
            if load:
                print(f"\n== with {load} busy loops running (bench/_load.py) ==")
            if "start" not in args.skip:
                start_cost(fake, trees, args.starts)
            if "makespan" not in args.skip:
                makespan(fake, args.jobs, trees, args.repeat, args.round_robin, not args.no_daemon)
    shutil.rmtree(fake.tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
