"""Issue 24 benchmark: a fleet of 1,000 hosts, listed from a host with a daemon.

    python bench/bench_fleet_scale.py [--sizes 32,100,1000] [--gpus 8] [--runs 5] [--loads 0,3] [--no-secret]

One process (this file with ``--fakes``) serves ``max(sizes)`` fake gpusd hosts over HTTP, each on an
address of its own on loopback (``127.1.x.y``, port 4780: Linux answers for all of 127.0.0.0/8 without
setup), and a wide-area DNS-SD zone for them (a small dnspython server, UDP and TCP, on
``127.0.53.1:53``; one domain ``nN.fleet.test`` per size, listing the first N hosts).  Each fake host
answers what a daemon's follower asks of a daemon: ``/api/v1/events`` (its snapshot, again every
``--sample`` s with a new time stamp, heartbeats between), ``/healthz`` and ``/api/v1/host``.  With the
fleet secret (the default) every stream is signed like a 0.3 daemon's: the proof names the node, its
host name and its address, so the follower believes the name (docs/security.md, "What a client
believes").

For each size a real daemon (``gpusd start --simulate 2xA100-80GB --interface 127.0.0.1 --fleet-view on
--dns-sd-domain nN.fleet.test --dns-server 127.0.53.1``, a state directory and a session of its own)
follows them; once its fleet view lists all N the bench measures the daemon's RSS, open descriptors and
CPU, the time of ``GET /api/v1/fleet``, and times a cold ``gpusd list --json`` run from that host (it
asks the daemon's fleet view).  Beside it: a cold one-shot ``gpusd list`` without a daemon, browsing
the 32-host zone itself (``--dns-sd-domain``).  Nothing leaves loopback; every process is stopped by pid.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from _load import busy_load

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

DNS_ADDR = "127.0.53.1"  # the zone's server (port 53: the daemon's --dns-server takes an address only)
ZONE = "fleet.test."
PORT = 4780
GOAL = 2.0  # s: a host with a daemon lists 1,000 hosts


def fake_address(i: int) -> str:
    return f"127.1.{i // 250}.{i % 250 + 1}"


def fake_name(i: int) -> str:
    return f"fake-{i:04d}"


def fake_node(tag: str, i: int) -> str:
    return f"{tag}{i:06x}"


# -- the fake hosts (a process of their own: `--fakes`) ---------------------------------------------
def zone_rrsets(n_max: int, sizes: list[int], tag: str, session: str, gpus: int, auth: bool) -> dict[Any, Any]:
    """(name, rdtype) -> rrset for every domain nN.fleet.test."""
    import dns.name
    import dns.rdataclass
    import dns.rdatatype
    import dns.rrset
    from dns.rdtypes.ANY.TXT import TXT

    from gpusd.wire.txt import encode_txt

    out: dict[tuple[Any, int], Any] = {}

    def add(name: str, rdtype: Any, text: str) -> None:
        key = (dns.name.from_text(name), rdtype)
        rrset = out.get(key)
        if rrset is None:
            rrset = out[key] = dns.rrset.RRset(key[0], dns.rdataclass.IN, rdtype)
            rrset.ttl = 300
        rrset.add(dns.rdata.from_text(dns.rdataclass.IN, rdtype, text))

    import dns.rdata

    for i in range(n_max):
        props = encode_txt(node_id=fake_node(tag, i), hostname=fake_name(i), session=session,
                           inventory=[("H100-SXM5-80GB", 81559)] * gpus, free=gpus, simulated=True, auth=auth)
        txt = TXT(dns.rdataclass.IN, dns.rdatatype.TXT, [f"{k}={v}".encode() for k, v in props.items()]).to_text()
        target = f"{fake_name(i)}.{ZONE}"
        add(target, dns.rdatatype.A, fake_address(i))
        for n in sizes:
            if i >= n:
                continue
            service = f"_gpusd._tcp.n{n}.{ZONE}"
            instance = f"{fake_name(i)}.{service}"
            add(service, dns.rdatatype.PTR, instance)
            add(instance, dns.rdatatype.SRV, f"0 0 {PORT} {target}")
            add(instance, dns.rdatatype.TXT, txt)
    return out


class DnsServer:
    """Answers from ``rrsets`` over UDP (TC when too large) and TCP; NXDOMAIN for unknown names."""

    def __init__(self, rrsets: dict[Any, Any]) -> None:
        self.rrsets = rrsets
        self.names = {name for name, _ in rrsets}

    def answer(self, wire: bytes, max_size: int | None) -> bytes | None:
        import dns.exception
        import dns.flags
        import dns.message
        import dns.rcode

        try:
            q = dns.message.from_wire(wire)
        except Exception:  # noqa: BLE001 - not a DNS query: no answer
            return None
        resp = dns.message.make_response(q)
        resp.flags |= dns.flags.AA
        for question in q.question:
            rrset = self.rrsets.get((question.name, question.rdtype))
            if rrset is not None:
                resp.answer.append(rrset)
            elif question.name not in self.names:
                resp.set_rcode(dns.rcode.NXDOMAIN)
        if max_size is None:
            return resp.to_wire()
        size = max(512, q.payload if q.edns >= 0 else 512)
        try:
            return resp.to_wire(max_size=size)
        except dns.exception.TooBig:
            resp.answer = []
            resp.flags |= dns.flags.TC
            return resp.to_wire()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        server = self

        class Udp(asyncio.DatagramProtocol):
            def connection_made(self, transport: Any) -> None:
                self.transport = transport

            def datagram_received(self, data: bytes, addr: Any) -> None:
                out = server.answer(data, 512)
                if out is not None:
                    self.transport.sendto(out, addr)

        await loop.create_datagram_endpoint(Udp, local_addr=(DNS_ADDR, 53))

        async def tcp(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while True:
                    size = int.from_bytes(await reader.readexactly(2), "big")
                    out = self.answer(await reader.readexactly(size), None)
                    if out is None:
                        break
                    writer.write(len(out).to_bytes(2, "big") + out)
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        await asyncio.start_server(tcp, DNS_ADDR, 53)


async def serve_fakes(n: int, sizes: list[int], tag: str, session: str, gpus: int, sample: float) -> None:
    from aiohttp import web

    from gpusd.inventory.simulated import SimulatedBackend
    from gpusd.wire.signing import FleetKey, Headers, Request, Response
    from gpusd.wire.sse import format_event

    secret = os.environ.get("BENCH_FLEET_SECRET") or None
    key = FleetKey(secret) if secret else None
    by_addr: dict[str, tuple[int, str, str, tuple[str, str], bytes]] = {}
    for i in range(n):
        snap = SimulatedBackend(f"{gpus}xH100", host=fake_name(i), node=fake_node(tag, i)).snapshot()
        text = snap.to_json()
        at = text.index('"timestamp":') + len('"timestamp":')
        end = text.index(",", at)
        info = json.dumps({"node_id": snap.node_id, "hostname": snap.hostname, "session": session,
                           "gpusd_version": "0.3.0", "snapshot": json.loads(text)}).encode()
        by_addr[fake_address(i)] = (i, fake_name(i), fake_node(tag, i), (text[:at], text[end:]), info)
    streams = 0

    def host_of(request: web.Request) -> tuple[int, str, str, tuple[str, str], bytes]:
        sock = request.transport.get_extra_info("sockname") if request.transport else None
        return by_addr[sock[0]]

    async def events(request: web.Request) -> web.StreamResponse:
        nonlocal streams
        i, name, node, (head, tail), _ = host_of(request)
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        if key is not None and "Signature" in request.headers:
            req = Request(request.method, str(request.url), Headers(request.headers))
            nonce = key.verify_request(req).nonce
            signed = Response(200, req, Headers())
            key.sign_response(signed, nonce, node, None, None, host=name, addresses=[request.host.split(":")[0]])
            headers.update(dict(signed.headers))
        resp = web.StreamResponse(headers=headers)
        await resp.prepare(request)
        streams += 1
        try:
            await resp.write(format_event("snapshot", f"{head}{time.time():.3f}{tail}"))
            await asyncio.sleep(sample * (i % 100) / 100)  # the hosts' samples spread over the interval
            last = time.monotonic()
            while True:
                await asyncio.sleep(min(sample, 2.0))
                if time.monotonic() - last >= sample - 0.01:
                    last = time.monotonic()
                    await resp.write(format_event("snapshot", f"{head}{time.time():.3f}{tail}"))
                else:  # a daemon's heartbeat after 2 s without an event
                    await resp.write(format_event("heartbeat", {}))
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            streams -= 1
        return resp

    async def healthz(request: web.Request) -> web.Response:
        _, _, node, _, _ = host_of(request)
        return web.json_response({"status": "ok", "node_id": node})

    async def host(request: web.Request) -> web.Response:
        return web.Response(body=host_of(request)[4], content_type="application/json")

    app = web.Application()
    app.router.add_get("/api/v1/events", events)
    app.router.add_get("/api/v1/host", host)
    app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    for addr in by_addr:
        await web.TCPSite(runner, addr, PORT, backlog=128).start()
    await DnsServer(zone_rrsets(n, sizes, tag, session, gpus, key is not None)).start()
    print("ready", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await runner.cleanup()


# -- the bench ----------------------------------------------------------------------------------------
def daemon_env(state: Path, secret: str | None, src: Path = REPO / "src") -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(src), GPUSD_STATE_DIR=str(state), GPUSD_INTERFACES="127.0.0.1",
               GPUSD_MDNS_FAST="1", GPUSD_LOCK_DIR=str(state / "locks"), GPUSD_LEASE_SOCKET=str(state / "l.sock"))
    for var in ("GPUSD_TOKEN", "GPUSD_TOKEN_FILE", "GPUSD_PEERS", "GPUSD_PEERS_FILE", "GPUSD_DNS_SD_DOMAIN"):
        env.pop(var, None)
    if secret:
        env["GPUSD_TOKEN"] = secret
    return env


def start_daemon(state: Path, session: str, domain: str | None, secret: str | None,
                 src: Path = REPO / "src") -> tuple[int, int]:
    state.mkdir(parents=True, exist_ok=True)
    beyond = ["--dns-sd-domain", domain, "--dns-server", DNS_ADDR] if domain else []
    r = subprocess.run([sys.executable, "-m", "gpusd", "start", "--simulate", "2xA100-80GB", "--interface",
                        "127.0.0.1", "--port", "0", "--session", session, "--hostname", "bench-self", "--no-record",
                        "--fleet-view", "on", *beyond], env=daemon_env(state, secret, src), capture_output=True,
                       text=True, timeout=120, check=False)
    if r.returncode != 0:
        raise SystemExit(f"the daemon did not start: {r.stderr}")
    info = json.loads((state / "gpusd.json").read_text())
    return int(info["pid"]), int(info["port"])


def stop_daemon(state: Path, pid: int, secret: str | None, src: Path = REPO / "src") -> None:
    subprocess.run([sys.executable, "-m", "gpusd", "stop", "--force", "--timeout", "10"],
                   env=daemon_env(state, secret, src), capture_output=True, timeout=60, check=False)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def fleet_hosts(port: int) -> tuple[int, float, int]:
    """(fake hosts in the daemon's fleet view, seconds for the answer, bytes); (0, 30, 0) when the daemon
    does not answer within 30 s (a daemon that cannot keep up with its fleet on a loaded machine)."""
    t = time.monotonic()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/fleet", timeout=30) as resp:
            body = resp.read()
    except OSError:  # URLError, a timeout, a reset connection
        return 0, 30.0, 0
    took = time.monotonic() - t
    hosts = json.loads(body).get("hosts", [])
    return sum(1 for h in hosts if str(h.get("hostname", "")).startswith("fake-")), took, len(body)


def proc_figures(pid: int) -> tuple[float, int, float]:
    """(RSS MiB, open descriptors, CPU seconds so far) of a process."""
    rss = 0.0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) / 1024
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return rss, fds, cpu


def timed(argv: list[str], env: dict[str, str], timeout: float = 120) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds of the process, its standard output) of one command."""
    with tempfile.TemporaryFile() as out:
        t = time.monotonic()
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.DEVNULL)
        try:
            _, _, usage = os.wait4(proc.pid, 0)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        took = time.monotonic() - t
        proc.returncode = 0  # reaped by wait4
        out.seek(0)
        return took, usage.ru_utime + usage.ru_stime, out.read().decode(errors="replace")


