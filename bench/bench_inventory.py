"""Issue 2 benchmark: one snapshot of 8 GPUs, in-process and as a whole process.

    python bench/bench_inventory.py [--n 2000] [--runs 15]

In-process, on the same fake NVML with 8 GPUs (each with 2 processes): gpusd's snapshot versus
nvitop's ``Device.all()`` reading the same fields, gpustat's ``GPUStatCollection.new_query()``, and the
floor — raw nvidia-ml-py calls on cached handles for the same fields.  Whole process:
``gpusd devices --json`` versus ``gpustat --json`` and ``nvitop -1``.
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2000, help="in-process calls per tool")
    ap.add_argument("--runs", type=int, default=15, help="whole-process runs per tool")
    ap.add_argument("--real", action="store_true", help="use this machine's NVIDIA driver instead of the fake NVML")
    args = ap.parse_args()

    if args.real:
        base_env = dict(os.environ)
    else:
        fake = FakeEnv(gpus8())
        fake.activate_in_process()
        base_env = fake.env
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

    rows.append(("raw nvidia-ml-py, cached handles (floor)", p50(timeit_each(floor, args.n)), ""))
    rows.append(("gpusd NvmlBackend.snapshot()", p50(timeit_each(backend.snapshot, args.n)),
                 "also: 5 s utilisation window from the driver's samples, process owners"))

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
    try:
        from gpustat import GPUStatCollection

        rows.append(("gpustat GPUStatCollection.new_query()",
                     p50(timeit_each(GPUStatCollection.new_query, 5, warmup=1)),
                     "sleeps 0.1 s per GPU with processes to sample their CPU use (by design)"))
    except ImportError:
        rows.append(("gpustat", float("nan"), "not installed"))

    floor_t = rows[0][1]
    ours = rows[1][1]
    print(f"In-process, one snapshot of {len(handles)} {'real' if args.real else 'fake'} GPUs (p50)")
    print(f"{'tool':48s} {'p50 ms':>9s} {'x floor':>8s} {'x gpusd':>8s}  note")
    for name, t, note in rows:
        print(f"{name:48s} {t * 1e3:9.3f} {t / floor_t:8.2f} {t / ours:8.2f}  {note}")

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
    backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
