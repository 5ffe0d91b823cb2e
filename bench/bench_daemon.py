"""Issue 24 benchmark, the daemon: its answers beside bare aiohttp, signed reads, memory at rest, and
how soon a new host is visible.  Everything on loopback (127.0.0.1), bounded in time and count.

    python bench/bench_daemon.py serve   [--seconds 5] [--rounds 3] [--concurrency 16] [--before OLD/src]
                                         [--callgrind N]
    python bench/bench_daemon.py memory  [--gpus 8] [--seconds 20] [--rounds 3] [--before SRC] [--no-site]
                                         [--breakdown]
    python bench/bench_daemon.py visible [--rounds 5]

``serve``: one daemon (``gpusd start --foreground``) on the fake NVML with 8 GPUs (two processes
each), and a bare aiohttp server (a handler returning prebuilt bytes, nothing else) serving the
daemon's own answer bytes (public view), loaded in turn with ``hey -c 16`` (keep-alive, loopback) for
``--seconds`` per run, interleaved for ``--rounds`` rounds: GET /api/v1/gpus, /api/v1/host, /healthz.
With ``--before``, a second daemon from another tree (the same fake GPUs) is loaded in the same rounds.
With ``--callgrind N``, each server is then started again under ``valgrind --tool=callgrind`` and the
instructions it runs per request are counted over N requests per path: a figure the machine's load
does not disturb (requests per second on a shared machine swing by half from round to round).
Without ``hey`` (Debian package ``hey``), a bounded aiohttp load generator does the same.

``memory``: RSS of the daemon at rest (8 fake GPUs, after ``--seconds`` of 1 s sampling) beside
nvitop-exporter's on the same fake NVML (``pip install nvitop-exporter``) and a floor daemon (the same
libraries as gpusd doing the least: an aiohttp answer, a python-zeroconf registration, NVML read and a
SQLite row each second), with their CPU shares; all resting at once, each in a namespace of its own,
``--rounds`` times.  ``--before SRC``: also a daemon from another tree; ``--no-site``: also every
process without ``site`` (``-S``, so no ``.pth`` file of this machine runs: some sandboxes add one that
imports certifi); ``--breakdown``: the daemon's mappings by part and its imports replayed step by step.

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
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import FakeEnv, FakeProcess, make_gpus, start_ready, stop

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


PREFIX: list[str] = []  # ["ip", "netns", "exec", NAME] when the bench runs in a namespace of its own


def own_namespace() -> str:
    """A network namespace with only its loopback up (root only): no other process's mDNS or
    traffic reaches the processes measured there.  Deleted at exit."""
    name = f"gpusd-b24-{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    atexit.register(subprocess.run, ["ip", "netns", "del", name], check=False)
    subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=True)
    PREFIX[:] = ["ip", "netns", "exec", name]
    return name


def gpus(n: int):
    out = make_gpus(n, memory_used=12 * GiB, util_gpu=35, util_memory=10, temperature=50, power_usage=180_000)
    for g in out:
        g.processes = [FakeProcess(os.getpid(), 4 * GiB), FakeProcess(os.getppid(), 2 * GiB)]
    return out


def start_daemon(fake: FakeEnv, interval: float = 1.0, extra: list[str] | None = None, src: str | None = None,
                 wrap: list[str] | None = None) -> tuple[subprocess.Popen[bytes], dict]:
    """``gpusd start`` on the fake NVML (from ``src``, a tree's ``src`` directory, when given; under
    the command ``wrap``, e.g. valgrind, when given)."""
    state = Path(tempfile.mkdtemp(prefix="gpusd-bench-daemon-"))
    atexit.register(shutil.rmtree, state, ignore_errors=True)
    env = dict(fake.env, GPUSD_INTERFACES="127.0.0.1", GPUSD_STATE_DIR=str(state))
    if src is not None:
        env["PYTHONPATH"] = os.path.abspath(src)
    argv = [sys.executable, "-m", "gpusd", "start", "--foreground", "--interface", "127.0.0.1", "--port", "0",
            "--session", f"bench-{secrets.token_hex(3)}", "--interval", str(interval), "--hostname", "bench-host",
            *(extra or [])]
    proc, line = start_ready([*PREFIX, *(wrap or []), *argv], env, state / "gpusd.log")
    return proc, json.loads(line)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_PROBE = "import socket,sys; s=socket.socket(); sys.exit(s.connect_ex(('127.0.0.1', int(sys.argv[1]))))"
_FETCH = "import sys,urllib.request; sys.stdout.buffer.write(urllib.request.urlopen(sys.argv[1], timeout=5).read())"


def wait_port(port: int, seconds: float = 10) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if subprocess.run([*PREFIX, sys.executable, "-c", _PROBE, str(port)]).returncode == 0:
            return
        time.sleep(0.05)
    raise SystemExit(f"nothing listens on 127.0.0.1:{port}")


def fetch(url: str) -> bytes:
    """GET ``url`` (loopback only) from where the measured processes run."""
    return subprocess.run([*PREFIX, sys.executable, "-c", _FETCH, url], capture_output=True, check=True,
                          timeout=30).stdout


# -- load ------------------------------------------------------------------------------------------
def hey(url: str, seconds: float, concurrency: int) -> tuple[float, int]:
    """(requests/s, non-200 answers) from ``hey -z`` (keep-alive)."""
    out = subprocess.run([*PREFIX, "hey", "-z", f"{seconds:g}s", "-c", str(concurrency), url], capture_output=True,
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


def where(args: argparse.Namespace) -> str:
    if args.netns and os.geteuid() == 0 and shutil.which("ip") and shutil.which("hey"):
        return f"in a network namespace of its own ({own_namespace()}: loopback only, no other mDNS traffic)"
    return "on this machine's loopback"


def serve(args: argparse.Namespace) -> None:
    place = where(args)
    load0 = os.getloadavg()[0]
    fake = FakeEnv(gpus(args.gpus))
    # a long interval: the bytes the bare server serves stay the daemon's current ones
    proc, info = start_daemon(fake, interval=3600.0)
    base = f"http://127.0.0.1:{info['port']}"
    servers = [("gpusd", base, proc)]
    if args.before:  # the same daemon from another tree (e.g. the base commit), in the same rounds
        old_proc, old_info = start_daemon(fake, interval=3600.0, src=args.before)
        atexit.register(stop, old_proc)
        servers.append(("gpusd (before)", f"http://127.0.0.1:{old_info['port']}", old_proc))
    paths = ["/api/v1/gpus", "/api/v1/host", "/healthz"]
    tmp = Path(tempfile.mkdtemp(prefix="gpusd-bench-bare-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    files = []
    for i, p in enumerate(paths):
        (tmp / f"{i}.json").write_bytes(fetch(base + p))
        files.append(f"{p}={tmp / f'{i}.json'}")
    bare_port = free_port()
    bare = subprocess.Popen([*PREFIX, sys.executable, "-c", BARE_SERVER, str(bare_port), *files],
                            stdin=subprocess.DEVNULL)
    results: dict[tuple[str, str], list[tuple[float, int, float]]] = {}
    try:
        wait_port(bare_port)
        servers.append(("bare aiohttp", f"http://127.0.0.1:{bare_port}", bare))
        for r in range(args.rounds):
            for p in paths:
                # each round in another order: no server always follows the same one
                for name, b, server in servers[r % len(servers):] + servers[:r % len(servers)]:
                    c0, t0 = cpu_seconds(server.pid), time.monotonic()
                    rps, errors = load(b + p, args.seconds, args.concurrency)
                    cpu = (cpu_seconds(server.pid) - c0) / (time.monotonic() - t0)
                    results.setdefault((p, name), []).append((rps, errors, cpu))
    finally:
        for _, _, server in servers:
            stop(server)
    counted = instructions(args, fake, paths, files) if args.callgrind else {}
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"load avg {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end; daemon on the fake NVML with "
          f"{args.gpus} GPUs; {'hey' if shutil.which('hey') else 'aiohttp load generator'} -c {args.concurrency}, "
          f"keep-alive, {args.seconds:g} s per run, {args.rounds} interleaved rounds, {place}")
    print()
    print("req/s: the median of the rounds; ratio: gpusd's req/s over bare aiohttp's in the same round (their "
          "median); CPU: the server process's CPU time over the requests it answered, all rounds")
    print()
    print("| GET | answer bytes | server | req/s | vs bare: median (rounds) | CPU µs per request | errors |")
    print("|---|---|---|---|---|---|---|")
    for i, p in enumerate(paths):
        b = results[(p, "bare aiohttp")]
        size = (tmp / f"{i}.json").stat().st_size
        for name, _, _ in servers:
            g = results[(p, name)]
            med = sorted(x[0] for x in g)[len(g) // 2]
            ratios = sorted(x[0] / y[0] for x, y in zip(g, b))
            cpu = sum(x[2] for x in g) / sum(x[0] for x in g) * 1e6
            vs = "" if name == "bare aiohttp" else (
                f"**{ratios[len(ratios) // 2]:.2f}x** ({' '.join(f'{x:.2f}' for x in ratios)})")
            print(f"| {p} | {size} | {name} | {med:.0f} | {vs} | {cpu:.1f} | {sum(x[1] for x in g)} |")
    if counted:
        print()
        print(f"Instructions per request (valgrind --tool=callgrind, user space, {args.callgrind} requests of hey -n "
              f"-c {args.concurrency} per server and path after 300 to warm up; not disturbed by the machine's load):")
        print()
        print("| GET | server | k instructions per request | bare / server |")
        print("|---|---|---|---|")
        for p in paths:
            bare_ir = counted[(p, "bare aiohttp")]
            for name in [n for n, _, _ in servers]:
                ir = counted[(p, name)]
                ratio = "" if name == "bare aiohttp" else f"**{bare_ir / ir:.2f}x**"
                print(f"| {p} | {name} | {ir / 1000:.1f} | {ratio} |")


def instructions(args: argparse.Namespace, fake: FakeEnv, paths: list[str], files: list[str]
                 ) -> dict[tuple[str, str], float]:
    """Instructions each server runs per request (callgrind): the same servers, started afresh under
    valgrind, each path loaded with ``hey -n`` between a reset and a dump of the counters."""
    import glob

    out = Path(tempfile.mkdtemp(prefix="gpusd-bench-callgrind-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    vg = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}/cg.%p", "--dump-instr=no", "--collect-jumps=no"]
    servers: list[tuple[str, str, subprocess.Popen[bytes]]] = []
    try:
        proc, info = start_daemon(fake, interval=3600.0, wrap=vg)
        servers.append(("gpusd", f"http://127.0.0.1:{info['port']}", proc))
        if args.before:
            proc, info = start_daemon(fake, interval=3600.0, src=args.before, wrap=vg)
            servers.append(("gpusd (before)", f"http://127.0.0.1:{info['port']}", proc))
        port = free_port()
        bare = subprocess.Popen([*PREFIX, *vg, sys.executable, "-c", BARE_SERVER, str(port), *files],
                                stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        servers.append(("bare aiohttp", f"http://127.0.0.1:{port}", bare))
        wait_port(port, 300)

        def dump(pid: int) -> int:  # the instructions counted since the last reset
            old = set(glob.glob(f"{out}/cg.{pid}.*"))
            subprocess.run(["callgrind_control", "-d", str(pid)], capture_output=True, check=True, timeout=120)
            end = time.monotonic() + 60
            while not (new := set(glob.glob(f"{out}/cg.{pid}.*")) - old) and time.monotonic() < end:
                time.sleep(0.2)
            time.sleep(0.5)  # written whole
            text = Path(max(new, key=os.path.getmtime)).read_text()
            return int(re.search(r"^(?:totals|summary):\s+(\d+)", text, re.M).group(1))  # type: ignore[union-attr]

        counted: dict[tuple[str, str], float] = {}
        for p in paths:
            for name, base, server in servers:
                run = [*PREFIX, "hey", "-c", str(args.concurrency), base + p]
                subprocess.run(run[:-1] + ["-n", "300", run[-1]], capture_output=True, timeout=600)
                subprocess.run(["callgrind_control", "-z", str(server.pid)], capture_output=True, check=True,
                               timeout=120)
                text = subprocess.run(run[:-1] + ["-n", str(args.callgrind), run[-1]], capture_output=True,
                                      text=True, timeout=1800).stdout
                answered = sum(int(n) for n in re.findall(r"\[200\]\s+(\d+) responses", text))
                counted[(p, name)] = dump(server.pid) / max(1, answered)
        return counted
    finally:
        for _, _, server in servers:
            stop(server)


FLOOR_REGISTER = r"""
import asyncio, sys
from zeroconf import IPVersion, ServiceInfo
from zeroconf.asyncio import AsyncZeroconf
async def main():
    name = sys.argv[1]
    zc = AsyncZeroconf(interfaces=["127.0.0.1"], ip_version=IPVersion.V4Only)
    info = ServiceInfo("_gpusd._tcp.local.", f"{name}._gpusd._tcp.local.", port=9, server=f"{name}.local.",
                       parsed_addresses=["127.0.0.1"], properties={"v": "1", "session": "floor"})
    await (await zc.async_register_service(info))
    await asyncio.sleep(30)  # killed once seen
