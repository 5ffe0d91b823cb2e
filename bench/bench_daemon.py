"""Issue 24 benchmark, the daemon: its answers beside bare aiohttp, signed reads, memory at rest, and
how soon a new host is visible.  Everything on loopback (127.0.0.1), bounded in time and count.

    python bench/bench_daemon.py serve   [--seconds 5] [--rounds 3] [--concurrency 16]
    python bench/bench_daemon.py memory  [--gpus 8] [--seconds 20]
    python bench/bench_daemon.py visible [--rounds 5]

``serve``: one daemon (``gpusd start --foreground``) on the fake NVML with 8 GPUs (two processes
each), and a bare aiohttp server (a handler returning prebuilt bytes, nothing else) serving the
daemon's own answer bytes (public view), loaded in turn with ``hey -c 16`` (keep-alive, loopback) for
``--seconds`` per run, interleaved for ``--rounds`` rounds: GET /api/v1/gpus, /api/v1/host, /healthz.
Without ``hey`` (Debian package ``hey``), a bounded aiohttp load generator does the same.

``memory``: RSS of the daemon at rest (8 fake GPUs, after ``--seconds`` of 1 s sampling) beside
nvitop-exporter's on the same fake NVML (``pip install nvitop-exporter``), and both CPU shares.

``visible``: seconds from ``gpusd start`` (the process spawned) to a browser on 127.0.0.1 seeing its
service, beside the floor: a bare python-zeroconf registration of a service with the same records,
seen by the same browser.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import os
import platform
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import FakeEnv, FakeProcess, make_gpus

GiB = 2**30

BARE_SERVER = r"""
import sys
from aiohttp import web
bodies = {}
for arg in sys.argv[2:]:
    path, _, file = arg.partition("=")
    bodies[path] = open(file, "rb").read()
def handler(body):
    async def h(request):
        return web.Response(body=body, content_type="application/json")
    return h
