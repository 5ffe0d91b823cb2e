"""Issue 5 benchmark: the daemon's HTTP API under load, and its CPU share, on loopback.

    python bench/bench_http.py [--gpus 8] [--seconds 10] [--cpu-seconds 20] [--concurrency 16]
    python bench/bench_http.py --trust [--seconds 5]     # issue 9: the cost of signatures and TLS
    python bench/bench_http.py --trust --before OLD/src [--rounds 2]   # and another tree's, alternately

With ``--trust`` the daemon gets a fleet secret (``--token-file``) and ``GET /api/v1/gpus`` is loaded
four ways in the same run, in turns of one second each (``--seconds`` of each in all, so that other
work on the machine weighs on each alike): unsigned on the HTTP port (today's public read), signed
with RFC 9421 (a fresh signature per request, checked by the daemon, its signed answer checked by
the client), signed over HTTPS with the pinned certificate on every request, and over HTTPS with one
signature per connection.  The load client signs and verifies in this process: its cost is counted
in the latencies, as a real client's would be.  With ``--before``, whole runs of this tree and of
another (daemon and client both) alternate.

One real daemon (``gpusd start --foreground``, 1 s sampling) on the fake NVML with 8 GPUs (two
processes each), HTTP and mDNS on 127.0.0.1 only, in a session of its own.  Measured from this
process (a different process from the daemon):

1. the daemon's CPU share (process CPU time / wall time) over ``--cpu-seconds``, idle;
2. the same with 10 subscribers on ``/api/v1/events``;
The GPUs' load changes twice a second, so every sample sends a snapshot event to every subscriber.

3. with the 10 subscribers still attached: ``--concurrency`` clients fetching ``GET /api/v1/gpus`` as
   fast as they can for ``--seconds`` (requests per second, latency percentiles), then the same for
   ``GET /metrics``.

Client and daemon share the machine's cores: the figures are a floor for the daemon, not a
ceiling.  Nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import os
import platform
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import FakeEnv, FakeProcess, make_gpus, pct, start_ready, stop

GiB = 2**30


def gpus(n: int):
    out = make_gpus(n, memory_used=12 * GiB, util_gpu=35, util_memory=10, temperature=50, power_usage=180_000)
    for g in out:
        g.processes = [FakeProcess(os.getpid(), 4 * GiB), FakeProcess(os.getppid(), 2 * GiB)]
    return out


def start_daemon(fake: FakeEnv, interval: float, secret: str | None = None) -> tuple[subprocess.Popen[bytes], dict]:
    state = Path(tempfile.mkdtemp(prefix="gpusd-bench-http-"))
    atexit.register(shutil.rmtree, state, ignore_errors=True)
    env = dict(fake.env, GPUSD_INTERFACES="127.0.0.1", GPUSD_STATE_DIR=str(state))
    argv = [sys.executable, "-m", "gpusd", "start", "--foreground", "--interface", "127.0.0.1", "--port", "0",
            "--session", f"bench-{secrets.token_hex(3)}", "--interval", str(interval), "--hostname", "bench-host"]
    if secret is not None:
        key_file = state / "fleet.key"
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, secret.encode())
        os.close(fd)
        argv += ["--token-file", str(key_file)]
    proc, line = start_ready(argv, env, state / "gpusd.log")
    return proc, json.loads(line)


def cpu_seconds(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


async def cpu_share(pid: int, seconds: float) -> float:
    c0, t0 = cpu_seconds(pid), time.monotonic()
    await asyncio.sleep(seconds)
    return (cpu_seconds(pid) - c0) / (time.monotonic() - t0)


async def subscriber(session, url: str, counts: list[int], i: int) -> None:
    async with session.get(url, timeout=None) as resp:
        async for line in resp.content:
            if line.startswith(b"event:"):
                counts[i] += 1


async def load(session, url: str, seconds: float, concurrency: int) -> tuple[int, list[float], int]:
    latencies: list[float] = []
    errors = 0
    end = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal errors
        while time.perf_counter() < end:
            t = time.perf_counter()
            try:
                async with session.get(url) as resp:
                    await resp.read()
                    ok = resp.status == 200
            except Exception:  # noqa: BLE001 - counted, the run goes on
                ok = False
            if ok:
                latencies.append(time.perf_counter() - t)
            else:
                errors += 1

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return len(latencies), latencies, errors


async def drift(fake: FakeEnv, state: list) -> None:
    """Change every GPU's load twice a second, so every sample is a new snapshot event."""
    k = 0
    while True:
        k += 1
        for i, g in enumerate(state):
            g.util_gpu = (k * 7 + i * 13) % 100
            g.memory_used = ((k + i) % 60 + 4) * GiB
        fake.write(state)
        await asyncio.sleep(0.5)