asyncio.run(main())
"""


# -- memory at rest ----------------------------------------------------------------------------------
# the same libraries as the daemon (aiohttp's server, python-zeroconf, nvidia-ml-py, sqlite3) doing the
# least the daemon does at rest: one JSON answer rebuilt from 8 GPUs each second (on a one-thread
# executor), one service registered on 127.0.0.1, one SQLite row per GPU and sample
FLOOR_DAEMON = r"""
import asyncio, json, sqlite3, sys, time
from concurrent.futures import ThreadPoolExecutor
import pynvml
from aiohttp import web
from zeroconf import IPVersion, ServiceInfo
from zeroconf.asyncio import AsyncZeroconf
def read(handles):
    out = []
    for h in handles:
        mem, util = pynvml.nvmlDeviceGetMemoryInfo(h), pynvml.nvmlDeviceGetUtilizationRates(h)
        out.append({"uuid": pynvml.nvmlDeviceGetUUID(h), "name": pynvml.nvmlDeviceGetName(h),
                    "memory_used": mem.used, "memory_total": mem.total, "utilization_gpu": util.gpu,
                    "temperature": pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
                    "power_draw": pynvml.nvmlDeviceGetPowerUsage(h) / 1000,
                    "processes": [[p.pid, p.usedGpuMemory] for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)]})
    return out
