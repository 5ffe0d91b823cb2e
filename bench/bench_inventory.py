"""Issue 2 benchmark: one snapshot of 8 GPUs, in-process and as a whole process.

    python bench/bench_inventory.py [--n 2000] [--runs 15] [--rig samples|no-samples] [--before SRC]

In-process, on the same fake NVML with 8 GPUs: gpusd's snapshot versus nvitop's ``Device.all()``
reading the same fields, gpustat's ``GPUStatCollection.new_query()``, and the floor — raw
nvidia-ml-py making the NVML calls gpusd makes for each GPU, on cached handles (:func:`_floor`; the
device count gpusd reads once per snapshot is its own, shown apart).  gpusd's snapshot is measured
through nvidia-ml-py (the daemon's binding: the like-for-like figure against the floor, issue 24's
goal) and through gpusd.inventory.nvmlfast (what a backend without telemetry calls: the quick
commands).  Each is timed against the floor call by call in turn (one of each, n times: a pair), so
that the load of the machine falls on them alike; the figures are medians.  Two rigs, one after the
other:

* ``samples``: the driver keeps a utilisation sample buffer (``nvmlDeviceGetSamples``); 2 processes on
  every GPU;
* ``no-samples``: ``nvmlDeviceGetSamples`` answers NOT_SUPPORTED (gpusd builds the 5 s window from its
  own readings, one per call); processes on 5 of the 8 GPUs.

``--before SRC``: then the floor and the snapshot through nvidia-ml-py again, in child processes running
this tree and the gpusd of SRC (a worktree of the base commit) in turn, ``--rounds`` times each.

Whole process (first rig only): ``gpusd devices --json`` versus ``gpustat --json`` and ``nvitop -1``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from _common import FakeEnv, FakeProcess, make_gpus, p50, timeit_each, whole_process

GiB = 2**30


def gpus8():
    gpus = make_gpus(8, memory_used=12 * GiB, util_gpu=35, util_memory=10, temperature=50, power_usage=180_000,
                     mig_mode=0)
    for g in gpus:
        g.processes = [FakeProcess(os.getpid(), 4 * GiB), FakeProcess(os.getppid(), 2 * GiB)]
    return gpus


def gpus8_no_samples():
    """A driver without a sample buffer; processes on GPUs 0-4 only."""
    gpus = make_gpus(8, memory_used=12 * GiB, util_gpu=35, util_memory=10, temperature=50, power_usage=180_000,
                     mig_mode=0, errors={"nvmlDeviceGetSamples": 3})
    for g in gpus[:5]:
        g.processes = [FakeProcess(os.getpid(), 4 * GiB), FakeProcess(os.getppid(), 2 * GiB)]
    return gpus


RIGS = {"samples": gpus8, "no-samples": gpus8_no_samples}


def interleaved(fns: list[Callable[[], object]], n: int, warmup: int = 50) -> list[float]:
    """The median seconds per call of each of ``fns``, called one after the other, ``n`` times."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    clock = time.perf_counter
    for _ in range(n):
        for i, fn in enumerate(fns):
            t = clock()
            fn()
            times[i].append(clock() - t)
    return [p50(t) for t in times]


def _backend(bindings: str) -> object:
    """An NvmlBackend through ``bindings`` (``nvidia-ml-py``, or ``auto``: gpusd.inventory.nvmlfast where this
    tree has it; an older tree ignores the setting and calls nvidia-ml-py)."""
    from gpusd.inventory.nvml import NvmlBackend

    old = os.environ.get("GPUSD_NVML_BINDINGS")
    os.environ["GPUSD_NVML_BINDINGS"] = bindings
    try:
        return NvmlBackend()
    finally:
        if old is None:
            del os.environ["GPUSD_NVML_BINDINGS"]
        else:
            os.environ["GPUSD_NVML_BINDINGS"] = old