def one_list(state: Path, session: str, secret: str | None, extra: list[str],
             as_json: bool = True, src: Path = REPO / "src") -> tuple[float, int, float]:
    """(seconds, fake hosts listed, CPU seconds) of one cold ``gpusd list`` (``--json``, or the table)."""
    import re

    env = daemon_env(state, secret, src)
    env.pop("GPUSD_INTERFACES", None)
    took, cpu, stdout = timed([sys.executable, "-m", "gpusd", "list", *(["--json"] if as_json else []), "-i",
                               "127.0.0.1", "--session", session, *extra], env)
    if not as_json:
        return took, len(set(re.findall(r"\bfake-\d{4}\b", stdout))), cpu
    try:
        rows = json.loads(stdout or "[]")
    except ValueError:
        rows = []
    return took, len({d.get("hostname") for d in rows if str(d.get("hostname", "")).startswith("fake-")}), cpu


def get_cost(pid: int, port: int, at_rest: float, tmp: Path, n: int = 10) -> tuple[float, float]:
    """(the daemon's CPU seconds per GET /api/v1/fleet, its CPU at rest taken out; the median seconds of a GET
    of the same bytes from a static Python server: the floor of sending them over loopback)."""
    cpu0, t0 = proc_figures(pid)[2], time.monotonic()
    for _ in range(n):
        _, _, size = fleet_hosts(port)
    per_get = max(0.0, (proc_figures(pid)[2] - cpu0 - at_rest * (time.monotonic() - t0)) / n)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/fleet", timeout=30) as resp:
        body = resp.read()
    root = tmp / "static"
    root.mkdir(exist_ok=True)
    (root / "fleet").write_bytes(body)
    server = subprocess.Popen([sys.executable, "-m", "http.server", "0", "--bind", "127.0.0.1", "--directory",
                               str(root)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert server.stdout is not None
        line = server.stdout.readline()  # "Serving HTTP on 127.0.0.1 port NNNN (http://...)"
        static_port = int(line.split(" port ")[1].split()[0])
        times = []
        for _ in range(3):
            t = time.monotonic()
            with urllib.request.urlopen(f"http://127.0.0.1:{static_port}/fleet", timeout=30) as resp:
                resp.read()
            times.append(time.monotonic() - t)
    finally:
        server.kill()
        server.wait()
    return per_get, statistics.median(times)


FLOOR = """import json, sys, urllib.request
with urllib.request.urlopen(sys.argv[1], timeout=60) as r:
    json.loads(r.read())
"""


def floor_list(port: int) -> tuple[float, float]:
    """(seconds, CPU seconds) of the floor: a new Python process that reads the daemon's fleet answer
    and parses its JSON, nothing more (no checks, no output)."""
    took, cpu, _ = timed([sys.executable, "-c", FLOOR, f"http://127.0.0.1:{port}/api/v1/fleet"],
                         dict(os.environ))
    return took, cpu


def main() -> int:
    # as installed: gpusd's modules compiled once (the first run writes their .pyc), then read from it; with
    # PYTHONDONTWRITEBYTECODE every cold command compiles them anew (~40 ms a list on this machine)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="32,100,1000", help="fleet sizes, comma-separated (default 32,100,1000)")
    ap.add_argument("--gpus", type=int, default=8, help="GPUs per fake host (default 8)")
    ap.add_argument("--runs", type=int, default=5, help="gpusd list runs per size (default 5)")
    ap.add_argument("--sample", type=float, default=1.0, help="seconds between a fake host's snapshots (default 1, "
                    "a daemon's sampling interval; heartbeats every 2 s between)")
    ap.add_argument("--loads", default="0,3", help="busy loops running during the lists, comma-separated "
                    "(default 0,3: the lists at rest, then again beside three busy loops)")
    ap.add_argument("--no-secret", action="store_true", help="no fleet secret (unsigned streams, hosts unverified)")
    ap.add_argument("--old-src", metavar="DIR", help="also run the daemon and the lists from this source tree "
                    "(before): per size one daemon after the other, each measured the same way")
    ap.add_argument("--fakes", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--tag", help=argparse.SUPPRESS)
    ap.add_argument("--session", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = sorted({int(s) for s in args.sizes.split(",") if s.strip()})
    loads = [int(x) for x in args.loads.split(",") if x.strip()] or [0]
    if args.fakes is not None:
        asyncio.run(serve_fakes(args.fakes, sizes, args.tag, args.session, args.gpus, args.sample))
        return 0
    if os.geteuid() != 0:
        raise SystemExit("needs root: the zone's server listens on 127.0.53.1:53")
    secret = None if args.no_secret else secrets.token_hex(32)
    tag, session = secrets.token_hex(5), f"fleet-{secrets.token_hex(3)}"
    n_max = max(sizes)
    tmp = Path(tempfile.mkdtemp(prefix="gpusd-bench-fleet-"))
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    env.pop("BENCH_FLEET_SECRET", None)
    if secret:
        env["BENCH_FLEET_SECRET"] = secret
    fakes = subprocess.Popen([sys.executable, __file__, "--fakes", str(n_max), "--sizes", ",".join(map(str, sizes)),
                              "--tag", tag, "--session", session, "--gpus", str(args.gpus),
                              "--sample", str(args.sample)], env=env, stdout=subprocess.PIPE, text=True)
    daemon: tuple[Path, int, Path] | None = None
    rows: list[str] = []
    try:
        assert fakes.stdout is not None
        if fakes.stdout.readline().strip() != "ready":
            raise SystemExit("the fake hosts did not start")
        print(f"{n_max} fake hosts ({args.gpus} GPUs each, a snapshot every {args.sample:g} s"
              f"{', signed' if secret else ', unsigned'}) on 127.1.x.y:{PORT}, DNS-SD zone on {DNS_ADDR}:53; "
              f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
        # the cold one-shot list without a daemon, browsing the 32-host zone itself
        cold_state = tmp / "cold"
        cold_state.mkdir()
        cold_n = min(32, n_max) if 32 in sizes or n_max < 32 else sizes[0]
        trees = [("this tree", REPO / "src")] + ([("before", Path(args.old_src).resolve())] if args.old_src else [])
        cold: dict[str, list[tuple[float, int, float]]] = {label: [] for label, _ in trees}
        for _, src in trees:  # warm-up, not counted: the first run of a tree writes its .pyc files
            one_list(cold_state, session, secret, ["--dns-sd-domain", f"n{cold_n}.{ZONE}".rstrip("."),
                                                   "--dns-server", DNS_ADDR], src=src)
        for _ in range(args.runs):  # interleaved
            for label, src in trees:
                cold[label].append(one_list(cold_state, session, secret, [
                    "--dns-sd-domain", f"n{cold_n}.{ZONE}".rstrip("."), "--dns-server", DNS_ADDR], src=src))
        fake_pid = fakes.pid
        base: dict[str, tuple[float, int]] = {}
        for n in [0, *sizes]:
            for label, src in trees if n % 2 == 0 else trees[::-1]:  # which tree goes first alternates
                state = tmp / f"d{n}-{len(rows)}"
                domain = f"n{n}.{ZONE}".rstrip(".") if n else "n0.fleet.test"
                t0 = time.monotonic()
                pid, port = start_daemon(state, session, domain, secret, src)
                daemon = (state, pid, src)
                seen, deadline = 0, time.monotonic() + 180
                while time.monotonic() < deadline:
                    seen = fleet_hosts(port)[0]
                    if seen >= n:
                        break
                    time.sleep(0.5)
                full = time.monotonic() - t0
                time.sleep(3.0)
                rss, fds, cpu0 = proc_figures(pid)
                time.sleep(5.0)
                rss2, fds2, cpu1 = proc_figures(pid)
                cpu = (cpu1 - cpu0) / 5.0 * 100
                fleet = [fleet_hosts(port) for _ in range(3)]
                per_get, static = get_cost(pid, port, cpu / 100, tmp) if n else (0.0, 0.0)
                load = os.getloadavg()[0]

                def med(xs: list[float]) -> float:
                    return statistics.median(xs)

                for busy in loads if n else [0]:
                    lists, tables, floors = [], [], []
                    with busy_load(busy):
                        for _ in range(args.runs if n else 0):  # interleaved
                            lists.append(one_list(state, session, secret, [], src=src))
                            tables.append(one_list(state, session, secret, [], as_json=False, src=src))
                            floors.append(floor_list(port))
                        load = os.getloadavg()[0]
                    if n == 0:
                        base[label] = (max(rss, rss2), max(fds, fds2))
                    per_host = ""
                    if n and label in base and busy == loads[0]:
                        per_host = (f"  per host {(max(rss, rss2) - base[label][0]) * 1024 / n:5.1f} KiB "
                                    f"{(max(fds, fds2) - base[label][1]) / n:.2f} fds")
                    listed = [k for _, k, _ in lists] + [k for _, k, _ in tables]
                    tree = label if busy == 0 else f"{label}+{busy}b"
                    rows.append(f"{n:5d} {tree:10s} {seen:5d} {full:6.1f} {max(rss, rss2):7.1f} {max(fds, fds2):5d} "
                                f"{cpu:5.1f} {med([t for _, t, _ in fleet]):7.3f} {per_get * 1e3:6.1f} "
                                f"{static:7.3f} {fleet[0][2] / 1e6:6.2f} "
                                + (f"{med([t for t, _ in floors]):6.2f} {med([c for _, c in floors]):5.2f} "
                                   f"{med([t for t, _, _ in lists]):6.2f} {med([c for _, _, c in lists]):5.2f} "
                                   f"{max(t for t, _, _ in lists):6.2f} "
                                   f"{med([t for t, _, _ in tables]):6.2f} {med([c for _, _, c in tables]):5.2f} "
                                   f"{min(listed):5d}-{max(listed)}"
                                   if lists else f"{'-':>6s} {'-':>5s} {'-':>6s} {'-':>5s} {'-':>6s} {'-':>6s} "
                                   f"{'-':>5s} {'-':>5s}") + f" {load:5.1f}" + per_host)
                    print(rows[-1], flush=True)
                stop_daemon(state, pid, secret, src)
                daemon = None
        with contextlib.suppress(ProcessLookupError):
            fake_rss = proc_figures(fake_pid)[0]
        print()
        print(f"{'hosts':>5s} {'tree':10s} {'view':>5s} {'full':>6s} {'RSS MiB':>7s} {'fds':>5s} {'CPU%':>5s} "
              f"{'/fleet':>7s} {'cpu ms':>6s} {'static':>7s} {'MB':>6s} {'floor':>6s} {'cpu':>5s} {'json s':>6s} "
              f"{'cpu':>5s} {'max':>6s} "
              f"{'table':>6s} {'cpu':>5s} {'listed':>7s} {'load':>5s}")
        print("(hosts: followed by the daemon; view: fake hosts in its /api/v1/fleet; full: s from gpusd start to "
              "all in view; RSS, fds, CPU (% of one core, 5 s): the daemon at rest, following them; /fleet, MB: s "
              "and size of one GET /api/v1/fleet (median of 3); cpu ms: the daemon's CPU per GET (10 GETs, its CPU "
              "at rest taken out); static: s of a GET of the same bytes from a static Python server (the floor of "
              "sending them); tree+Nb: the lists again with N busy loops running (bench/_load.py); "
              "floor: a new `python` reading that answer and json.loads "
              "(no checks, no output); json s, table: a cold `gpusd list --json` / `gpusd list` from this host, "
              "median (cpu: its CPU seconds, median), max of json; the three interleaved run by run; listed: fake "
              "hosts each run listed, least-most; load: the load average after the runs)")
        for row in rows:
            print(row)
        for label, times in cold.items():
            print(f"cold one-shot gpusd list, no daemon, {cold_n} hosts by wide-area DNS-SD, {label}: median "
                  f"{statistics.median(t for t, _, _ in times):.2f} s "
                  f"(CPU {statistics.median(c for _, _, c in times):.2f} s), max {max(t for t, _, _ in times):.2f} s, "
                  f"listed {min(k for _, k, _ in times)}-{max(k for _, k, _ in times)} of {cold_n}")
        print(f"goal: a host with a daemon lists 1,000 hosts in <= {GOAL:g} s; the fake hosts' process: "
              f"{fake_rss:.0f} MiB RSS")
    finally:
        if daemon is not None:
            stop_daemon(daemon[0], daemon[1], secret, daemon[2])
        if fakes.poll() is None:
            fakes.send_signal(signal.SIGTERM)
            try:
                fakes.wait(30)
            except subprocess.TimeoutExpired:
                fakes.kill()
                fakes.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