async def main(port, db):
    pynvml.nvmlInit()
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    executor, loop = ThreadPoolExecutor(1), asyncio.get_running_loop()
    conn = sqlite3.connect(db)
    conn.execute("create table if not exists samples (t real, gpu text, util int, mem int)")
    body = [json.dumps(read(handles)).encode()]
    async def gpus(request):
        return web.Response(body=body[0], content_type="application/json")
    app = web.Application()
    app.router.add_get("/api/v1/gpus", gpus)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    zc = AsyncZeroconf(interfaces=["127.0.0.1"], ip_version=IPVersion.V4Only)
    info = ServiceInfo("_gpusd._tcp.local.", "floor._gpusd._tcp.local.", port=port, server="floor.local.",
                       parsed_addresses=["127.0.0.1"], properties={"v": "1", "gpus": str(len(handles))})
    await (await zc.async_register_service(info))
    while True:
        sample = await loop.run_in_executor(executor, read, handles)
        body[0] = json.dumps(sample).encode()
        with conn:
            conn.executemany("insert into samples values (?, ?, ?, ?)",
                             [(time.time(), g["uuid"], g["utilization_gpu"], g["memory_used"]) for g in sample])
        await asyncio.sleep(1)
asyncio.run(main(int(sys.argv[1]), sys.argv[2]))
"""

NVITOP_EXPORTER = "import sys; from nvitop_exporter.cli import main; sys.argv[0] = 'nvitop-exporter'; sys.exit(main())"

# gpusd start, with the names of its modules written to $GPUSD_BENCH_MODULES on SIGUSR1 (--breakdown)
GPUSD_LISTING = r"""
import ctypes, json, os, signal, sys, threading
def listing(*_):
    out = {"modules": sorted(m for m in sys.modules if not m.startswith("_cython")),
           "threads": sorted(t.name for t in threading.enumerate())}
    class Mallinfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = Mallinfo2
        m = libc.mallinfo2()  # the main arena (and the mmapped blocks): all of it, with one arena
        out["malloc"] = {"system": m.arena + m.hblkhd, "in_use": m.uordblks + m.hblkhd}
    except (OSError, AttributeError):
        pass
    r, w = os.pipe()  # sys._debugmallocstats() writes to the C stderr
    saved = os.dup(2)
    os.dup2(w, 2)
    try:
        sys._debugmallocstats()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(w)
    text = os.read(r, 1 << 20).decode()
    os.close(r)
    for line in text.splitlines():
        key, _, value = line.partition("=")
        if key.strip() in ("# arenas allocated current", "# bytes in allocated blocks"):
            out[key.strip()] = int(value.strip().replace(",", ""))
    with open(os.environ["GPUSD_BENCH_MODULES"], "w") as f:
        json.dump(out, f)
