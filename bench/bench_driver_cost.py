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
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import FakeEnv, make_gpus, start_ready, stop
from fakenvml import COST_ENV, COUNTS_ENV, REALISTIC_COST, SLOW_COST_ENV, call_counts

COSTS = {"zero": {COST_ENV: "0", SLOW_COST_ENV: "0"}, "realistic": dict(REALISTIC_COST)}


def _rig(n: int) -> list:
    gpus = make_gpus(n, memory_used=2**30, util_gpu=10)
    for i, g in enumerate(gpus):
        g.numa_node, g.host_bridge, g.pcie_switch = i * 2 // n, i // 4, i // 2
    return gpus


def _proc_cpu(pid: int) -> float:
    """Seconds of CPU (user + system) process ``pid`` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


_daemon_share: list[float] = []  # the daemon's CPU per pick while it answered them (ms; its sampling included)


def _picks(counts: Path, picks: int, daemon: int | None) -> dict[str, tuple[float, float]]:
    """Per tool: (ms of CPU per pick in this process, NVML calls per pick in this process); ``daemon``:
    the pid of the daemon answering them, whose CPU meanwhile goes to _daemon_share."""
    from nvitop import select_devices

    import gpusd

    out: dict[str, tuple[float, float]] = {}
    tools = {"gpusd.select()": lambda: gpusd.select().release(),
             "nvitop.select_devices": lambda: select_devices(min_count=1, max_count=1)}
    if daemon:  # the host's daemon answers the pick from its recent samples (this process: no NVML call)
        tools = {"gpusd.select() + daemon": tools["gpusd.select()"]}
    for name, fn in tools.items():
        for _ in range(5):  # static facts read, handles cached: as a process that picks again
            fn()
        before = sum(call_counts(counts, os.getpid()).values())
        t0 = time.process_time()
        d0 = _proc_cpu(daemon) if daemon else 0.0
        for _ in range(picks):
            fn()
        cpu = (time.process_time() - t0) / picks * 1000
        if daemon:
            _daemon_share.append((_proc_cpu(daemon) - d0) / picks * 1000)
        calls = (sum(call_counts(counts, os.getpid()).values()) - before) / picks
        out[name] = (cpu, calls)
    return out


def _daemon(fake: FakeEnv) -> tuple[subprocess.Popen[bytes], Path]:
    """A daemon on the fake (127.0.0.1 only) with a lease socket of its own; (it, its state directory)."""
    state = fake.tmp / f"daemon-{time.monotonic_ns()}"
    state.mkdir()
    env = dict(fake.env, GPUSD_INTERFACES="127.0.0.1", GPUSD_STATE_DIR=str(state),
               GPUSD_LEASE_SOCKET=str(state / "lease.sock"), GPUSD_LOCK_DIR=str(state / "locks"))
    env.update({k: os.environ[k] for k in (COST_ENV, SLOW_COST_ENV) if k in os.environ})
    env.pop(COUNTS_ENV, None)
    proc, _ = start_ready([sys.executable, "-m", "gpusd", "start", "--foreground", "--interface", "127.0.0.1",
                           "--port", "0", "--session", f"bench-{os.getpid()}", "--interval", "1",
                           "--hostname", "bench-host", "--no-record"], env, state / "gpusd.log")
    return proc, state


class _Authority:
    """This process's picks asking the daemon of ``state`` (its lease socket and lock directory), then not."""

    KEYS = ("GPUSD_LEASE_SOCKET", "GPUSD_LOCK_DIR")

    def __init__(self, state: Path) -> None:
        self.values = {"GPUSD_LEASE_SOCKET": str(state / "lease.sock"), "GPUSD_LOCK_DIR": str(state / "locks")}
        self.saved = {k: os.environ.get(k) for k in self.KEYS}

    def __enter__(self) -> None:
        os.environ.update(self.values)

    def __exit__(self, *exc: object) -> None:
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


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
    ap.add_argument("--daemon", action=argparse.BooleanOptionalAction, default=True,
                    help="also pick beside a daemon (the host's lease authority)")
    args = ap.parse_args()
    fake = FakeEnv(_rig(args.gpus))
    fake.activate_in_process()
    counts = Path(tempfile.mkdtemp(dir=fake.tmp))
    os.environ[COUNTS_ENV] = str(counts)
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    print(f"\nIn-process pick, {args.gpus} fake GPUs, {args.picks} picks a run, min-max over {args.runs} runs")
    print(f"{'cost':10} {'tool':24} {'ms CPU/pick':>16} {'NVML calls/pick':>16} {'nvitop/gpusd':>14}")
    for cost, env in COSTS.items():
        if args.picks <= 0:  # --picks 0: the whole-process part only
            break
        os.environ.update(env)
        daemon = _daemon(fake) if args.daemon else None
        try:
            runs = []
            for _ in range(args.runs):
                got = _picks(counts, args.picks, None)
                if daemon is not None:
                    with _Authority(daemon[1]):
                        got.update(_picks(counts, args.picks, daemon[0].pid))
                runs.append(got)
        finally:
            if daemon is not None:
                stop(daemon[0])
        nvitop = [r["nvitop.select_devices"][0] for r in runs]
        for tool in runs[0]:
            cpu = [r[tool][0] for r in runs]
            calls = runs[0][tool][1]
            ratio = [n / c for n, c in zip(nvitop, cpu)]
            shown = f"{min(ratio):.2f}-{max(ratio):.2f}x" if tool.startswith("gpusd") else ""
            print(f"{cost:10} {tool:24} {min(cpu):7.3f}-{max(cpu):<8.3f} {calls:16.1f} {shown:>14}")
        if _daemon_share:
            print(f"{cost:10} {'  the daemon meanwhile':24} {min(_daemon_share):7.3f}-{max(_daemon_share):<8.3f}"
                  "   (its CPU per pick while answering, its 1 s sampling included)")
            _daemon_share.clear()
    for k in (COST_ENV, SLOW_COST_ENV):
        os.environ.pop(k, None)

    print(f"\nWhole process: CPU of the child (user+sys), {args.starts} interleaved starts per cost, min-max")
    base = dict(fake.env)
    base.pop(COUNTS_ENV, None)
    # A normal install has gpusd's bytecode compiled (pip compiles it: here compileall, into the tree's
    # __pycache__, which git ignores); an editable install run with PYTHONDONTWRITEBYTECODE=1 (this image
    # sets it) compiles every gpusd module at every start: a copy of src/ without bytecode shows that.
    src = Path(__file__).resolve().parent.parent / "src"
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(src)], env=base, check=True, capture_output=True)
    bare = Path(tempfile.mkdtemp(dir=fake.tmp)) / "src"
    shutil.copytree(src, bare, ignore=shutil.ignore_patterns("__pycache__"))
    compiled = {"PYTHONPATH": str(src)}
    recompiled = {"PYTHONPATH": str(bare), "PYTHONDONTWRITEBYTECODE": "1"}
    nvisel = [sys.executable, "-c", "import sys; from nvitop.select import main; sys.exit(main())", "-n", "1"]
    cmds = {"python -c pass": ([sys.executable, "-c", "pass"], compiled),
            "gpusd devices --json": ([sys.executable, "-m", "gpusd", "devices", "--json"], compiled),
            "... recompiled each start": ([sys.executable, "-m", "gpusd", "devices", "--json"], recompiled),
            "gpusd select": ([sys.executable, "-m", "gpusd", "select"], compiled),
            "nvisel -n 1": (nvisel, compiled)}
    print(f"{'cost':10} {'command':26} {'ms CPU':>16} {'x floor':>14}")
    for cost, extra in COSTS.items():
        got: dict[str, list[float]] = {k: [] for k in cmds}
        for _ in range(args.starts):
            for name, (cmd, more) in cmds.items():
                got[name].append(_child_cpu(cmd, {**base, **extra, **more})[0])
        floor = got["python -c pass"]
        for name, cpu in got.items():
            ratio = [c / f for c, f in zip(cpu, floor)]
            shown = f"{min(ratio):.2f}-{max(ratio):.2f}x" if name != "python -c pass" else ""
            print(f"{cost:10} {name:26} {min(cpu):7.1f}-{max(cpu):<8.1f} {shown:>14}")
        sel, nvs = got["gpusd select"], got["nvisel -n 1"]
        print(f"{cost:10} {'nvisel / gpusd select':26} {min(n / g for n, g in zip(nvs, sel)):7.2f}-"
              f"{max(n / g for n, g in zip(nvs, sel)):<8.2f}")

    print("\ngpusd devices --json: bytes and NVML calls by GPUs (zero cost)")
    for n in (8, 64):
        fake.write(_rig(n))
        cdir = Path(tempfile.mkdtemp(dir=fake.tmp))
        env = {**base, COUNTS_ENV: str(cdir)}
        _, size = _child_cpu(cmds["gpusd devices --json"][0], {**env, **compiled})
        print(f"{n:3d} GPUs  {size:8d} bytes  {sum(call_counts(cdir).values()):6d} NVML calls")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
