"""Issue 24 benchmark: how long a quick command takes as a whole process, beside its floor and its peer.

    python bench/bench_startup.py [--runs 30]

On the fake NVML with 8 H100s (no driver sample buffer): ``gpusd devices --json`` beside ``python -c pass``
(the floor: an interpreter that starts and stops) and ``nvitop -1``; ``gpusd select -n 1`` and
``gpusd env -n 1`` beside ``nvisel -n 1`` (nvitop's selector).  Each gpusd row runs without a daemon (no
lease socket: the command reads NVML itself), and ``select``/``env`` also "with the host's daemon": a
``gpusd start --foreground`` on the same fake GPUs (mDNS on 127.0.0.1 only, its own state directory)
serves the lease socket, which the command asks (the deployment docs/allocation.md recommends).  The
commands are run interleaved (one of each, round after round), so that the load of the machine falls on
all of them alike; the figures are medians and the ratios are those of the medians.  Then the modules
each gpusd command imports (``-X importtime``): the heaviest, and the count.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import FakeEnv, make_gpus, p50, start_ready, stop

GiB = 2**30


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=30, help="rounds (each runs every command once)")
    ap.add_argument("--before", metavar="SRC", help="also run the gpusd of this src/ directory (a worktree of the "
                    "base commit), interleaved with the others, as 'before'")
    ap.add_argument("--no-daemon", action="store_true", help="skip the rows with the host's daemon")
    args = ap.parse_args()

    gpus = make_gpus(8, model="NVIDIA H100 80GB HBM3", memory_used=12 * GiB, util_gpu=35, util_memory=10,
                     temperature=50, power_usage=180_000, mig_mode=0, errors={"nvmlDeviceGetSamples": 3})
    fake = FakeEnv(gpus)
    env = dict(fake.env, TERM="xterm-256color", COLUMNS="160")
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as installed: compiled once (the warm-up run), then read from .pyc
    py = sys.executable
    env["GPUSD_LEASE_SOCKET"] = str(fake.tmp / "no-daemon.sock")  # nothing serves it: the command reads NVML
    cmds: dict[str, list[str]] = {
        "python -c pass": [py, "-c", "pass"],
        "gpusd devices --json": [py, "-m", "gpusd", "devices", "--json"],
        "gpusd select -n 1": [py, "-m", "gpusd", "select", "-n", "1"],
        "gpusd env -n 1": [py, "-m", "gpusd", "env", "-n", "1"],
    }
    envs = {name: env for name in cmds}
    daemon = None
    if not args.no_daemon:
        daemon, sock = start_daemon(fake)
        with_daemon = dict(env, GPUSD_LEASE_SOCKET=sock)
        for name in ("gpusd select -n 1", "gpusd env -n 1"):
            cmds[name + ", daemon"] = cmds[name]
            envs[name + ", daemon"] = with_daemon
    if args.before:
        for name in list(cmds):
            if name.startswith("gpusd"):
                cmds[name + " (before)"] = cmds[name]
                envs[name + " (before)"] = dict(envs[name], PYTHONPATH=args.before)
    try:
        return measure(args, cmds, envs, env, py)
    finally:
        if daemon is not None:
            stop(daemon)


def start_daemon(fake: FakeEnv) -> tuple[subprocess.Popen[bytes], str]:
    """``gpusd start --foreground`` on the fake GPUs, serving a lease socket of its own (mDNS on
    127.0.0.1 only); (the process, the socket's path) once it is ready."""
    state = Path(tempfile.mkdtemp(prefix="gpusd-bench-startup-"))
    atexit.register(shutil.rmtree, state, ignore_errors=True)
    sock = str(state / "lease.sock")
    env = dict(fake.env, GPUSD_INTERFACES="127.0.0.1", GPUSD_STATE_DIR=str(state), GPUSD_LEASE_SOCKET=sock)
    argv = [sys.executable, "-m", "gpusd", "start", "--foreground", "--interface", "127.0.0.1", "--port", "0",
            "--session", f"bench-{secrets.token_hex(3)}", "--hostname", "bench-startup"]
    proc, line = start_ready(argv, env, state / "gpusd.log")
    json.loads(line)
    if not os.path.exists(sock):
        stop(proc)
        raise SystemExit(f"the daemon serves no lease socket; log:\n{(state / 'gpusd.log').read_text()[-3000:]}")
    return proc, sock


def measure(args: argparse.Namespace, cmds: dict[str, list[str]], envs: dict[str, dict[str, str]],
            env: dict[str, str], py: str) -> int:
    for name, exe in (("nvisel -n 1", "nvisel"), ("nvitop -1", "nvitop")):
        path = shutil.which(exe)
        if path:
            cmds[name] = [path, *name.split()[1:]]
            envs[name] = env
    times: dict[str, list[float]] = {name: [] for name in cmds}
    for name, cmd in cmds.items():  # warm-up, and each must work
        done = subprocess.run(cmd, env=envs[name], capture_output=True)
        if done.returncode != 0:
            print(f"{name}: exit {done.returncode}: {done.stderr.decode()[-400:]}", file=sys.stderr)
            return 1
    cpu: dict[str, list[float]] = {name: [] for name in cmds}
    for _ in range(args.runs):
        for name, cmd in cmds.items():
            t = time.perf_counter()
            proc = subprocess.Popen(cmd, env=envs[name], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            _, _, usage = os.wait4(proc.pid, 0)
            proc.returncode = 0
            times[name].append(time.perf_counter() - t)
            cpu[name].append(usage.ru_utime + usage.ru_stime)

    med = {name: p50(v) for name, v in times.items()}
    mcpu = {name: p50(v) for name, v in cpu.items()}
    load = os.getloadavg()[0]
    print(f"Whole process, median of {args.runs} interleaved rounds (load average {load:.1f} on "
          f"{os.cpu_count()} CPUs), fake NVML, 8 H100s.  Wall-clock, and the CPU time (user + system) the process")
    print("itself used, which the machine's load disturbs far less; the ratios are of medians.")
    print(f"{'command':36s} {'wall ms':>8s} {'min':>6s} {'x pass':>7s} {'x nvisel':>9s}   "
          f"{'CPU ms':>7s} {'x pass':>7s} {'x nvisel':>9s}")
    floor, cfloor = med["python -c pass"], mcpu["python -c pass"]
    nvisel, cnvisel = med.get("nvisel -n 1"), mcpu.get("nvisel -n 1")
    for name in cmds:
        rel = f"{med[name] / nvisel:9.2f}" if nvisel else f"{'-':>9s}"
        crel = f"{mcpu[name] / cnvisel:9.2f}" if cnvisel else f"{'-':>9s}"
        print(f"{name:36s} {med[name] * 1e3:8.1f} {min(times[name]) * 1e3:6.1f} {med[name] / floor:7.2f} {rel}   "
              f"{mcpu[name] * 1e3:7.1f} {mcpu[name] / cfloor:7.2f} {crel}")
    print("goal: devices <= 4x python -c pass; select and env <= 0.6x nvisel -n 1 (', daemon': asking the host's "
          "daemon over the lease socket; the others read NVML themselves)")

    print("\nModules imported (python -X importtime, the least of 5 runs each), beyond those of python -c pass")
    base = _imports([py, "-X", "importtime", "-c", "pass"], env)
    for name in ("gpusd devices --json", "gpusd select -n 1", "gpusd env -n 1", "gpusd select -n 1, daemon"):
        if name not in cmds:
            continue
        runs = [_imports([py, "-X", "importtime", *cmds[name][1:]], envs[name]) for _ in range(5)]
        rows = {m: min(r.get(m, t) for r in runs) for m, t in runs[0].items()}
        own = {m: t for m, t in rows.items() if m not in base}
        top = sorted(own.items(), key=lambda kv: -kv[1])[:6]
        print(f"{name:26s} {len(own):3d} modules, {sum(own.values()) / 1e3:5.1f} ms self; heaviest: "
              + ", ".join(f"{m} {t / 1e3:.1f}" for m, t in top))
    return 0


def _imports(cmd: list[str], env: dict[str, str]) -> dict[str, int]:
    """module -> its own import time in microseconds."""
    err = subprocess.run(cmd, env=env, capture_output=True, text=True).stderr
    out: dict[str, int] = {}
    for line in err.splitlines():
        if line.startswith("import time:") and "|" in line:
            self_us, _, mod = (part.strip() for part in line[len("import time:"):].split("|"))
            if self_us.isdigit():
                out[mod.strip()] = int(self_us)
    return out


if __name__ == "__main__":
    sys.exit(main())
