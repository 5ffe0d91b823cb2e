"""Issue 24 benchmark: a cold one-shot ``gpusd list`` beside a flood of fake services (tar pits).

    python bench/bench_oneshot_flood.py [--hosts 8] [--services 500] [--runs 5] [--before SRC]

``--hosts`` real daemons (``gpusd start``, simulated GPUs, HTTP and mDNS on 127.0.0.1 only, one session of
their own, each its own state directory and host name) and ``--services`` fake ``_gpusd._tcp`` services of
the same session, announced from a zeroconf bound to 127.0.0.1, each pointing at a tar pit on 127.0.0.1
(it accepts connections and never answers).  Then ``gpusd list --json -i 127.0.0.1`` as a new process
each time: first without the flood, then with it; with ``--before SRC`` (the ``src/`` of a worktree of the
base commit) the same from that tree, interleaved run by run.  Printed: the seconds per list and how many
of the real hosts it listed.  Everything stops by itself; nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))


def start_daemon(src: Path, state: Path, session: str, name: str) -> int:
    env = dict(os.environ, PYTHONPATH=str(src), GPUSD_STATE_DIR=str(state), GPUSD_INTERFACES="127.0.0.1",
               GPUSD_MDNS_FAST="1", GPUSD_LOCK_DIR=str(state / "locks"), GPUSD_LEASE_SOCKET=str(state / "l.sock"))
    env.pop("GPUSD_TOKEN", None)
    r = subprocess.run([sys.executable, "-m", "gpusd", "start", "--simulate", "2xA100-80GB", "--interface",
                        "127.0.0.1", "--port", "0", "--session", session, "--hostname", name, "--no-record",
                        "--fleet-view", "off"], env=env, capture_output=True, text=True, timeout=120, check=False)
    if r.returncode != 0:
        raise SystemExit(f"the daemon did not start: {r.stderr}")
    return int(json.loads((state / "gpusd.json").read_text())["pid"])


def stop_daemon(src: Path, state: Path, pid: int) -> None:
    env = dict(os.environ, PYTHONPATH=str(src), GPUSD_STATE_DIR=str(state))
    subprocess.run([sys.executable, "-m", "gpusd", "stop", "--force", "--timeout", "10"], env=env,
                   capture_output=True, timeout=60, check=False)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, 9)


class Flood(threading.Thread):
    """``n`` fake services of ``session`` pointing at a tar pit, until :meth:`close`."""

    def __init__(self, session: str, n: int) -> None:
        super().__init__(daemon=True)
        self.session, self.n = session, n
        self.ready = threading.Event()
        self.loop = asyncio.new_event_loop()
        self._halt: asyncio.Event | None = None

    def run(self) -> None:
        self.loop.run_until_complete(self._main())

    async def _main(self) -> None:
        from zeroconf import ServiceInfo

        from gpusd.wire.mdns import open_zeroconf
        from gpusd.wire.txt import SERVICE_TYPE, encode_txt

        self._halt = asyncio.Event()
        held: list[asyncio.StreamWriter] = []

        async def tarpit(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            held.append(writer)  # accept, never answer

        pit = await asyncio.start_server(tarpit, "127.0.0.1", 0, backlog=4096)
        port = pit.sockets[0].getsockname()[1]
        zc = await open_zeroconf(["127.0.0.1"])
        tag = secrets.token_hex(3)
        infos = [ServiceInfo(SERVICE_TYPE, f"pit-{tag}-{i}.{SERVICE_TYPE}", port=port, server=f"pit-{tag}-{i}.local.",
                             parsed_addresses=["127.0.0.1"],
                             properties=encode_txt(node_id=f"{tag}{i:05d}", hostname=f"pit-{i}", session=self.session,
                                                   inventory=[("A100-SXM4-80GB", 81920)], free=1))
                 for i in range(self.n)]
        try:
            for k in range(0, self.n, 100):
                tasks = await asyncio.gather(*(zc.async_register_service(i, cooperating_responders=True)
                                               for i in infos[k:k + 100]))
                await asyncio.gather(*tasks)
            self.ready.set()
            await self._halt.wait()
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(zc.async_close(), 20)
            pit.close()
            for w in held:
                w.transport.abort()

    def close(self) -> None:
        if self._halt is not None:
            self.loop.call_soon_threadsafe(self._halt.set)
        self.join(timeout=60)


def one_list(src: Path, session: str, state: Path, hosts: int = 0, label: str = "") -> tuple[float, int, int]:
    """(seconds, real hosts listed, tar pits listed) of one cold ``gpusd list``; a list missing some of the
    ``hosts`` real ones prints what the command said."""
    env = dict(os.environ, PYTHONPATH=str(src), GPUSD_STATE_DIR=str(state))
    for var in ("GPUSD_PEERS", "GPUSD_PEERS_FILE", "GPUSD_DNS_SD_DOMAIN", "GPUSD_TOKEN"):
        env.pop(var, None)
    t = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "gpusd", "list", "--json", "-i", "127.0.0.1", "--session", session],
                       env=env, capture_output=True, text=True, timeout=120, check=False)
    took = time.monotonic() - t
    try:
        rows = json.loads(r.stdout or "[]")
    except ValueError:
        rows = []
    names = {d.get("hostname") for d in rows}
    real = len({h for h in names if str(h).startswith("real-")})
    if real < hosts:
        print(f"  ({label}{src}: {real} of {hosts} real hosts in {took:.2f} s, exit {r.returncode}: "
              f"{(r.stderr.strip().splitlines() or [''])[-1][:200]!r})", flush=True)
    return took, real, len({h for h in names if str(h).startswith("pit-")})


def main() -> int:
    # as installed: gpusd's modules compiled once (the first run writes their .pyc), then read from it; with
    # PYTHONDONTWRITEBYTECODE every cold command compiles them anew (~40 ms a list on this machine)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--services", type=int, default=500)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--before", metavar="SRC", help="also list with the gpusd of this src/ directory")
    args = ap.parse_args()

    src = REPO / "src"
    srcs = {"gpusd": src}
    if args.before:
        srcs["gpusd (before)"] = Path(args.before).resolve()
    tmp = Path(tempfile.mkdtemp(prefix="gpusd-bench-flood-"))
    session = f"flood-{secrets.token_hex(3)}"
    daemons: list[tuple[Path, int]] = []
    flood: Flood | None = None
    try:
        for i in range(args.hosts):
            state = tmp / f"d{i}"
            state.mkdir()
            daemons.append((state, start_daemon(src, state, session, f"real-{i:02d}")))
        client_state = tmp / "client"
        client_state.mkdir()
        time.sleep(2.0)  # the daemons' announcements die down
        for tree in srcs.values():  # warm-up, not counted: the first run of a tree writes its .pyc files
            one_list(tree, session, client_state)
        print(f"{args.hosts} real daemons on 127.0.0.1, session {session} (load average {os.getloadavg()[0]:.1f} "
              f"on {os.cpu_count()} CPUs)")
        print(f"{'phase':34s} {'tree':16s} {'median s':>9s} {'max s':>7s} {'real hosts listed':>18s} {'pits':>5s}")
        for phase in ("no flood", f"beside {args.services} tar pits"):
            if phase != "no flood":
                flood = Flood(session, args.services)
                flood.start()
                if not flood.ready.wait(300):
                    raise SystemExit("the fake services did not come up")
                time.sleep(2.0)
            results: dict[str, list[tuple[float, int, int]]] = {name: [] for name in srcs}
            for run in range(args.runs):
                for name, tree in srcs.items():
                    results[name].append(one_list(tree, session, client_state, args.hosts, f"run {run + 1}, "))
                    time.sleep(0.3)
            for name, rows in results.items():
                times = [r[0] for r in rows]
                real = [r[1] for r in rows]
                print(f"{phase:34s} {name:16s} {statistics.median(times):9.2f} {max(times):7.2f} "
                      f"{min(real):>8d}-{max(real)} of {args.hosts} {max(r[2] for r in rows):5d}")
    finally:
        if flood is not None:
            flood.close()
        for state, pid in daemons:
            stop_daemon(src, state, pid)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
