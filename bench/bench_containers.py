"""Issue 37 benchmark: what naming a GPU process's container costs, and what a container run costs gpusd.

    python bench/bench_containers.py [--n 20000] [--runs 5]

1. Per new GPU process, the resolver already reads /proc/PID/status and cmdline (its floor); the
   container adds one read of /proc/PID/cgroup and its parse.  Timed on this process (a host process)
   and, for the parse alone, on a docker, a Kubernetes and a Slurm cgroup text.
2. The rewrite of a ``docker run`` command for two leased GPUs (parse, checks, options), in-process.
3. ``gpusd run -n 2 -- docker run --rm img true`` end to end with a fake docker (tests/fakeruntime) on a
   fake NVML, beside ``gpusd run -n 2 -- true`` (the same job without a container): the container's
   cost to gpusd is the cid watch and the ``docker wait`` holder.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "src"), str(REPO / "tests")]

ID = "0123456789abcdef" * 4
TEXTS = {
    "docker": f"12:pids:/docker/{ID}\n11:memory:/docker/{ID}\n0::/\n",
    "kubernetes": "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod6f3c1a2b_4d5e_4f60_8a9b_"
                  f"0c1d2e3f4a5b.slice/cri-containerd-{ID}.scope\n",
    "slurm": "0::/system.slice/slurmstepd.scope/job_4242/step_0/user/task_0\n",
}


def per_call(fn, n: int) -> float:  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    from gpusd.inventory import cgroups, processes
    from gpusd.jobs.containers import Leased, parse

    pid = os.getpid()
    floor = per_call(lambda: processes._from_proc(pid), a.n)
    cg = per_call(lambda: cgroups.of_pid(pid), a.n)
    print(f"1. per new GPU process: /proc status+cmdline (the floor) {floor:.1f} us; + cgroup read and parse "
          f"{cg:.1f} us ({cg / floor * 100:.0f}% more)")
    for name, text in TEXTS.items():
        print(f"   parse of a {name} cgroup: {per_call(lambda t=text: cgroups.parse(t), a.n):.1f} us")
    devs = [Leased("nvidia", 1, "GPU-" + "a" * 36), Leased("nvidia", 3, "GPU-" + "b" * 36)]
    cmd = ["docker", "run", "--rm", "-e", "A=1", "-v", "/d:/d", "img", "python", "train.py"]
    rw = per_call(lambda: parse(cmd).command(devs, "/tmp/cid"), a.n // 4)  # type: ignore[union-attr]
    print(f"2. rewrite of a docker run for 2 GPUs: {rw:.1f} us")

    from fakenvml import build_fake_nvml, fake_env, make_gpus, write_state
    from fakeruntime import NAMES, SCRIPT

    with tempfile.TemporaryDirectory(prefix="gpd-bench-") as d:
        tmp = Path(d)
        state = tmp / "nvml"
        write_state(state, make_gpus(4))
        b = tmp / "bin"
        b.mkdir()
        for name in NAMES:
            (b / name).write_text(f"#!{sys.executable}\n" + SCRIPT.read_text())
            (b / name).chmod(0o755)
        env = fake_env(build_fake_nvml(), state, dict(
            os.environ, PYTHONPATH=str(REPO / "src"), PATH=f"{b}:{os.environ['PATH']}",
            GPUSD_LOCK_DIR=str(tmp / "locks"), GPUSD_STATE_DIR=str(tmp / "state"),
            GPUSD_LEASE_SOCKET=str(tmp / "none.sock"), FAKE_RUNTIME_STATE=str(tmp / "fr")))

        def wall(cmd: list[str]) -> float:
            times = []
            for _ in range(a.runs):
                t = time.perf_counter()
                subprocess.run([sys.executable, "-m", "gpusd", "run", "-n", "2", "--", *cmd], env=env, check=True,
                               stdout=subprocess.DEVNULL)
                times.append(time.perf_counter() - t)
            return statistics.median(times) * 1000

        plain = wall(["true"])
        direct = statistics.median(
            [(lambda t: (subprocess.run(["docker", "run", "--rm", "img", "true"], env=env, check=True,
                                        stdout=subprocess.DEVNULL), time.perf_counter() - t)[1])(time.perf_counter())
             for _ in range(a.runs)]) * 1000
        boxed = wall(["docker", "run", "--rm", "img", "true"])
        print(f"3. gpusd run -n 2 -- true: {plain:.0f} ms; fake docker run alone: {direct:.0f} ms; "
              f"gpusd run -n 2 -- docker run --rm img true: {boxed:.0f} ms "
              f"(container's cost to gpusd: {boxed - plain - direct:.0f} ms; median of {a.runs})")


if __name__ == "__main__":
    main()