signal.signal(signal.SIGUSR1, listing)
sys.argv[0] = "gpusd"
from gpusd.cli import main
sys.exit(main())
"""

# RSS of a fresh interpreter after each step of imports (argv[1]: JSON list of [label, [modules]]), the C heap
# trimmed as the daemon trims it once started
LADDER = r"""
import ctypes, importlib, json, sys
def rss():
    try:  # what an import allocated and freed (the compiler's work for dataclasses...) goes back first
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0])
out = [["python (and ctypes)", rss()]]
for label, mods in json.load(open(sys.argv[1])):
    for m in mods:
        try:
            importlib.import_module(m)
        except Exception:
            pass
    out.append([label, rss()])
print(json.dumps(out))
"""

MEM_FLOOR_IMPORTS = "import aiohttp.web, zeroconf.asyncio"


def namespace() -> list[str]:
    """A fresh network namespace with only its loopback up, for one measured process (root only), or
    [] where the bench runs on the machine's loopback.  Deleted at exit."""
    if not PREFIX:
        return []
    name = f"gpusd-b24m-{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    atexit.register(subprocess.run, ["ip", "netns", "del", name], check=False)
    subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=True)
    return ["ip", "netns", "exec", name]


def _python(site: bool) -> list[str]:
    """The interpreter as installed, or without ``site`` (``-S``: this machine's ``.pth`` files not run;
    its site-packages then come through $PYTHONPATH, see :func:`_pythonpath`)."""
    return [sys.executable] if site else [sys.executable, "-S"]


def _pythonpath(src: str | None, site: bool) -> str:
    import sysconfig

    parts = [src] if src else []
    if not site:
        paths = sysconfig.get_paths()
        parts += [p for p in dict.fromkeys((paths["purelib"], paths["platlib"]))]
    return ":".join(parts)


