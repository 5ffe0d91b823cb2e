"""What the driver's cost does to the ratios: in-process ``gpusd.select()`` (with its lease, released)
against ``nvitop.select_devices``, at zero cost and at a realistic cost per NVML call
(tests/fakenvml/README.md, "Cost and counting"), with the NVML calls each pick makes counted by the
fake; then ``gpusd devices --json`` as a whole process against ``python -c pass`` (CPU time of the
child, min-max over the runs), and its size at 8 and 64 GPUs.

    python bench/bench_driver_cost.py [--picks 200] [--runs 3] [--starts 15]

Each figure is min-max over ``--runs`` runs, each run interleaving the tools; the load average is
printed with the figures.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import FakeEnv, make_gpus
from fakenvml import COST_ENV, COUNTS_ENV, REALISTIC_COST, SLOW_COST_ENV, call_counts

COSTS = {"zero": {COST_ENV: "0", SLOW_COST_ENV: "0"}, "realistic": dict(REALISTIC_COST)}


def _rig(n: int) -> list:
    gpus = make_gpus(n, memory_used=2**30, util_gpu=10)
    for i, g in enumerate(gpus):
        g.numa_node, g.host_bridge, g.pcie_switch = i * 2 // n, i // 4, i // 2
    return gpus


def _picks(counts: Path, picks: int) -> dict[str, tuple[float, float]]:
    """Per tool: (ms of CPU per pick, NVML calls per pick)."""
    from nvitop import select_devices

    import gpusd

    out: dict[str, tuple[float, float]] = {}
    tools = {"gpusd.select()": lambda: gpusd.select().release(),
             "nvitop.select_devices": lambda: select_devices(min_count=1, max_count=1)}
    for name, fn in tools.items():
        for _ in range(5):  # static facts read, handles cached: as a process that picks again
            fn()
        before = sum(call_counts(counts, os.getpid()).values())
        t0 = time.process_time()
        for _ in range(picks):
            fn()
        cpu = (time.process_time() - t0) / picks * 1000
        calls = (sum(call_counts(counts, os.getpid()).values()) - before) / picks
        out[name] = (cpu, calls)
    return out


def _child_cpu(cmd: list[str], env: dict[str, str]) -> tuple[float, int]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run(cmd, env=env, capture_output=True, timeout=120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime) * 1000
    return cpu, len(r.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--picks", type=int, default=200)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--starts", type=int, default=15, help="whole-process runs of each command per cost")
    ap.add_argument("--gpus", type=int, default=8)
    args = ap.parse_args()
    fake = FakeEnv(_rig(args.gpus))
    fake.activate_in_process()
    counts = Path(tempfile.mkdtemp(dir=fake.tmp))
    os.environ[COUNTS_ENV] = str(counts)
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    print(f"\nIn-process pick, {args.gpus} fake GPUs, {args.picks} picks a run, min-max over {args.runs} runs")
    print(f"{'cost':10} {'tool':24} {'ms CPU/pick':>16} {'NVML calls/pick':>16} {'nvitop/gpusd':>14}")
    for cost, env in COSTS.items():
        os.environ.update(env)
        runs = [_picks(counts, args.picks) for _ in range(args.runs)]
        ratios = [r["nvitop.select_devices"][0] / r["gpusd.select()"][0] for r in runs]
        for tool in runs[0]:
            cpu = [r[tool][0] for r in runs]
            calls = runs[0][tool][1]
            ratio = f"{min(ratios):.2f}-{max(ratios):.2f}x" if tool.startswith("gpusd") else ""
            print(f"{cost:10} {tool:24} {min(cpu):7.3f}-{max(cpu):<8.3f} {calls:16.1f} {ratio:>14}")
    for k in (COST_ENV, SLOW_COST_ENV):
        os.environ.pop(k, None)

    print(f"\nWhole process: CPU of the child (user+sys), {args.starts} interleaved starts per cost, min-max")
    base = dict(fake.env)
    base.pop(COUNTS_ENV, None)
    cmds = {"python -c pass": [sys.executable, "-c", "pass"],
            "gpusd devices --json": [sys.executable, "-m", "gpusd", "devices", "--json"]}
    print(f"{'cost':10} {'command':24} {'ms CPU':>16} {'x floor':>14}")
    for cost, extra in COSTS.items():
        env = {**base, **extra}
        got: dict[str, list[float]] = {k: [] for k in cmds}
        for _ in range(args.starts):
            for name, cmd in cmds.items():
                got[name].append(_child_cpu(cmd, env)[0])
        floor = got["python -c pass"]
        for name, cpu in got.items():
            ratio = [c / f for c, f in zip(cpu, floor)]
            shown = f"{min(ratio):.2f}-{max(ratio):.2f}x" if name != "python -c pass" else ""
            print(f"{cost:10} {name:24} {min(cpu):7.1f}-{max(cpu):<8.1f} {shown:>14}")

    print("\ngpusd devices --json: bytes and NVML calls by GPUs (zero cost)")
    for n in (8, 64):
        fake.write(_rig(n))
        cdir = Path(tempfile.mkdtemp(dir=fake.tmp))
        env = {**base, COUNTS_ENV: str(cdir)}
        _, size = _child_cpu(cmds["gpusd devices --json"], env)
        print(f"{n:3d} GPUs  {size:8d} bytes  {sum(call_counts(cdir).values()):6d} NVML calls")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
