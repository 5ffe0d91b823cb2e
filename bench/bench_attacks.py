"""Issue 9, finding 7: a daemon under a slowloris and under a flood of fake services, before/after.

    python bench/bench_attacks.py [--connections 1000] [--services 1000] [--seconds 10] [--old REV]

For each code version (this tree, and with ``--old REV`` the ``src/`` of that git revision, e.g.
``bc3d827``, unpacked into a temporary directory), one real background daemon (``gpusd start``,
simulated GPUs, HTTP and mDNS on 127.0.0.1 only, its own session and state directory) is started
with an open-file soft limit of 1024 (a common default), then attacked from this process:

1. **slowloris**: ``--connections`` connections to its HTTP port, each sending half a request head
   and one more header byte every 2 s; any connection the daemon closes is opened again at once.
2. **service flood**: ``--services`` fake ``_gpusd._tcp`` services of the daemon's session announced
   from a zeroconf bound to 127.0.0.1, each pointing at a tar pit on 127.0.0.1 (accepts connections,
   never answers), and one ``GET /api/v1/fleet`` to make the daemon follow them.

During each attack (``--seconds`` long) a client sends ``GET /api/v1/gpus`` once every 0.5 s on a
new connection (timeout 5 s).  Printed per version and attack: answers, failures, the slowest
answer, and how much the daemon's log (``gpusd.log`` and its rotated files) grew.  Everything stops
by itself; nothing leaves 127.0.0.1.

``--identity``: issue 39's identity and request attacks instead (rows 1, 2, 3, 5 in process, row 12
on two loopback daemons), per version, with ``--old REV`` before and after: bench/_attacks_identity.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

HEAD = b"GET /api/v1/gpus HTTP/1.1\r\nHost: 127.0.0.1\r\nX-a: "
SOFT_LIMIT = 1024


@dataclass
class Probe:
    ok: int = 0
    failed: int = 0
    latencies: list[float] = field(default_factory=list)

    def row(self) -> str:
        worst = max(self.latencies) if self.latencies else float("nan")
        return f"{self.ok} | {self.failed} | {1000 * worst:.0f}"


def fd_count(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


async def max_fds(pid: int, stop: asyncio.Event) -> int:
    most = 0
    while not stop.is_set():
        most = max(most, fd_count(pid))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.25)
    return most


def log_bytes(state: Path) -> int:
    return sum(p.stat().st_size for p in state.glob("gpusd.log*") if p.is_file())


def start_daemon(src: Path, state: Path, session: str) -> tuple[int, int]:
    """``gpusd start`` (background) from ``src``; returns (pid, port)."""
    import json

    env = dict(os.environ, PYTHONPATH=str(src), GPUSD_STATE_DIR=str(state), GPUSD_INTERFACES="127.0.0.1",
               GPUSD_MDNS_FAST="1")
    env.pop("GPUSD_TOKEN", None)

    def low_limit() -> None:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(SOFT_LIMIT, hard), hard))

    r = subprocess.run([sys.executable, "-m", "gpusd", "start", "--simulate", "2xA100-80GB", "--interface",
                        "127.0.0.1", "--port", "0", "--session", session, "--hostname", "bench-attacked"],
                       env=env, capture_output=True, text=True, timeout=60, preexec_fn=low_limit, check=False)
    if r.returncode != 0:
        raise SystemExit(f"the daemon did not start: {r.stderr}")
    info = json.loads((state / "gpusd.json").read_text())
    return int(info["pid"]), int(info["port"])


def stop_daemon(src: Path, state: Path, pid: int) -> None:
    env = dict(os.environ, PYTHONPATH=str(src), GPUSD_STATE_DIR=str(state))
    subprocess.run([sys.executable, "-m", "gpusd", "stop", "--force", "--timeout", "10"], env=env,
                   capture_output=True, timeout=60, check=False)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, 0)
        os.kill(pid, 9)


async def probe(port: int, seconds: float, path: str = "/api/v1/gpus") -> Probe:
    import aiohttp

    out = Probe()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t = time.perf_counter()
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s, \
                    s.get(f"http://127.0.0.1:{port}{path}", timeout=aiohttp.ClientTimeout(total=5)) as r:
                await r.read()
                good = r.status == 200
        except Exception:  # noqa: BLE001 - a failure is what we count
            good = False
        if good:
            out.ok += 1
            out.latencies.append(time.perf_counter() - t)
        else:
            out.failed += 1
        await asyncio.sleep(max(0.0, 0.5 - (time.perf_counter() - t)))
    return out


async def slowloris(port: int, n: int, seconds: float) -> tuple[int, int]:
    """Keep ``n`` half-open connections for ``seconds``; returns (connections opened, closed by the daemon)."""
    conns: dict[int, asyncio.StreamWriter] = {}
    opened = closed = 0
    end = time.monotonic() + seconds

    async def one(i: int) -> None:
        nonlocal opened
        try:
            _, w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 3)
            w.write(HEAD)
            conns[i] = w
            opened += 1
        except (OSError, asyncio.TimeoutError):
            pass

    while time.monotonic() < end:
        missing = [i for i in range(n) if i not in conns]
        for k in range(0, len(missing), 200):
            await asyncio.gather(*(one(i) for i in missing[k:k + 200]))
        for i, w in list(conns.items()):
            if w.transport.is_closing() or w.transport.get_extra_info("socket") is None:
                del conns[i]
                closed += 1
                continue
            try:
                w.write(b"a")  # one more header byte: the classic slowloris keep-alive
            except (OSError, RuntimeError):
                del conns[i]
                closed += 1
        await asyncio.sleep(2.0)
        for i, w in list(conns.items()):  # connections the daemon closed: reader at EOF
            reader = getattr(w, "_protocol", None)
            stream = getattr(reader, "_stream_reader", None)
            if stream is not None and stream.at_eof():
                w.transport.abort()
                del conns[i]
                closed += 1
    for w in conns.values():
        w.transport.abort()
    return opened, closed


async def flood(port: int, session: str, n: int, seconds: float) -> tuple[Probe, str]:
    """Announce ``n`` fake services pointing at a tar pit, ask for the fleet, probe the API."""
    import aiohttp
    from zeroconf import ServiceInfo

    from gpusd.wire.mdns import open_zeroconf
    from gpusd.wire.txt import SERVICE_TYPE, encode_txt

    held: list[asyncio.StreamWriter] = []

    async def tarpit(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # accept, never answer

    pit = await asyncio.start_server(tarpit, "127.0.0.1", 0, backlog=2048)
    pit_port = pit.sockets[0].getsockname()[1]
    zc = await open_zeroconf(["127.0.0.1"])
    tag = secrets.token_hex(3)
    infos = [ServiceInfo(SERVICE_TYPE, f"fake-{tag}-{i}.{SERVICE_TYPE}", port=pit_port, server=f"fake-{tag}-{i}.local.",
                         parsed_addresses=["127.0.0.1"],
                         properties=encode_txt(node_id=f"{tag}{i:05d}", hostname=f"fake-{i}", session=session,
                                               inventory=[("A100-SXM4-80GB", 81920)], free=1))
             for i in range(n)]
    fleet = "?"
    try:
        for k in range(0, n, 100):
            tasks = await asyncio.gather(*(zc.async_register_service(i, cooperating_responders=True)
                                           for i in infos[k:k + 100]))
            await asyncio.gather(*tasks)

        async def ask_fleet() -> str:
            t = time.perf_counter()
            try:
                async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/api/v1/fleet",
                                                               timeout=aiohttp.ClientTimeout(total=30)) as r:
                    body = await r.json()
                    return (f"HTTP {r.status} in {time.perf_counter() - t:.1f} s, {len(body.get('hosts', []))} "
                            f"hosts listed, {body.get('hosts_dropped', 'n/a')} dropped")
            except Exception as exc:  # noqa: BLE001
                return f"failed after {time.perf_counter() - t:.1f} s ({exc.__class__.__name__})"

        fleet_task = asyncio.ensure_future(ask_fleet())
        result = await probe(port, seconds)
        fleet = await fleet_task
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(zc.async_close(), 10)  # goodbyes for every fake service
        pit.close()
        for w in held:
            w.transport.abort()
    return result, fleet


async def attack(label: str, src: Path, args: argparse.Namespace) -> list[str]:
    state = Path(tempfile.mkdtemp(prefix="gpusd-bench-attack-"))
    session = f"attack-{secrets.token_hex(3)}"
    rows: list[str] = []
    pid, port = start_daemon(src, state, session)
    try:
        await asyncio.sleep(1.0)
        base = await probe(port, 2.0)
        before = log_bytes(state)
        rows.append(f"| {label} | none | {base.row()} | {log_bytes(state) - before} | |")

        async def phase(name: str, loris: int, services: int) -> None:
            before = log_bytes(state)
            stop = asyncio.Event()
            fds = asyncio.ensure_future(max_fds(pid, stop))
            attackers = []
            if loris:
                attackers.append(asyncio.ensure_future(slowloris(port, loris, args.seconds + 3)))
                await asyncio.sleep(3.0)  # let the connections pile up first
            if services:
                during, fleet = await flood(port, session, services, args.seconds)
                notes = [f"fleet: {fleet}"]
            else:
                during, notes = await probe(port, args.seconds), []
            for a in attackers:
                opened, closed = await a
                notes.insert(0, f"{opened} opened, {closed} closed by the daemon")
            stop.set()
            notes.append(f"daemon fds at most {await fds}")
            rows.append(f"| {label} | {name} | {during.row()} | {log_bytes(state) - before} | {'; '.join(notes)} |")
            await asyncio.sleep(2.0)

        await phase(f"slowloris, {args.connections} connections", args.connections, 0)
        await phase(f"flood, {args.services} fake services", 0, args.services)
        await phase("both at once", args.connections, args.services)
    finally:
        stop_daemon(src, state, pid)
        if args.keep_logs:
            print(f"{label}: the daemon's log is in {state}", file=sys.stderr)
        else:
            shutil.rmtree(state, ignore_errors=True)
    return rows


def old_tree(rev: str) -> Path:
    tmp = Path(tempfile.mkdtemp(prefix="gpusd-old-"))
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "src"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
    return tmp


async def main_async(args: argparse.Namespace) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the attacker needs descriptors too
    versions = [("this tree", REPO / "src")]
    cleanup: list[Path] = []
    if args.old:
        old = old_tree(args.old)
        cleanup.append(old)
        versions.insert(0, (f"old ({args.old})", old / "src"))
    rows: list[str] = []
    try:
        for label, src in versions:
            rows += await attack(label, src, args)
    finally:
        for p in cleanup:
            shutil.rmtree(p, ignore_errors=True)
    print(f"daemon open-file soft limit at start: {SOFT_LIMIT}; each attack {args.seconds:g} s; "
          f"GET /api/v1/gpus every 0.5 s on a new connection, 5 s timeout")
    print()
    print("| code | attack | answers | failures | slowest answer ms | log growth bytes | notes |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(row)


def identity(args: argparse.Namespace) -> int:
    """Issue 39's identity and request rows, per code version (bench/_attacks_identity.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _attacks_identity import report

    versions = [("this tree", REPO / "src")]
    old = old_tree(args.old) if args.old else None
    if old is not None:
        versions.insert(0, (f"old ({args.old})", old / "src"))
    try:
        rows = report(versions, min(args.seconds, 30.0))
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    print("| code | row (issue 39) | what the attacker got |")
    print("|---|---|---|")
    for row in rows:
        print(row)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connections", type=int, default=1000)
    ap.add_argument("--services", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=10.0, help="length of each attack (default 10)")
    ap.add_argument("--keep-logs", action="store_true", help="keep each daemon's state directory (and log)")
    ap.add_argument("--old", metavar="REV", help="also attack the daemon of this git revision (e.g. bc3d827)")
    ap.add_argument("--identity", action="store_true",
                    help="instead: issue 39's identity and request attacks (rows 1, 2, 3, 5, 12: "
                    "bench/_attacks_identity.py)")
    args = ap.parse_args()
    if args.identity:
        return identity(args)
    if not 1 <= args.connections <= 5000 or not 1 <= args.services <= 5000 or not 1 <= args.seconds <= 60:
        ap.error("bounded: at most 5000 connections/services and 60 s per attack")
    asyncio.run(main_async(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