class Measured:
    """One process measured at rest: its command, the namespace it runs in, and how to know it is up."""

    def __init__(self, label: str, proc: subprocess.Popen[bytes], cleanup: list[str] | None = None) -> None:
        self.label, self.proc, self.cleanup = label, proc, cleanup or []

    def stop(self) -> None:
        stop(self.proc)
        for path in self.cleanup:
            shutil.rmtree(path, ignore_errors=True)


def _start_gpusd(label: str, fake: FakeEnv, src: str | None, site: bool, listing: str | None = None) -> Measured:
    state = tempfile.mkdtemp(prefix="gpusd-bench-mem-")
    env = dict(fake.env, GPUSD_INTERFACES="127.0.0.1", GPUSD_STATE_DIR=state, GPUSD_LOCK_DIR=state + "/locks",
               GPUSD_LEASE_SOCKET=state + "/lease.sock", PYTHONPATH=_pythonpath(src, site))
    main = ["-c", GPUSD_LISTING] if listing else ["-m", "gpusd"]
    if listing:
        env["GPUSD_BENCH_MODULES"] = listing
    argv = [*_python(site), *main, "start", "--foreground", "--interface", "127.0.0.1", "--port", "0",
            "--session", f"bench-{secrets.token_hex(3)}", "--interval", "1", "--hostname", "bench-host"]
    proc, _ = start_ready([*namespace(), *argv], env, Path(state) / "gpusd.log", what=label)
    return Measured(label, proc, [state])


