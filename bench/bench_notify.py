"""``gpusd notify`` (docs/notify.md): how soon it fires after the last holder's end, and what a hundred
waiting notifiers cost the daemon.

    python bench/bench_notify.py [--runs 50] [--waiters 100] [--window 20] [--fleet-runs 50] [--no-fleet]
                                 [--no-cpu] [--fleet-only] [--settle 60] [--streams-only] [--pace 5]

1. **Latency on this machine** (fake NVML, 2 GPUs): a holder in this process leases both GPUs; two
   ``gpusd notify -n 2 --repeat`` run, one ``--exec 'date +%s.%N >> FILE'``, one ``--webhook`` to a
   receiver in this process.  Each run: the holder leases, both notifiers log that the GPUs were taken
   again, the holder waits 0-1 s (at random), notes the wall clock and releases; latency = the
   command's ``date`` / the POST's arrival minus that note.  p50/p99 over ``--runs`` runs, against the goal (2 s).
2. **The daemon's CPU** (the lease authority on 127.0.0.1, fake NVML, sampling every second, both
   GPUs leased) over ``--window`` seconds: with no notifier, with ``--waiters`` local notifiers waiting
   (each a ``gpusd notify -n 1`` process), and with none again (the noise); the notifiers' own CPU too.
3. **Latency across the fleet** (root: a namespace LAN, tests/netns.py): a host's daemon (default
   sampling interval, 1 s), a holder on that host leasing through its daemon, two ``notify --fleet``
   on a client machine; p50/p99 over ``--fleet-runs`` runs; then the host daemon's CPU with
   ``--waiters`` fleet notifiers following its event stream against none (``--settle S``: again S s
   later, once their mDNS browsers' start-up queries are over), its GPUs leased and busy: their
   readings change every second (``Busy``), as a real host's do while notifiers wait for them.
4. **The daemon's fan-out alone** (``--streams N``, or ``--streams-only``): the daemon on 127.0.0.1 with a
   fleet secret, both GPUs leased, and N signed ``/api/v1/events`` readers in one reader process: the
   daemon's CPU with none / N / N paced as a fleet notifier asks (``--pace``: 5 s by default, what one
   whose constraints read readings asks; 20 s for the others) / none again, without a hundred notifier
   processes loading the machine as part 3 does (part 3's notifiers, ``-n 2``, ask for 20 s).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from _common import REPO, FakeEnv, make_gpus, p50, pct, start_ready, stop

sys.path.insert(0, str(REPO / "src"))
from gpusd.notify.watch import PACE  # noqa: E402

SRC = REPO / "src"
GOAL = 2.0


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Receiver:
    """Webhook POSTs, their arrival times (wall clock), on 127.0.0.1 of the namespace it runs in."""

    def __init__(self) -> None:
        arrivals = self.arrivals = []

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a: object) -> None:
                pass

            def do_POST(self) -> None:
                arrivals.append(time.time())
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.srv.daemon_threads = True
        self.port = self.srv.server_address[1]
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()


READERS = """
import asyncio, signal, sys
import aiohttp
from gpusd.wire.signing import FleetKey
url, n, key = sys.argv[1], int(sys.argv[2]), FleetKey(open(sys.argv[3]).read().strip())
heard = {}
async def one(http):
    headers = {"Accept": "text/event-stream", **key.sign_request("GET", url)[0]}
    async with http.get(url, headers=headers) as resp:
        assert resp.status == 200, resp.status
        async for line in resp.content:
            if line.startswith(b"event:"):
                name = line[6:].strip().decode()
                heard[name] = heard.get(name, 0) + 1
async def main():
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        tasks = [asyncio.ensure_future(one(http)) for _ in range(n)]
        while heard.get("snapshot", 0) < n:
            await asyncio.sleep(0.05)
            if any(t.done() for t in tasks):
                raise SystemExit(f"a reader ended: {[t.exception() for t in tasks if t.done()][:1]}")
        print("connected", flush=True)
        await stop.wait()
    print(heard, flush=True)
asyncio.run(main())
"""

RECEIVER = """
import sys, time, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_POST(self):
        t = time.time()
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
        print(f"{t:.6f}", flush=True)
srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
print(srv.server_address[1], flush=True)
threading.Thread(target=srv.serve_forever, daemon=True).start()
time.sleep(3600)
"""


class Busy:
    """GPUs at work while notifiers wait for them: each second a new utilisation, temperature and power
    (what a busy GPU's readings do), written to the fake NVML's state file ``path``; the state as it was
    again on leaving.  Each sample of the daemon then changes, as on a real host whose GPUs are in use."""

    def __init__(self, path: Path, gpus: list[Any]) -> None:
        from fakenvml import write_state

        self.path, self.gpus, self.write = path, gpus, write_state
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import dataclasses

        rng = random.Random(7)
        while not self.done.wait(1.0):
            self.write(self.path, [dataclasses.replace(g, util_gpu=rng.randint(60, 95), temperature=rng.randint(60, 80),
                                                       power_usage=rng.randint(200, 350) * 1000) for g in self.gpus])

    def start(self) -> "Busy":
        self.thread.start()
        return self

    def stop(self) -> None:
        """The readings as they were (nothing to do where it never started)."""
        if self.thread.is_alive():
            self.done.set()
            self.thread.join(5)
            self.write(self.path, self.gpus)


class Lines:
    """A process's stderr lines, collected on a thread."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc, self.lines = proc, []  # type: ignore[var-annotated]
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    def count(self, text: str) -> int:
        return sum(text in ln for ln in self.lines)


def wait(cond: Any, timeout: float, what: str, procs: list[Lines] = ()) -> None:  # type: ignore[assignment]
    end = time.monotonic() + timeout
    while not cond():
        gone = [n for n in procs if n.proc.poll() is not None]
        if gone or time.monotonic() > end:
            said = "".join(gone[0].lines[-5:]) if gone else ""
            raise SystemExit(f"bench: {what} did not happen within {timeout:g}s {said}")
        time.sleep(0.005)


def latency_runs(runs: int, hold: Any, release: Any, exec_out: Path, arrivals: Any,
                 notifiers: list[Lines]) -> tuple[list[float], list[float]]:
    """``runs`` cycles of hold -> both notifiers see it taken -> release: (exec latencies, webhook latencies)."""
    by_exec: list[float] = []
    by_hook: list[float] = []
    for n in notifiers:  # the first notice: the GPUs were free when they started
        wait(lambda n=n: n.count("GPU(s) free") >= 1, 60, "the first notice")
    for i in range(runs):
        hold()
        for n in notifiers:
            wait(lambda n=n, i=i: n.count("taken again") >= i + 1, 30, "the notifier seeing the GPUs taken")
        # released at a random moment: not just after the host's sample that showed the GPUs taken
        # (the notifier looks right after each), which would measure a whole sampling interval every time
        time.sleep(random.uniform(0.0, 1.0))
        ended = release()
        for n in notifiers:
            wait(lambda n=n, i=i: n.count("GPU(s) free") >= i + 2, 30, "the notice")
        fired = exec_out.read_text().split()
        by_exec.append(float(fired[-1]) - ended)
        by_hook.append(arrivals()[-1] - ended)
    return by_exec, by_hook


def show(label: str, values: list[float]) -> None:
    ok = "meets" if pct(values, 99) <= GOAL else "MISSES"
    print(f"| {label} | {len(values)} | {p50(values) * 1000:.0f} | {pct(values, 99) * 1000:.0f} | "
          f"{max(values) * 1000:.0f} | {GOAL * 1000:.0f} ({ok}) |")


def local_latency(runs: int) -> None:
    fake = FakeEnv(make_gpus(2))
    fake.activate_in_process()
    from gpusd.alloc.leases import LeaseStore

    uuids = [g.uuid for g in make_gpus(2)]
    store = LeaseStore()
    rx = Receiver()
    out = fake.tmp / "fired"
    env = dict(fake.env, PYTHONPATH=str(SRC))
    argv = [sys.executable, "-m", "gpusd", "-v", "notify", "-n", "2", "--repeat"]
    procs = [subprocess.Popen([*argv, "--exec", f"date +%s.%N >> {out}"], env=env, stdin=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True),
             subprocess.Popen([*argv, "--webhook", f"http://127.0.0.1:{rx.port}/"], env=env,
                              stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)]
    held: list[Any] = []

    def hold() -> None:
        lease = store.acquire(uuids)
        assert lease is not None
        held.append(lease)

    def release() -> float:
        t = time.time()
        held.pop().release()
        return t

    try:
        e, w = latency_runs(runs, hold, release, out, lambda: rx.arrivals, [Lines(p) for p in procs])
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
    print("\n### Latency on this machine: the holder's release to the notice\n")
    print("| target | runs | p50 ms | p99 ms | max ms | goal p99 ms |\n|---|---|---|---|---|---|")
    show("`--exec` (the command's `date`)", e)
    show("`--webhook` (the POST's arrival)", w)


def local_cpu(waiters: int, window: float) -> None:
    fake = FakeEnv(make_gpus(2))
    state = fake.tmp / "daemon"
    state.mkdir()
    env = dict(fake.env, PYTHONPATH=str(SRC), GPUSD_INTERFACES="127.0.0.1", GPUSD_STATE_DIR=str(state))
    daemon, _ = start_ready([sys.executable, "-m", "gpusd", "start", "--foreground", "--interface", "127.0.0.1",
                             "--port", "0", "--session", f"bench-{secrets.token_hex(3)}", "--interval", "1",
                             "--hostname", "bench-host", "--no-record"], env, state / "gpusd.log")
    # both GPUs leased through the daemon: every notifier waits
    held = fake.tmp / "held"
    holder = subprocess.Popen([sys.executable, "-m", "gpusd", "run", "-n", "2", "--", "sh", "-c",
                               f"touch {held}; exec sleep 3600"], env=env,
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    notifiers: list[Lines] = []
    try:
        wait(held.exists, 120, "the holder's lease")
        rows = []

        def measure(label: str) -> None:
            time.sleep(2)
            c0 = cpu_seconds(daemon.pid)
            n0 = sum(cpu_seconds(n.proc.pid) for n in notifiers)
            t0 = time.monotonic()
            time.sleep(window)
            wall = time.monotonic() - t0
            rows.append((label, 100 * (cpu_seconds(daemon.pid) - c0) / wall,
                         100 * (sum(cpu_seconds(n.proc.pid) for n in notifiers) - n0) / wall, os.getloadavg()[0]))

        measure("none")
        for i in range(waiters):
            p = subprocess.Popen([sys.executable, "-m", "gpusd", "-v", "notify", "-n", "1", "--exec", "true"],
                                 env=env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            notifiers.append(Lines(p))
            if i % 10 == 9:  # start them in tens: two shared cores
                wait(lambda: all(n.count("watching") for n in notifiers), 120, "the notifiers' first look", notifiers)
        wait(lambda: all(n.count("watching") for n in notifiers), 120, "the notifiers' first look", notifiers)
        assert not any(n.count("GPU(s) free") for n in notifiers)
        measure(f"{waiters} local notifiers waiting")
        for n in notifiers:
            n.proc.terminate()
        for n in notifiers:
            n.proc.wait(10)
        notifiers.clear()
        measure("none again")
    finally:
        for n in notifiers:
            n.proc.kill()
        holder.terminate()
        holder.wait(10)
        stop(daemon)
    print(f"\n### The lease authority's CPU over {window:g} s (sampling every 1 s, 2 GPUs leased)\n")
    print("| notifiers | daemon CPU % | the notifiers' own CPU % (all together) | load average |\n|---|---|---|---|")
    for label, d, n, load in rows:
        print(f"| {label} | {d:.2f} | {n:.1f} | {load:.1f} |")


def daemon_cpu(pid: int, window: float) -> tuple[float, float]:
    """Process ``pid``'s CPU over ``window`` s after a 2 s settle, in % of one core, and the load average then."""
    time.sleep(2)
    c0, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(window)
    return 100 * (cpu_seconds(pid) - c0) / (time.monotonic() - t0), os.getloadavg()[0]


def streams_cpu(readers: int, window: float, pace: float = 0.0) -> None:
    gpus = make_gpus(2)
    fake = FakeEnv(gpus)
    state = fake.tmp / "daemon"
    state.mkdir()
    key = fake.tmp / "fleet.key"
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, (secrets.token_hex(32) + "\n").encode())
    os.close(fd)
    env = dict(fake.env, PYTHONPATH=str(SRC), GPUSD_INTERFACES="127.0.0.1", GPUSD_STATE_DIR=str(state))
    daemon, ready = start_ready([sys.executable, "-m", "gpusd", "start", "--foreground", "--interface", "127.0.0.1",
                                 "--port", "0", "--session", f"bench-{secrets.token_hex(3)}", "--interval", "1",
                                 "--hostname", "bench-host", "--no-record", "--token-file", str(key)], env,
                                state / "gpusd.log")
    url = json.loads(ready)["urls"][0] + "/events"
    held = fake.tmp / "held"
    holder = subprocess.Popen([sys.executable, "-m", "gpusd", "run", "-n", "2", "--", "sh", "-c",
                               f"touch {held}; exec sleep 3600"], env=env,
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    reader: subprocess.Popen[str] | None = None
    rows = []
    heard = ""
    busy = Busy(fake.state, gpus)
    try:
        wait(held.exists, 120, "the holder's lease")
        busy.start()

        def measure(label: str) -> None:
            rows.append((label, *daemon_cpu(daemon.pid, window)))

        measure("none")
        reader = subprocess.Popen([sys.executable, "-c", READERS, url, str(readers), str(key)], env=env,
                                  stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        assert reader.stdout is not None
        if reader.stdout.readline().strip() != "connected":
            raise SystemExit("bench: the stream readers did not connect")
        measure(f"{readers} signed event-stream readers")
        reader.terminate()
        heard = reader.stdout.read().strip()
        reader.wait(10)
        reader = None
        if pace:
            # what a fleet notifier asks for (docs/wire-format.md): readings alone at most every PACE s
            reader = subprocess.Popen([sys.executable, "-c", READERS, f"{url}?pace={pace:g}", str(readers), str(key)],
                                      env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
            assert reader.stdout is not None
            if reader.stdout.readline().strip() != "connected":
                raise SystemExit("bench: the paced stream readers did not connect")
            measure(f"{readers} signed readers at pace {pace:g} s (a fleet notifier's)")
            reader.terminate()
            heard += f"; paced: {reader.stdout.read().strip()}"
            reader.wait(10)
            reader = None
        measure("none again")
    finally:
        busy.stop()
        if reader is not None:
            reader.kill()
        holder.terminate()
        holder.wait(10)
        stop(daemon)
    print(f"\n### The daemon's fan-out alone over {window:g} s: signed /api/v1/events readers on 127.0.0.1 "
          f"(2 GPUs leased, their readings new each second; the readers heard {heard})\n")
    print("| readers | daemon CPU % | load average |\n|---|---|---|")
    for label, d, load in rows:
        print(f"| {label} | {d:.2f} | {load:.1f} |")


def fleet(runs: int, waiters: int, window: float, settle: float = 0.0) -> None:
    sys.path.insert(0, str(REPO / "tests"))
    from netns import Lan, unavailable

    why = unavailable()
    if why:
        print(f"\n(fleet part skipped: {why})")
        return
    work = Path(tempfile.mkdtemp(prefix="gpusd-bench-notify-"))
    key = work / "fleet.key"
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, (secrets.token_hex(32) + "\n").encode())
    os.close(fd)
    with Lan(workdir=work / "lan") as lan:
        (work / "lan").mkdir(exist_ok=True)
        node = "h1"
        h1 = lan.add_gpu_host("node-1", make_gpus(2), fast=True, node_name=node, args=["--token-file", str(key)],
                              extra_env={"GPUSD_LEASE_SOCKET": str(lan.workdir / f"{node}-lease.sock")})
        h1.start()
        client = lan.add_node("client")
        env = lan.base_env(client, GPUSD_MDNS_FAST="1")
        rx = subprocess.Popen(["ip", "netns", "exec", client.ns, sys.executable, "-c", RECEIVER], env=env,
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        assert rx.stdout is not None
        port = int(rx.stdout.readline())
        arrivals: list[float] = []
        threading.Thread(target=lambda: [arrivals.append(float(ln)) for ln in rx.stdout], daemon=True).start()
        holder = subprocess.Popen(["ip", "netns", "exec", h1.node.ns, sys.executable, "-u", "-c",
                                   "import sys, time, gpusd\nheld = None\nfor line in sys.stdin:\n"
                                   "    if line.startswith('hold'):\n        held = gpusd.select(count=2)\n"
                                   "        print('held', flush=True)\n"
                                   "    else:\n        t = time.time(); held.release(); print(t, flush=True)\n"],
                                  env=h1.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert holder.stdin is not None and holder.stdout is not None
        out = work / "fired"
        argv = [sys.executable, "-m", "gpusd", "-v", "notify", "--fleet", "-n", "2", "--repeat", "--token-file",
                str(key)]
        procs = [lan.popen(client, [*argv, "--exec", f"date +%s.%N >> {out}"], env=env, stderr=subprocess.PIPE,
                           text=True),
                 lan.popen(client, [*argv, "--webhook", f"http://127.0.0.1:{port}/"], env=env,
                           stderr=subprocess.PIPE, text=True)]

        def hold() -> None:
            holder.stdin.write("hold\n")
            holder.stdin.flush()
            assert holder.stdout.readline().strip() == "held"

        def release() -> float:
            holder.stdin.write("end\n")
            holder.stdin.flush()
            return float(holder.stdout.readline())

        e, w = latency_runs(runs, hold, release, out, lambda: arrivals, [Lines(p) for p in procs])
        print("\n### Latency across the fleet (namespace LAN; the host's daemon samples every 1 s, its default)\n")
        print("| target | runs | p50 ms | p99 ms | max ms | goal p99 ms |\n|---|---|---|---|---|---|")
        show("`--fleet --exec`", e)
        show("`--fleet --webhook`", w)
        for p in procs:
            p.terminate()
            p.wait(10)
        if waiters <= 0:
            holder.stdin.close()
            holder.wait(10)
            rx.terminate()
            return
        hold()  # the GPUs leased while the daemon's CPU is measured: every notifier waits
        busy = Busy(h1.nvml_state, h1.gpus).start()  # and at work: their readings change each sample
        daemon = h1.proc
        assert daemon is not None
        rows = []
        notifiers: list[Lines] = []

        def measure(label: str) -> None:
            rows.append((label, *daemon_cpu(daemon.pid, window)))

        measure("none")
        for i in range(waiters):
            waiting = [sys.executable, "-m", "gpusd", "-v", "notify", "--fleet", "-n", "2", "--token-file", str(key),
                       "--exec", "true"]
            notifiers.append(Lines(lan.popen(client, waiting, env=env, stderr=subprocess.PIPE, text=True)))
            if i % 10 == 9:
                wait(lambda: all(n.count("watching") for n in notifiers), 180, "the first looks", notifiers)
        wait(lambda: all(n.count("watching") for n in notifiers), 180, "the first looks", notifiers)
        measure(f"{waiters} fleet notifiers following its events")
        if settle > 0:
            # each notifier's mDNS browser queries at 1, 2, 4, 8 ... s after it starts: the window above holds
            # their start-up; this one, the notifiers as they wait
            time.sleep(settle)
            measure(f"the same, {settle:g} s later")
        for n in notifiers:
            n.proc.terminate()
        for n in notifiers:
            n.proc.wait(10)
        measure("none again")
        busy.stop()
        holder.stdin.close()
        holder.wait(10)
        rx.terminate()
        print(f"\n### The host daemon's CPU over {window:g} s with fleet notifiers (GPUs leased, their readings "
              "new each second)\n")
        print("| notifiers | daemon CPU % | load average |\n|---|---|---|")
        for label, d, load in rows:
            print(f"| {label} | {d:.2f} | {load:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--waiters", type=int, default=100)
    ap.add_argument("--window", type=float, default=20.0)
    ap.add_argument("--settle", type=float, default=0.0,
                    help="part 3: measure the host's CPU again this many seconds after the notifiers' first window")
    ap.add_argument("--fleet-runs", type=int, default=50)
    ap.add_argument("--no-fleet", action="store_true")
    ap.add_argument("--no-cpu", action="store_true")
    ap.add_argument("--fleet-only", action="store_true", help="only part 3 (the fleet's latency and the host's CPU)")
    ap.add_argument("--streams", type=int, default=100, help="part 4's readers (0: no part 4)")
    ap.add_argument("--streams-only", action="store_true", help="only part 4 (the daemon's fan-out alone)")
    ap.add_argument("--pace", type=float, default=PACE,
                    help="part 4: also N readers at this pace (a fleet notifier's; 0: not)")
    args = ap.parse_args()
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    if args.streams_only:
        streams_cpu(args.streams, args.window, args.pace)
        return
    if not args.fleet_only:
        local_latency(args.runs)
    if not args.no_cpu and not args.fleet_only:
        local_cpu(args.waiters, args.window)
    if not args.no_fleet:
        fleet(args.fleet_runs, 0 if args.no_cpu else args.waiters, args.window, args.settle)
    if not args.no_cpu and args.streams > 0 and not args.fleet_only:
        streams_cpu(args.streams, args.window, args.pace)


if __name__ == "__main__":
    main()