async def bench(args: argparse.Namespace) -> None:
    import aiohttp

    state = gpus(args.gpus)
    fake = FakeEnv(state)
    proc, info = start_daemon(fake, args.interval)
    base = f"http://127.0.0.1:{info['port']}"
    drifter = asyncio.create_task(drift(fake, state))
    try:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            await asyncio.sleep(2)  # let start-up settle
            idle = await cpu_share(proc.pid, args.cpu_seconds)
            counts = [0] * args.subscribers
            subs = [asyncio.create_task(subscriber(session, f"{base}/api/v1/events", counts, i))
                    for i in range(args.subscribers)]
            await asyncio.sleep(1)
            with_subs = await cpu_share(proc.pid, args.cpu_seconds)
            events = sum(counts)
            results = {}
            for path in ("/api/v1/gpus", "/metrics"):
                async with session.get(base + path) as r:
                    size = len(await r.read())
                c0, t0 = cpu_seconds(proc.pid), time.monotonic()
                n, lat, errors = await load(session, base + path, args.seconds, args.concurrency)
                wall = time.monotonic() - t0
                results[path] = (n / wall, pct(lat, 50) * 1000, pct(lat, 99) * 1000, errors, size,
                                 (cpu_seconds(proc.pid) - c0) / wall)
            alive = sum(1 for t in subs if not t.done())
            for t in subs:
                t.cancel()
            await asyncio.gather(*subs, return_exceptions=True)
    finally:
        drifter.cancel()
        stop(proc)

    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
          f"daemon on the fake NVML with {args.gpus} GPUs, sampling every {args.interval:g} s")
    print()
    print("| daemon CPU share (1 s sampling) | % of one core |")
    print("|---|---|")
    print(f"| idle, no subscriber | {100 * idle:.1f} |")
    print(f"| {args.subscribers} subscribers on /api/v1/events | {100 * with_subs:.1f} |")
    print()
    print(f"{events} events reached the {args.subscribers} subscribers in {args.cpu_seconds:g} s; "
          f"{alive} of them still attached after the load runs")
    print()
    print(f"| with {args.subscribers} subscribers attached, {args.concurrency} concurrent clients | answer bytes | "
          "requests/s | p50 ms | p99 ms | errors | daemon CPU % | daemon CPU ms a request |")
    print("|---|---|---|---|---|---|---|---|")
    for path, (rps, p50, p99, errors, size, cpu) in results.items():
        print(f"| GET {path} | {size} | {rps:.0f} | {p50:.2f} | {p99:.2f} | {errors} | {100 * cpu:.0f} | "
              f"{1000 * cpu / rps:.2f} |")


async def signed_load(session, url: str, seconds: float, concurrency: int, key, node_id: str,
                      ssl_arg=True, cert_fp: str | None = None) -> tuple[int, list[float], int]:
    """Like :func:`load`, each request freshly signed and its answer's proof checked."""
    from gpusd.wire.signing import Headers, Request, Response

    latencies: list[float] = []
    errors = 0
    end = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal errors
        while time.perf_counter() < end:
            t = time.perf_counter()
            try:
                headers, nonce = key.sign_request("GET", url, node_id=node_id, cert_fp=cert_fp)
                async with session.get(url, headers=headers, ssl=ssl_arg) as resp:
                    body = await resp.read()
                    answer = Response(resp.status, Request("GET", url, Headers(headers)), Headers(resp.headers.items()))
                    ok = resp.status == 200 and key.verify_response(answer, nonce, node_id, body=body)
            except Exception:  # noqa: BLE001 - counted, the run goes on
                ok = False
            if ok:
                latencies.append(time.perf_counter() - t)
            else:
                errors += 1

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return len(latencies), latencies, errors