def _start_server(label: str, fake: FakeEnv, code: str, args: list[str], site: bool,
                  cleanup: list[str] | None = None) -> Measured:
    """A Python server (``-c code``) that listens on 127.0.0.1:port once up (the first of ``args``)."""
    prefix = namespace()
    env = dict(fake.env, PYTHONPATH=_pythonpath(None, site))
    proc = subprocess.Popen([*prefix, *_python(site), "-c", code, *args], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    port = next(a for a in args if a.isdigit())
    end = time.monotonic() + 60
    while subprocess.run([*prefix, sys.executable, "-c", _PROBE, port]).returncode != 0:
        if proc.poll() is not None or time.monotonic() > end:
            proc.kill()
            raise SystemExit(f"{label} did not start")
        time.sleep(0.1)
    return Measured(label, proc, cleanup)


def _start_floor(fake: FakeEnv, site: bool) -> Measured:
    tmp = tempfile.mkdtemp(prefix="gpusd-bench-floor-")
    return _start_server("floor daemon", fake, FLOOR_DAEMON, [str(free_port()), f"{tmp}/samples.sqlite"], site,
                         [tmp])


def _start_exporter(fake: FakeEnv, site: bool) -> Measured:
    return _start_server("nvitop-exporter", fake, NVITOP_EXPORTER,
                         ["--bind-address", "127.0.0.1", "--port", str(free_port()), "--interval", "1"], site)


def _has_exporter() -> bool:
    import importlib.util

    return importlib.util.find_spec("nvitop_exporter") is not None


def smaps_rollup(pid: int) -> dict[str, int]:
    """kB per field of /proc/PID/smaps_rollup."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, _, value = line.partition(":")
            if value.strip().endswith("kB"):
                out[key] = int(value.split()[0])
    return out


def at_rest(pid: int, cpu0: float, wall: float) -> dict[str, float]:
    r = smaps_rollup(pid)
    return {"rss": r["Rss"] / 1024, "uss": (r["Private_Clean"] + r["Private_Dirty"]) / 1024,
            "anon": r["Anonymous"] / 1024, "file": (r["Rss"] - r["Anonymous"]) / 1024,
            "cpu": 100 * (cpu_seconds(pid) - cpu0) / wall, "threads": len(os.listdir(f"/proc/{pid}/task"))}


def import_rss(code: str, site: bool) -> float:
    """RSS in MiB of a fresh interpreter after ``code``."""
    out = subprocess.run([*_python(site), "-c", f"{code}; print(open('/proc/self/status').read()"
                          ".split('VmRSS:')[1].split()[0])"], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=_pythonpath(None, site)), check=True).stdout
    return int(out.strip()) / 1024


def byte_compile(src: str | None) -> None:
    """Byte-compile the gpusd trees of ``src`` (a PYTHONPATH) as an installed package is (pip writes the
    ``.pyc`` files at install): without them (a fresh checkout, and ``$PYTHONDONTWRITEBYTECODE``, set on
    this machine) every start compiles each module, and the compiler's freed memory stays in the heap
    (1-2 MiB of the daemon's RSS here)."""
    for entry in (src or "").split(":"):
        if entry and (Path(entry) / "gpusd").is_dir():
            subprocess.run([sys.executable, "-m", "compileall", "-q", str(Path(entry) / "gpusd")], check=True)


def memory(args: argparse.Namespace) -> None:
    place = where(args)
    fake = FakeEnv(gpus(args.gpus))
    this_src = os.environ.get("PYTHONPATH") or None
    byte_compile(this_src)
    byte_compile(args.before)
    kinds: list[tuple[str, Any]] = [("gpusd start", lambda site: _start_gpusd("gpusd start", fake, this_src, site))]
    if args.before:
        kinds.append(("gpusd start, before", lambda site: _start_gpusd("before", fake, args.before, site)))
    kinds.append(("floor daemon: the same libraries doing the least", lambda site: _start_floor(fake, site)))
    if _has_exporter():
        kinds.append(("nvitop-exporter", lambda site: _start_exporter(fake, site)))
    sites = [True, False] if args.no_site else [True]
    results: dict[tuple[str, bool], list[dict[str, float]]] = {}
    for _ in range(args.rounds):  # every process of a round rests at the same time, each in its own namespace
        running: list[tuple[str, bool, Measured]] = []
        try:
            for site in sites:
                for label, start in kinds:
                    running.append((label, site, start(site)))
            time.sleep(3)  # start-up settles
            cpu0 = {id(m): cpu_seconds(m.proc.pid) for _, _, m in running}
            t0 = time.monotonic()
            time.sleep(args.seconds)
            wall = time.monotonic() - t0
            for label, site, m in running:
                results.setdefault((label, site), []).append(at_rest(m.proc.pid, cpu0[id(m)], wall))
        finally:
            for _, _, m in running:
                m.stop()
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"load avg {os.getloadavg()[0]:.1f}; fake NVML with {args.gpus} GPUs, 1 s sampling, at rest for "
          f"{args.seconds:g} s, {args.rounds} round(s), every process {place.replace('its own', 'their own')}")
    print()
    print("| process | site (.pth files) | RSS MiB (median; min-max) | USS | anonymous | file-backed | "
          "CPU % of one core | threads |")
    print("|---|---|---|---|---|---|---|---|")
    for site in sites:
        for label, _ in kinds:
            rows = results[(label, site)]

            def med(key: str, rows: list[dict[str, float]] = rows) -> float:
                return sorted(r[key] for r in rows)[len(rows) // 2]

            span = f"; {min(r['rss'] for r in rows):.1f}-{max(r['rss'] for r in rows):.1f}" if len(rows) > 1 else ""
            print(f"| {label} | {'as installed' if site else 'none (-S)'} | {med('rss'):.1f}{span} | "
                  f"{med('uss'):.1f} | {med('anon'):.1f} | {med('file'):.1f} | {med('cpu'):.2f} | "
                  f"{int(med('threads'))} |")
    if not _has_exporter():
        print("| nvitop-exporter | not installed (pip install nvitop-exporter) | | | | | | |")
    for site in sites:
        print(f"| floor: python -c '{MEM_FLOOR_IMPORTS}' | {'as installed' if site else 'none (-S)'} | "
              f"{import_rss(MEM_FLOOR_IMPORTS, site):.1f} | | | | | |")
    if args.breakdown:
        print()
        breakdown(fake, this_src, args.seconds)


def _mapping_group(path: str, size_kb: int) -> str:
    """Which part of the process a mapping of /proc/PID/smaps is."""
    name = path.rsplit("/", 1)[-1]
    if not path:
        return "anonymous: thread stacks" if size_kb in (8192, 8188) else "anonymous: heaps (pymalloc, malloc)"
    if path == "[heap]":
        return "anonymous: heaps (pymalloc, malloc)"
    if path.startswith("["):
        return "anonymous: main stack, vdso" if path in ("[stack]", "[vvar]", "[vdso]", "[vsyscall]") else path
    if name.startswith("libpython"):
        return "file: libpython"
    if name.startswith(("libcrypto", "libssl")):
        return "file: libcrypto, libssl (ssl, hashlib)"
    if name.startswith("libsqlite3"):
        return "file: libsqlite3"
    if name.startswith(("libstdc++", "libgcc_s")):
        return "file: libstdc++, libgcc_s (frozenlist's C++ extension)"
    if name.startswith("libnvidia-ml"):
        return "file: libnvidia-ml (the fake)"
    if ".cpython-" in name:
        for pkg in ("aiohttp", "yarl", "multidict", "frozenlist", "propcache"):
            if f"/{pkg}/" in path:
                return "file: C extensions of aiohttp, yarl, multidict, frozenlist, propcache"
        if "/zeroconf/" in path:
            return "file: C extensions of zeroconf"
        return "file: C extensions of the standard library"
    if name.startswith(("libc.", "libm.", "ld-linux", "libpthread", "libdl", "librt")):
        return "file: libc, libm, ld.so"
    return "file: others (libffi, libz, liblzma, libbz2, locale ...)"


def smaps_groups(pid: int) -> dict[str, tuple[int, int]]:
    """(Rss kB, private kB) per group of mappings (:func:`_mapping_group`)."""
    groups: dict[str, list[int]] = {}
    cur: list[int] | None = None
    path, size = "", 0
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(None, 5)
            if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                path = head[5].strip() if len(head) > 5 else ""
                cur = None
                continue
            key, _, value = line.partition(":")
            if key == "Size":
                size = int(value.split()[0])
                cur = groups.setdefault(_mapping_group(path, size), [0, 0])
            elif cur is not None and key == "Rss":
                cur[0] += int(value.split()[0])
            elif cur is not None and key in ("Private_Clean", "Private_Dirty"):
                cur[1] += int(value.split()[0])
    return {k: (v[0], v[1]) for k, v in groups.items()}


def breakdown(fake: FakeEnv, src: str | None, seconds: float) -> None:
    """Where the daemon's RSS goes: its mappings, and the same imports in a fresh interpreter, step by step."""
    tmp = Path(tempfile.mkdtemp(prefix="gpusd-bench-mem-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    listing = tmp / "modules.txt"
    m = _start_gpusd("gpusd start (listing)", fake, src, True, listing=str(listing))
    try:
        time.sleep(3 + seconds)
        rss = smaps_rollup(m.proc.pid)["Rss"] / 1024
        groups = smaps_groups(m.proc.pid)
        os.kill(m.proc.pid, signal.SIGUSR1)
        end = time.monotonic() + 10
        while not listing.exists() and time.monotonic() < end:
            time.sleep(0.1)
        time.sleep(0.5)
    finally:
        m.stop()
    seen = json.loads(listing.read_text())
    threads = seen["threads"]
    print(f"The daemon at rest ({rss:.1f} MiB RSS; threads: {', '.join(threads)}), its mappings by part:")
    print()
    print("| part | RSS MiB | of which private |")
    print("|---|---|---|")
    for k, (r, p) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
        if r >= 64:
            print(f"| {k} | {r / 1024:.1f} | {p / 1024:.1f} |")
    rest = sum(r for r, _ in groups.values() if r < 64)
    print(f"| the rest (each part under 64 KiB) | {rest / 1024:.1f} | |")
    arenas, blocks = seen.get("# arenas allocated current"), seen.get("# bytes in allocated blocks")
    if arenas is not None and blocks is not None:
        print(f"| of the heaps: pymalloc (Python objects of 512 bytes or less) | {arenas} arenas of 1 MiB | "
              f"{blocks / 2**20:.1f} in use |")
    if "malloc" in seen:
        used, system = seen["malloc"]["in_use"] / 2**20, seen["malloc"]["system"] / 2**20
        print(f"| of the heaps: glibc malloc (larger Python objects, C libraries) | {system:.1f} from the system | "
              f"{used:.1f} in use |")
    modules = seen["modules"]
    libs = ("asyncio", "ssl", "aiohttp", "aiohttp.web", "zeroconf", "zeroconf.asyncio", "pynvml", "sqlite3")
    own = [x for x in modules if x == "gpusd" or x.startswith("gpusd.")]
    others = [x for x in modules if x not in own and x != "__main__"]
    parts: dict[str, list[str]] = {}
    for x in own:  # gpusd's modules by package, the core (top-level modules) first
        package = x.count(".") > 1 or any(y.startswith(x + ".") for y in own) and x != "gpusd"
        pkg = x.split(".")[1] if package else "core"
        parts.setdefault(pkg, []).append(x)
    order = ["core", "wire", "inventory", "alloc", "usage", "discovery", "cli", "daemon"]
    steps = [["asyncio (it imports ssl: libssl, libcrypto)", ["asyncio", "ssl"]],
             ["aiohttp (its client too, and the two SSL contexts it makes at import: the CA store)", ["aiohttp"]],
             ["aiohttp.web", ["aiohttp.web"]], ["zeroconf.asyncio", ["zeroconf", "zeroconf.asyncio"]],
             ["pynvml (nvidia-ml-py)", ["pynvml"]], ["sqlite3 (the usage history)", ["sqlite3"]],
             [f"the {len([x for x in others if x not in libs])} other modules of other packages and the standard "
              "library the daemon has loaded", others]]
    steps += [[f"gpusd: {pkg} ({len(parts[pkg])} modules)", parts[pkg]]
              for pkg in sorted(parts, key=lambda p: order.index(p) if p in order else len(order))]
    (tmp / "steps.json").write_text(json.dumps(steps))
    ladder = json.loads(subprocess.run([sys.executable, "-c", LADDER, str(tmp / "steps.json")], capture_output=True,
                                       text=True, check=True, env=dict(os.environ, PYTHONPATH=src or "")).stdout)
    print()
    print("The same imports in a fresh interpreter (as installed), step by step:")
    print()
    print("| step | RSS MiB after it | + MiB |")
    print("|---|---|---|")
    prev = 0.0
    for label, kb in ladder:
        print(f"| {label} | {kb / 1024:.1f} | {kb / 1024 - prev:+.1f} |")
        prev = kb / 1024
    print(f"| running: threads, malloc arenas, sockets, samples, caches | {rss:.1f} (the daemon) | {rss - prev:+.1f} |")
    (tmp / "steps2.json").write_text(json.dumps([["asyncio, zeroconf.asyncio, pynvml, sqlite3",
                                                 ["asyncio", "zeroconf.asyncio", "pynvml", "sqlite3"]]]))
    no_aiohttp = json.loads(subprocess.run([sys.executable, "-c", LADDER, str(tmp / "steps2.json")],
                                           capture_output=True, text=True, check=True).stdout)
    print(f"Without aiohttp, the other libraries import to {no_aiohttp[-1][1] / 1024:.1f} MiB.")


def visible(args: argparse.Namespace) -> None:
    import threading

    from zeroconf import IPVersion, ServiceBrowser, ServiceStateChange, Zeroconf

    seen: dict[str, float] = {}
    lock = threading.Lock()

    def on_change(zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        if state_change is ServiceStateChange.Added:
            with lock:
                seen.setdefault(name.split(".")[0].split("-")[0], time.monotonic())  # <host>-<node id>

    zc = Zeroconf(interfaces=["127.0.0.1"], ip_version=IPVersion.V4Only)
    browser = ServiceBrowser(zc, "_gpusd._tcp.local.", handlers=[on_change])
    fake = FakeEnv(gpus(args.gpus))
    results: dict[str, list[float]] = {"gpusd start": [], "floor": []}
    ready: list[float] = []

    def wait_seen(label: str, t0: float, limit: float = 15.0) -> float | None:
        end = time.monotonic() + limit
        while time.monotonic() < end:
            with lock:
                if label in seen:
                    return seen[label] - t0
            time.sleep(0.005)
        return None

    try:
        time.sleep(1)
        for _ in range(args.rounds):
            label = f"vis{secrets.token_hex(3)}"
            state = Path(tempfile.mkdtemp(prefix="gpusd-bench-vis-"))
            atexit.register(shutil.rmtree, state, ignore_errors=True)
            env = dict(fake.env, GPUSD_INTERFACES="127.0.0.1", GPUSD_STATE_DIR=str(state))
            t0 = time.monotonic()
            proc, _ = start_ready([sys.executable, "-m", "gpusd", "start", "--foreground", "--interface", "127.0.0.1",
                                   "--port", "0", "--session", f"bench-{label}", "--hostname", label], env)
            ready.append(time.monotonic() - t0)
            took = wait_seen(label, t0)
            stop(proc)
            if took is not None:
                results["gpusd start"].append(took)
            flabel = f"floor{secrets.token_hex(3)}"
            t0 = time.monotonic()
            fproc = subprocess.Popen([sys.executable, "-c", FLOOR_REGISTER, flabel], stdin=subprocess.DEVNULL)
            took = wait_seen(flabel, t0)
            fproc.kill()
            fproc.wait()
            if took is not None:
                results["floor"].append(took)
    finally:
        browser.cancel()
        zc.close()
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"load avg {os.getloadavg()[0]:.1f}; a browser on 127.0.0.1, {args.rounds} interleaved rounds")
    print()
    print("| from process spawn to a browser's Added | median s | min s | max s | seen |")
    print("|---|---|---|---|---|")
    for name, label in (("gpusd start", "`gpusd start` (8 fake GPUs)"),
                        ("floor", "floor: a bare python-zeroconf registration (python start-up included)")):
        xs = sorted(results[name])
        if xs:
            print(f"| {label} | {xs[len(xs) // 2]:.2f} | {xs[0]:.2f} | {xs[-1]:.2f} | {len(xs)}/{args.rounds} |")
        else:
            print(f"| {label} | - | - | - | 0/{args.rounds} |")
    print(f"| `gpusd start` ready (its --ready-fd line) | {sorted(ready)[len(ready) // 2]:.2f} | "
          f"{min(ready):.2f} | {max(ready):.2f} | |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["serve", "memory", "visible"])
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--before", metavar="SRC", help="serve, memory: also a daemon from this src directory (e.g. a "
                    "worktree of the base commit), in the same rounds")
    ap.add_argument("--no-site", action="store_true",
                    help="memory: also every process without site (-S): this machine's .pth files not run")
    ap.add_argument("--breakdown", action="store_true", help="memory: where the daemon's RSS goes")
    ap.add_argument("--callgrind", type=int, metavar="N", default=0,
                    help="serve: also count the instructions per request of each server under valgrind (N requests "
                         "per server and path; needs valgrind)")
    ap.add_argument("--no-netns", dest="netns", action="store_false",
                    help="serve, memory: run on this machine's loopback, not in a namespace of their own")
    args = ap.parse_args()
    {"serve": serve, "memory": memory, "visible": visible}[args.what](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