app = web.Application()
for path, body in bodies.items():
    app.router.add_get(path, handler(body))
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None, handle_signals=True)
"""


def gpus(n: int):
    out = make_gpus(n, memory_used=12 * GiB, util_gpu=35, util_memory=10, temperature=50, power_usage=180_000)
    for g in out:
        g.processes = [FakeProcess(os.getpid(), 4 * GiB), FakeProcess(os.getppid(), 2 * GiB)]
    return out


def start_daemon(fake: FakeEnv, interval: float = 1.0, extra: list[str] | None = None
                 ) -> tuple[subprocess.Popen[bytes], dict]:
    state = Path(tempfile.mkdtemp(prefix="gpusd-bench-daemon-"))
    atexit.register(shutil.rmtree, state, ignore_errors=True)
    env = dict(fake.env, GPUSD_INTERFACES="127.0.0.1", GPUSD_STATE_DIR=str(state))
    r, w = os.pipe()
    argv = [sys.executable, "-m", "gpusd", "start", "--foreground", "--interface", "127.0.0.1", "--port", "0",
            "--session", f"bench-{secrets.token_hex(3)}", "--interval", str(interval), "--hostname", "bench-host",
            "--ready-fd", str(w), *(extra or [])]
    with open(state / "gpusd.log", "ab") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=log, pass_fds=(w,), stdin=subprocess.DEVNULL)
    os.close(w)
    with os.fdopen(r) as f:
        line = f.readline()
    if not line:
        proc.kill()
        raise SystemExit(f"the daemon did not start; log:\n{(state / 'gpusd.log').read_text()[-3000:]}")
    return proc, json.loads(line)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, seconds: float = 10) -> None:
    import socket

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise SystemExit(f"nothing listens on 127.0.0.1:{port}")


def fetch(url: str) -> bytes:
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as r:  # noqa: S310 - loopback only
        return bytes(r.read())


# -- load ------------------------------------------------------------------------------------------
def hey(url: str, seconds: float, concurrency: int) -> tuple[float, int]:
    """(requests/s, non-200 answers) from ``hey -z`` (keep-alive)."""
    out = subprocess.run(["hey", "-z", f"{seconds:g}s", "-c", str(concurrency), url], capture_output=True,
                         text=True, timeout=seconds + 30).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    codes = dict((int(c), int(n)) for c, n in re.findall(r"\[(\d+)\]\s+(\d+) responses", out))
    return rps, sum(n for c, n in codes.items() if c != 200)


async def _py_load(url: str, seconds: float, concurrency: int) -> tuple[float, int]:
    import aiohttp

    done = errors = 0
    end = time.perf_counter() + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def worker() -> None:
            nonlocal done, errors
            while time.perf_counter() < end:
                try:
                    async with session.get(url) as resp:
                        await resp.read()
                        ok = resp.status == 200
                except Exception:  # noqa: BLE001 - counted
                    ok = False
                done += ok
                errors += not ok
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done / (time.perf_counter() - t0), errors


def load(url: str, seconds: float, concurrency: int) -> tuple[float, int]:
    if shutil.which("hey"):
        return hey(url, seconds, concurrency)
    return asyncio.run(_py_load(url, seconds, concurrency))


def cpu_seconds(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def serve(args: argparse.Namespace) -> None:
    fake = FakeEnv(gpus(args.gpus))
    # a long interval: the bytes the bare server serves stay the daemon's current ones
    proc, info = start_daemon(fake, interval=3600.0)
    base = f"http://127.0.0.1:{info['port']}"
    paths = ["/api/v1/gpus", "/api/v1/host", "/healthz"]
    tmp = Path(tempfile.mkdtemp(prefix="gpusd-bench-bare-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    files = []
    for i, p in enumerate(paths):
        (tmp / f"{i}.json").write_bytes(fetch(base + p))
        files.append(f"{p}={tmp / f'{i}.json'}")
    bare_port = free_port()
    bare = subprocess.Popen([sys.executable, "-c", BARE_SERVER, str(bare_port), *files], stdin=subprocess.DEVNULL)
    results: dict[tuple[str, str], list[tuple[float, int, float]]] = {}
    try:
        wait_port(bare_port)
        bare_base = f"http://127.0.0.1:{bare_port}"
        for _ in range(args.rounds):
            for p in paths:
                for name, b, pid in (("gpusd", base, proc.pid), ("bare aiohttp", bare_base, bare.pid)):
                    c0, t0 = cpu_seconds(pid), time.monotonic()
                    rps, errors = load(b + p, args.seconds, args.concurrency)
                    cpu = (cpu_seconds(pid) - c0) / (time.monotonic() - t0)
                    results.setdefault((p, name), []).append((rps, errors, cpu))
    finally:
        stop(proc)
        bare.terminate()
        bare.wait(10)
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"load avg {os.getloadavg()[0]:.1f}; daemon on the fake NVML with {args.gpus} GPUs; "
          f"{'hey' if shutil.which('hey') else 'aiohttp load generator'} -c {args.concurrency}, keep-alive, "
          f"{args.seconds:g} s per run, {args.rounds} interleaved rounds")
    print()
    print("| GET | answer bytes | gpusd req/s (median) | bare aiohttp req/s (median) | gpusd / bare | "
          "ratio per round | CPU ms/request gpusd / bare | errors |")
    print("|---|---|---|---|---|---|---|---|")
    for i, p in enumerate(paths):
        g, b = results[(p, "gpusd")], results[(p, "bare aiohttp")]
        med = sorted(x[0] for x in g)[len(g) // 2], sorted(x[0] for x in b)[len(b) // 2]
        ratios = " ".join(f"{x[0] / y[0]:.2f}" for x, y in zip(g, b))
        cpu_g = sum(x[2] for x in g) / sum(x[0] for x in g) * 1000
        cpu_b = sum(x[2] for x in b) / sum(x[0] for x in b) * 1000
        size = (tmp / f"{i}.json").stat().st_size
        print(f"| {p} | {size} | {med[0]:.0f} | {med[1]:.0f} | {med[0] / med[1]:.2f}x | {ratios} | "
              f"{cpu_g:.3f} / {cpu_b:.3f} | {sum(x[1] for x in g)} / {sum(x[1] for x in b)} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["serve", "memory", "visible"])
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args()
    {"serve": serve}[args.what](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