def _floor(args: argparse.Namespace, rig: str) -> tuple[Callable[[], None], int]:
    """The floor: the NVML calls gpusd's snapshot makes for each GPU, raw nvidia-ml-py calls on cached
    handles: memory, utilisation, temperature, power, power limit, compute mode, MIG mode, the compute
    and graphics process lists (fan speed: not supported on these fake GPUs, which gpusd then stops
    asking); where the driver keeps a sample buffer (rig ``samples``, and ``--real``), also its samples
    since the last one seen, as gpusd reads them.  Not the device count gpusd reads once per snapshot
    (to see GPUs come and go): that call is gpusd's own, shown apart (:func:`_count`)."""
    import pynvml

    pynvml.nvmlInit()
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    last_seen = [0] * len(handles)  # the newest driver sample seen, per GPU (microseconds)
    samples_kind = pynvml.NVML_GPU_UTILIZATION_SAMPLES

    def samples(i: int, h: object) -> None:
        try:
            _, got = pynvml.nvmlDeviceGetSamples(h, samples_kind, last_seen[i])
        except pynvml.NVMLError_NotFound:  # no sample since the last one seen (gpusd reads it so too)
            return
        if got:
            last_seen[i] = got[-1].timeStamp

    def floor() -> None:  # straight-line calls: nothing but the bindings' own cost
        for h in handles:
            pynvml.nvmlDeviceGetMemoryInfo(h)
            pynvml.nvmlDeviceGetUtilizationRates(h)
            pynvml.nvmlDeviceGetTemperature(h, 0)
            pynvml.nvmlDeviceGetPowerUsage(h)
            pynvml.nvmlDeviceGetEnforcedPowerLimit(h)
            pynvml.nvmlDeviceGetComputeMode(h)
            pynvml.nvmlDeviceGetMigMode(h)
            pynvml.nvmlDeviceGetComputeRunningProcesses(h)
            pynvml.nvmlDeviceGetGraphicsRunningProcesses(h)

    def floor_samples() -> None:
        for i, h in enumerate(handles):
            pynvml.nvmlDeviceGetMemoryInfo(h)
            pynvml.nvmlDeviceGetUtilizationRates(h)
            pynvml.nvmlDeviceGetTemperature(h, 0)
            pynvml.nvmlDeviceGetPowerUsage(h)
            pynvml.nvmlDeviceGetEnforcedPowerLimit(h)
            pynvml.nvmlDeviceGetComputeMode(h)
            pynvml.nvmlDeviceGetMigMode(h)
            pynvml.nvmlDeviceGetComputeRunningProcesses(h)
            pynvml.nvmlDeviceGetGraphicsRunningProcesses(h)
            samples(i, h)

    if args.real:  # a real GPU lacks some of these (fan, MIG mode, sample buffer...): as gpusd, ask only the rest
        calls = (pynvml.nvmlDeviceGetMemoryInfo, pynvml.nvmlDeviceGetUtilizationRates,
                 lambda h: pynvml.nvmlDeviceGetTemperature(h, 0), pynvml.nvmlDeviceGetPowerUsage,
                 pynvml.nvmlDeviceGetEnforcedPowerLimit, pynvml.nvmlDeviceGetFanSpeed,
                 pynvml.nvmlDeviceGetComputeMode, pynvml.nvmlDeviceGetMigMode,
                 pynvml.nvmlDeviceGetComputeRunningProcesses, pynvml.nvmlDeviceGetGraphicsRunningProcesses)
        unsupported = {3, 4, 13}  # not supported, no permission, function not found: gpusd stops asking

        def answers(call: Callable[[], object]) -> bool:
            try:
                call()
            except pynvml.NVMLError as exc:
                return exc.value not in unsupported
            return True

        plan = [[(lambda c=c, h=h: c(h)) for c in calls if answers(lambda c=c, h=h: c(h))] +
                ([lambda i=i, h=h: samples(i, h)] if answers(lambda i=i, h=h: samples(i, h)) else [])
                for i, h in enumerate(handles)]

        def floor_real() -> None:
            for gpu_calls in plan:
                for call in gpu_calls:
                    call()

        return floor_real, len(handles)
    return (floor_samples if rig == "samples" else floor), len(handles)


def _count(floor: Callable[[], None]) -> Callable[[], None]:
    """The floor and the one NVML call a snapshot of gpusd makes besides: the device count."""
    import pynvml

    count = pynvml.nvmlDeviceGetCount

    def floor_count() -> None:
        count()
        floor()

    return floor_count


