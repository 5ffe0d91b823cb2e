"""Issue 24 benchmark, the daemon: its answers beside bare aiohttp, signed reads, memory at rest, and
how soon a new host is visible.  Everything on loopback (127.0.0.1), bounded in time and count.

    python bench/bench_daemon.py serve   [--seconds 5] [--rounds 3] [--concurrency 16] [--before OLD/src]
    python bench/bench_daemon.py memory  [--gpus 8] [--seconds 20]
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
    r, w = os.pipe()
    argv = [sys.executable, "-m", "gpusd", "start", "--foreground", "--interface", "127.0.0.1", "--port", "0",
            "--session", f"bench-{secrets.token_hex(3)}", "--interval", str(interval), "--hostname", "bench-host",
            "--ready-fd", str(w), *(extra or [])]
    with open(state / "gpusd.log", "ab") as log:
        proc = subprocess.Popen([*PREFIX, *(wrap or []), *argv], env=env, stdout=log, stderr=log, pass_fds=(w,),
                                stdin=subprocess.DEVNULL)
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


def memory(args: argparse.Namespace) -> None:
    import psutil

    place = where(args)
    fake = FakeEnv(gpus(args.gpus))
    proc, _ = start_daemon(fake, interval=1.0)
    port = free_port()
    peer = None
    if shutil.which("nvitop-exporter"):
        peer = subprocess.Popen([*PREFIX, "nvitop-exporter", "--bind-address", "127.0.0.1", "--port", str(port),
                                 "--interval", "1"], env=fake.env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    try:
        if peer is not None:
            wait_port(port, 30)
        time.sleep(3)  # start-up settles
        procs = {"gpusd start": proc.pid, **({"nvitop-exporter": peer.pid} if peer else {})}
        c0 = {k: cpu_seconds(v) for k, v in procs.items()}
        t0 = time.monotonic()
        time.sleep(args.seconds)
        wall = time.monotonic() - t0
        rows = []
        for k, pid in procs.items():
            mi = psutil.Process(pid).memory_full_info()
            rows.append((k, mi.rss / 2**20, mi.uss / 2**20, (cpu_seconds(pid) - c0[k]) / wall))
    finally:
        stop(proc)
        if peer is not None:
            stop(peer)  # type: ignore[arg-type]
    floor = subprocess.run([sys.executable, "-c", "import aiohttp.web, zeroconf.asyncio; "
                            "print(open('/proc/self/status').read().split('VmRSS:')[1].split()[0])"],
                           capture_output=True, text=True).stdout.strip()
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"load avg {os.getloadavg()[0]:.1f}; fake NVML with {args.gpus} GPUs, 1 s sampling, at rest for "
          f"{args.seconds:g} s, {place}")
    print()
    print("| process | RSS MiB | USS MiB | CPU % of one core |")
    print("|---|---|---|---|")
    for k, rss, uss, cpu in rows:
        print(f"| {k} | {rss:.1f} | {uss:.1f} | {100 * cpu:.2f} |")
    if not peer:
        print("| nvitop-exporter | not installed (pip install nvitop-exporter) | | |")
    print(f"| floor: python -c 'import aiohttp.web, zeroconf.asyncio' | {int(floor) / 1024:.1f} | | |")


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
            r, w = os.pipe()
            t0 = time.monotonic()
            proc = subprocess.Popen(
                [sys.executable, "-m", "gpusd", "start", "--foreground", "--interface", "127.0.0.1", "--port", "0",
                 "--session", f"bench-{label}", "--hostname", label, "--ready-fd", str(w)],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, pass_fds=(w,),
                stdin=subprocess.DEVNULL)
            os.close(w)
            with os.fdopen(r) as f:
                f.readline()
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
    ap.add_argument("--callgrind", type=int, metavar="N", default=0,
                    help="serve: also count the instructions per request of each server under valgrind (N requests "
                         "per server and path; needs valgrind)")
    ap.add_argument("--before", metavar="SRC", help="serve: also a daemon from this tree's src directory (e.g. a "
                    "worktree of the base commit), in the same rounds")
    ap.add_argument("--no-netns", dest="netns", action="store_false",
                    help="serve, memory: run on this machine's loopback, not in a namespace of their own")
    args = ap.parse_args()
    {"serve": serve, "memory": memory, "visible": visible}[args.what](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