async def session_load(url: str, seconds: float, concurrency: int, key, node_id: str,
                       ssl_arg, sessions: list | None = None,
                       cert_fp: str | None = None) -> tuple[int, list[float], int]:
    """HTTPS keep-alive connections, one per worker: the first request signed and its proof checked
    (which authenticates the TLS connection), the following ones plain reads on that connection.
    ``sessions``: the workers' ``[session, signed yet]`` pairs, kept from one call to the next (the
    caller closes them); None: made and closed here."""
    import aiohttp

    from gpusd.wire.signing import Headers, Request, Response

    latencies: list[float] = []
    errors = 0
    end = time.perf_counter() + seconds
    own = sessions is None
    if sessions is None:
        sessions = []
    while len(sessions) < concurrency:
        sessions.append([aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)), False])

    async def worker(state: list) -> None:
        nonlocal errors
        session = state[0]
        while time.perf_counter() < end:
            t = time.perf_counter()
            first = not state[1]
            try:
                headers, nonce = key.sign_request("GET", url, node_id=node_id, cert_fp=cert_fp) if first else ({}, "")
                async with session.get(url, headers=headers, ssl=ssl_arg) as resp:
                    body = await resp.read()
                    ok = resp.status == 200
                    if first:
                        answer = Response(resp.status, Request("GET", url, Headers(headers)),
                                          Headers(resp.headers.items()))
                        ok = ok and key.verify_response(answer, nonce, node_id, body=body)
                        state[1] = ok
            except Exception:  # noqa: BLE001 - counted, the run goes on
                ok = False
            if ok:
                latencies.append(time.perf_counter() - t)
            else:
                errors += 1

    try:
        await asyncio.gather(*(worker(state) for state in sessions[:concurrency]))
    finally:
        if own:
            for session, _ in sessions:
                await session.close()
    return len(latencies), latencies, errors


async def bench_trust(args: argparse.Namespace) -> None:
    import aiohttp

    from gpusd.wire.signing import FleetKey, fingerprint_bytes

    secret = secrets.token_hex(32)
    load0 = os.getloadavg()[0]
    state = gpus(args.gpus)
    fake = FakeEnv(state)
    proc, info = start_daemon(fake, args.interval, secret)
    key = FleetKey(secret)
    node = info["node_id"]
    plain = f"http://127.0.0.1:{info['port']}/api/v1/gpus"
    tls = f"https://127.0.0.1:{info['tls_port']}/api/v1/gpus"
    pin = aiohttp.Fingerprint(fingerprint_bytes(info["cert_fp"]))
    rows = []
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            await asyncio.sleep(1)
            kept: list = []  # the HTTPS connections of the last kind, kept from one turn to the next
            kinds = [
                ("unsigned, HTTP (public read)", lambda t: load(session, plain, t, args.concurrency)),
                ("signed (RFC 9421), HTTP", lambda t: signed_load(session, plain, t, args.concurrency, key, node)),
                ("signed, HTTPS (pinned), every request",
                 lambda t: signed_load(session, tls, t, args.concurrency, key, node, pin, info["cert_fp"])),
                ("HTTPS (pinned), one signature per connection",
                 lambda t: session_load(tls, t, args.concurrency, key, node, pin, kept, info["cert_fp"])),
            ]
            # the kinds in turns of one second each, --seconds of each in all: what else runs on the
            # machine meanwhile weighs on every kind alike (one run of each after the other did not)
            slices = max(1, round(args.seconds))
            got: dict[str, list] = {name: [0, [], 0, 0.0, 0.0] for name, _ in kinds}
            for i in range(slices):
                for name, run in kinds[i % len(kinds):] + kinds[:i % len(kinds)]:
                    c0, t0 = cpu_seconds(proc.pid), time.monotonic()
                    n, lat, errors = await run(args.seconds / slices)
                    acc = got[name]
                    acc[0] += n
                    acc[1] += lat
                    acc[2] += errors
                    acc[3] += cpu_seconds(proc.pid) - c0
                    acc[4] += time.monotonic() - t0
            for kept_session, _ in kept:
                await kept_session.close()
            for name, _ in kinds:
                n, lat, errors, cpu, wall = got[name]
                rows.append((name, n / wall, pct(lat, 50) * 1000, pct(lat, 99) * 1000, errors, cpu / wall))
    finally:
        stop(proc)
    if args.json:
        print(json.dumps({"load": load0, "rows": rows}))
        return
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, load average "
          f"{load0:.1f}; daemon on the fake NVML with {args.gpus} GPUs; {args.concurrency} concurrent clients, "
          f"{args.seconds:g} s each, client and daemon on one machine")
    print()
    trust_table([("", rows)])


