"""Issue 2 benchmark: one snapshot of 8 GPUs, in-process and as a whole process.

    python bench/bench_inventory.py [--n 2000] [--runs 15] [--rig samples|no-samples]

In-process, on the same fake NVML with 8 GPUs: gpusd's snapshot versus nvitop's ``Device.all()``
reading the same fields, gpustat's ``GPUStatCollection.new_query()``, and the floor — raw
nvidia-ml-py calls on cached handles for the same fields.  Two rigs, one after the other:

* ``samples``: the driver keeps a utilisation sample buffer (``nvmlDeviceGetSamples``); 2 processes on
  every GPU;
* ``no-samples``: ``nvmlDeviceGetSamples`` answers NOT_SUPPORTED (gpusd builds the 5 s window from its
  own readings, one per call); processes on 5 of the 8 GPUs.

Whole process (first rig only): ``gpusd devices --json`` versus ``gpustat --json`` and ``nvitop -1``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

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


def inprocess(args: argparse.Namespace, rig: str) -> None:
    """One snapshot, in-process, on the GPUs in use now (a fresh gpusd backend for each rig)."""
    import pynvml

    from gpusd.inventory.nvml import NvmlBackend

    backend = NvmlBackend()
    rows: list[tuple[str, float, str]] = []

    # The floor: the same fields, raw calls, cached handles.
    pynvml.nvmlInit()
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]

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

    if args.real:  # a real GPU may lack some of these (MIG mode, ...): the floor then tolerates errors
        calls = (pynvml.nvmlDeviceGetMemoryInfo, pynvml.nvmlDeviceGetUtilizationRates,
                 lambda h: pynvml.nvmlDeviceGetTemperature(h, 0), pynvml.nvmlDeviceGetPowerUsage,
                 pynvml.nvmlDeviceGetEnforcedPowerLimit, pynvml.nvmlDeviceGetComputeMode,
                 pynvml.nvmlDeviceGetMigMode, pynvml.nvmlDeviceGetComputeRunningProcesses,
                 pynvml.nvmlDeviceGetGraphicsRunningProcesses)

        def floor() -> None:
            for h in handles:
                for call in calls:
                    try:
                        call(h)
                    except pynvml.NVMLError:
                        pass

    note = ("also: 5 s utilisation window from the driver's samples, process owners" if rig == "samples" else
            "also: 5 s utilisation window from its own readings (one per call), process owners")
    rows.append(("raw nvidia-ml-py, cached handles (floor)", p50(timeit_each(floor, args.n)), ""))
    rows.append(("gpusd NvmlBackend.snapshot()", p50(timeit_each(backend.snapshot, args.n)), note))

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
    backend.close()

    floor_t = rows[0][1]
    ours = rows[1][1]
    print(f"\nIn-process, one snapshot of {len(handles)} {'real' if args.real else 'fake'} GPUs (p50), rig: {rig}")
    print(f"{'tool':48s} {'p50 ms':>9s} {'x floor':>8s} {'x gpusd':>8s}  note")
    for name, t, note in rows:
        print(f"{name:48s} {t * 1e3:9.3f} {t / floor_t:8.2f} {t / ours:8.2f}  {note}")


def window_rates(n: int) -> None:
    """One read of the utilisation window (a reading added, then the 5 s mean), after 5 s of readings
    at a given rate: the cost should not grow with the rate."""
    from gpusd.inventory.window import UtilWindow

    print("\nUtilisation window, one read (add + 5 s mean) after 5 s of readings at a given rate (p50)")
    print(f"{'readings per second':>20s} {'readings in 5 s':>16s} {'us per read':>12s}")
    for rate in (1, 100, 1_000, 10_000):
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

        print(f"{rate:20d} {5 * rate:16d} {p50(timeit_each(read, n)) * 1e6:12.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2000, help="in-process calls per tool")
    ap.add_argument("--runs", type=int, default=15, help="whole-process runs per tool")
    ap.add_argument("--rig", action="append", choices=sorted(RIGS), help="fake rig(s) to run (default: both)")
    ap.add_argument("--no-gpustat", action="store_true", help="skip gpustat (it sleeps 0.1 s per GPU with processes)")
    ap.add_argument("--real", action="store_true", help="use this machine's NVIDIA driver instead of the fake NVML")
    args = ap.parse_args()

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