def inprocess(args: argparse.Namespace, rig: str) -> None:
    """One snapshot, in-process, on the GPUs in use now (fresh gpusd backends for each rig)."""
    import pynvml

    import gpusd.inventory

    floor, count = _floor(args, rig)
    library = _backend("nvidia-ml-py")
    ours = _backend("auto")
    fast = "nvmlfast" in str(getattr(ours, "_nv", ""))
    note = ("also: 5 s utilisation window from the driver's samples, process owners" if rig == "samples" else
            "also: 5 s utilisation window from its own readings (one per call), process owners")
    # Each against the floor, in turn with it call by call (pairs: a third function in the turn would
    # change what the caches hold when each runs), the floor's time the first pair's.
    floor_t, library_t = interleaved([floor, library.snapshot], args.n)  # type: ignore[attr-defined]
    rows: list[tuple[str, float, str]] = [
        ("raw nvidia-ml-py, cached handles (floor)", floor_t, "the same NVML calls per GPU as gpusd's"),
        ("gpusd NvmlBackend.snapshot(), nvidia-ml-py", library_t, note)]
    if fast:
        alone, fast_t = interleaved([floor, ours.snapshot], args.n)  # type: ignore[attr-defined]
        rows.append(("gpusd NvmlBackend.snapshot(), nvmlfast", fast_t * floor_t / alone, "the quick commands' binding"))
    # gpusd's one NVML call per snapshot besides
    alone, with_count = interleaved([floor, _count(floor)], args.n)
    rows.append(("floor + nvmlDeviceGetCount", with_count * floor_t / alone,
                 f"gpusd's one call per snapshot besides (GPUs come and go): +{(with_count - alone) * 1e6:.1f} us"))

    try:
        from nvitop import Device

        def nvitop_all() -> None:
            for d in Device.all():
                for read in (d.name, d.uuid, d.bus_id, d.memory_total, d.memory_used, d.memory_free,
                             d.gpu_utilization, d.memory_utilization, d.temperature, d.power_usage,
                             d.power_limit, d.fan_speed, d.compute_mode, d.is_mig_mode_enabled, d.processes):
                    read()

        rows.append(("nvitop Device.all() + same fields", p50(timeit_each(nvitop_all, max(200, args.n // 5))), ""))
    except ImportError:
        rows.append(("nvitop", float("nan"), "not installed"))
    if not args.no_gpustat:
        try:
            from gpustat import GPUStatCollection

            rows.append(("gpustat GPUStatCollection.new_query()",
                         p50(timeit_each(GPUStatCollection.new_query, 5, warmup=1)),
                         "sleeps 0.1 s per GPU with processes to sample their CPU use (by design)"))
        except ImportError:
            rows.append(("gpustat", float("nan"), "not installed"))
    pynvml.nvmlShutdown()
    library.close()  # type: ignore[attr-defined]
    ours.close()  # type: ignore[attr-defined]

    floor_t = rows[0][1]
    gpusd_t = rows[1][1]
    print(f"\nIn-process, one snapshot of {count} {'real' if args.real else 'fake'} GPUs (p50; each against the floor, "
          f"in turn with it), rig: {rig}, load average {os.getloadavg()[0]:.1f}, {gpusd.inventory.__file__}")
    print(f"{'tool':48s} {'p50 ms':>9s} {'x floor':>8s} {'x gpusd':>8s}  note")
    for name, t, extra in rows:
        print(f"{name:48s} {t * 1e3:9.3f} {t / floor_t:8.2f} {t / gpusd_t:8.2f}  {extra}")
    print("goal: gpusd's snapshot through nvidia-ml-py <= 1.2x the floor (the same NVML calls per GPU)")


def child(args: argparse.Namespace) -> None:
    """--child: the floor and gpusd's snapshot through nvidia-ml-py, one line (for --before)."""
    fake = FakeEnv(RIGS[args.rig[0]]())
    fake.activate_in_process()
    floor, _ = _floor(args, args.rig[0])
    library = _backend("nvidia-ml-py")
    f, g = interleaved([floor, library.snapshot], args.n)  # type: ignore[attr-defined]
    print(f"RESULT {f} {g}")


def before(args: argparse.Namespace) -> None:
    """This tree and ``args.before``'s in turn, each in a child process, ``args.rounds`` times."""
    here = str(Path(__file__).resolve().parent.parent / "src")
    print(f"\nThe snapshot through nvidia-ml-py against the floor, this tree and {args.before} in turn "
          f"(child processes, {args.n} interleaved calls each), rig: {args.rig[0]}")
    print(f"{'round':>5s} {'tree':8s} {'floor ms':>9s} {'gpusd ms':>9s} {'x floor':>8s}  load")
    for r in range(args.rounds):
        for label, src in (("this", here), ("before", args.before)):
            env = dict(os.environ, PYTHONPATH=src)
            out = subprocess.run([sys.executable, __file__, "--child", "--rig", args.rig[0], "--n", str(args.n)],
                                 env=env, capture_output=True, text=True, check=True).stdout
            f, g = (float(x) for x in out.split("RESULT", 1)[1].split())
            print(f"{r + 1:5d} {label:8s} {f * 1e3:9.3f} {g * 1e3:9.3f} {g / f:8.2f}  {os.getloadavg()[0]:.1f}")


def window_rates(n: int) -> None:
    """One read of the utilisation window (a reading added, then the 5 s mean), after 5 s of readings
    at a given rate: the cost should not grow with the rate.  Both ways: ``add`` then ``mean``, and
    ``add_mean`` (the snapshot's one call per GPU, where the tree has it)."""
    from gpusd.inventory.window import UtilWindow

    fused = hasattr(UtilWindow, "add_mean")
    print("\nUtilisation window, one read (add + 5 s mean) after 5 s of readings at a given rate (p50)")
    print(f"{'readings per second':>20s} {'readings in 5 s':>16s} {'add, mean us':>13s} {'add_mean us':>12s}")
    for rate in (1, 100, 1_000, 10_000):
        row = []
        for way in ("two", "one"):
            if way == "one" and not fused:
                row.append(float("nan"))
                continue
            w = UtilWindow(5.0)
            step = 1.0 / rate
            t = 0.0
            for i in range(5 * rate):
                t = i * step
                w.add(t, float(i % 100))
            clock = [t]

            def read(w: UtilWindow = w, clock: list[float] = clock, step: float = step) -> None:
                clock[0] += step
                w.add(clock[0], 50.0)
                w.mean(clock[0])

            def read_one(w: UtilWindow = w, clock: list[float] = clock, step: float = step) -> None:
                clock[0] += step
                w.add_mean(clock[0], 50.0)

            row.append(p50(timeit_each(read if way == "two" else read_one, n)))
        print(f"{rate:20d} {5 * rate:16d} {row[0] * 1e6:13.2f} {row[1] * 1e6:12.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2000, help="in-process calls per tool")
    ap.add_argument("--runs", type=int, default=15, help="whole-process runs per tool")
    ap.add_argument("--rig", action="append", choices=sorted(RIGS), help="fake rig(s) to run (default: both)")
    ap.add_argument("--no-gpustat", action="store_true", help="skip gpustat (it sleeps 0.1 s per GPU with processes)")
    ap.add_argument("--real", action="store_true", help="use this machine's NVIDIA driver instead of the fake NVML")
    ap.add_argument("--before", metavar="SRC", help="also compare with the gpusd of this src/ directory, in child "
                    "processes taking turns with this tree's (the first --rig only)")
    ap.add_argument("--rounds", type=int, default=3, help="with --before: child processes per tree")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return 0

    if args.real:
        base_env = dict(os.environ)
        inprocess(args, "real")
    else:
        base_env = {}
        for rig in args.rig or ["samples", "no-samples"]:
            fake = FakeEnv(RIGS[rig]())
            fake.activate_in_process()
            base_env = base_env or fake.env
            inprocess(args, rig)
    if args.before:
        args.rig = args.rig or ["samples"]
        before(args)
    window_rates(args.n)
    if args.runs <= 0:
        return 0

    print(f"\nWhole process, median of {args.runs} runs")
    print(f"{'command':32s} {'median ms':>10s} {'min ms':>8s}  rc")
    cmds = [("gpusd devices --json", [sys.executable, "-m", "gpusd", "devices", "--json"])]
    for name, exe in (("gpustat --json", "gpustat"), ("nvitop -1", "nvitop")):
        path = shutil.which(exe)
        if path:
            cmds.append((name, [path, *name.split()[1:]]))
    env = dict(base_env, TERM="xterm-256color", COLUMNS="160")
    for name, cmd in cmds:
        times, last = whole_process(cmd, env, args.runs)
        print(f"{name:32s} {p50(times) * 1e3:10.1f} {min(times) * 1e3:8.1f}  {last.returncode}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