def trust_table(runs: list[tuple[str, list]]) -> None:
    print("| GET /api/v1/gpus | run | requests/s | vs unsigned | p50 ms | p99 ms | errors | daemon CPU % "
          "| daemon CPU ms per request |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, rows in runs:
        base = rows[0][1] or 1
        for name, rps, p50, p99, errors, cpu in rows:
            print(f"| {name} | {label} | {rps:.0f} | **{rps / base:.2f}x** | {p50:.2f} | {p99:.2f} | {errors} "
                  f"| {100 * cpu:.0f} | {1000 * cpu / rps if rps else float('nan'):.3f} |")


def trust_rounds(args: argparse.Namespace) -> None:
    """``--trust`` with ``--before``: this tree and the other, whole runs alternately (each in a process
    of its own, its daemon and its client both from that tree), ``--rounds`` times."""
    trees = [("after", str(Path(__file__).resolve().parent.parent / "src")), ("before", args.before)]
    runs: list[tuple[str, list]] = []
    loads = []
    for r in range(args.rounds):
        for name, src in (trees if r % 2 == 0 else trees[::-1]):
            argv = [sys.executable, __file__, "--trust", "--json", "--seconds", str(args.seconds), "--gpus",
                    str(args.gpus), "--interval", str(args.interval), "--concurrency", str(args.concurrency)]
            out = subprocess.run(argv, env=dict(os.environ, PYTHONPATH=os.path.abspath(src)), capture_output=True,
                                 text=True, timeout=600, check=True).stdout
            got = json.loads(out.strip().splitlines()[-1])
            loads.append(got["load"])
            runs.append((f"{name} {r + 1} (load {got['load']:.1f})", got["rows"]))
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, load average "
          f"{min(loads):.1f}-{max(loads):.1f}; daemon on the fake NVML with {args.gpus} GPUs; {args.concurrency} "
          f"concurrent clients, {args.seconds:g} s each, client and daemon on one machine; before: {args.before}")
    print()
    trust_table(runs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--interval", type=float, default=1.0, help="daemon sampling interval (default 1 s)")
    ap.add_argument("--seconds", type=float, default=10.0, help="load duration per endpoint")
    ap.add_argument("--cpu-seconds", type=float, default=20.0, help="CPU share measuring window")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--subscribers", type=int, default=10)
    ap.add_argument("--trust", action="store_true", help="unsigned vs signed vs TLS (issue 9)")
    ap.add_argument("--before", metavar="SRC", help="--trust: also another tree's src directory (e.g. a worktree of "
                    "the base commit), whole runs alternately with this one")
    ap.add_argument("--rounds", type=int, default=2, help="--trust --before: runs of each tree (default 2)")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trust and args.before:
        trust_rounds(args)
    else:
        asyncio.run(bench_trust(args) if args.trust else bench(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
