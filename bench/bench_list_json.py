"""A cold ``gpusd list --json`` from a host whose daemon follows 1,000 hosts (the goal: <= 1 s at
load 3), beside its floor and the tree before, interleaved.

    python bench/bench_list_json.py [--hosts 1000] [--gpus 8] [--runs 3] [--loads 0,3] [--before /work/main/src]

A stub daemon (this file with ``--serve``: the pid file's lock and ``gpusd.json`` in a state directory of
its own, as a daemon leaves them, and ``GET /api/v1/fleet`` on 127.0.0.1 answering a prepared fleet view of
``--hosts`` simulated hosts of ``--gpus`` H100 each, ~10.6 MB at 1,000 x 8) stands for the daemon: the figure
is the listing's own cost, not the daemon's.  Each run times, one after the other:

* the floor: a new ``python`` that fetches the answer and ``json.loads`` it, nothing more;
* ``gpusd list --json`` of this tree;
* ``gpusd list --json`` of the tree before (``--before``: copied to a temporary directory and compiled
  there, so that tree is left as it is), whose output must be the same, byte for byte.

Wall seconds and the CPU seconds of the process (``wait4``), min-max over the runs, the load average of
each run printed beside; ``--loads 0,3`` runs them at the load found, then beside three busy loops.  Both
trees are byte-compiled first (an installed gpusd has its bytecode; this image sets
PYTHONDONTWRITEBYTECODE).  Nothing leaves loopback; the stub and the loops are stopped by pid.
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _load import busy_load

REPO = Path(__file__).resolve().parent.parent
SESSION = "bench-list"
OWN_NODE = f"{0:016x}"
GOAL = 1.0  # s, at load 3

FLOOR = """import json, sys, urllib.request
with urllib.request.urlopen(sys.argv[1], timeout=60) as r:
    json.loads(r.read())
"""


def answer(hosts: int, gpus: int) -> bytes:
    """A fleet view of ``hosts`` simulated hosts of ``gpus`` H100 each, as a daemon sends it."""
    sys.path.insert(0, str(REPO / "src"))
    from gpusd.inventory.simulated import SimulatedBackend

    with SimulatedBackend(f"{gpus}xH100-80GB", host="fake", node=OWN_NODE) as backend:
        snap = json.loads(json.dumps(backend.snapshot().to_dict()))
    out = []
    for i in range(hosts):
        s = json.loads(json.dumps(snap))
        s["hostname"], s["node_id"] = f"fake-{i:04d}", f"{i:016x}"
        for g in s["gpus"]:
            g["uuid"] = f"GPU-{i:08d}-{g['index']:04d}"
        out.append({"hostname": s["hostname"], "node_id": s["node_id"], "session": SESSION, "source": "gpusd",
                    "url": f"http://127.1.{i // 250}.{i % 250 + 1}:4780/api/v1", "alive": True,
                    "last_seen": 1.8e9 + i, "verified": None, "via": "dns-sd", "snapshot": s})
    return json.dumps({"schema": 1, "session": SESSION, "hosts": out, "hosts_dropped": 0},
                      separators=(",", ":")).encode()


def serve(state: Path, body_file: Path) -> None:
    """The stub daemon: its pid file locked, its ``gpusd.json`` written, the answer served until killed."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    sys.path.insert(0, str(REPO / "src"))
    from gpusd.daemon.process import PidFile, write_info

    body = body_file.read_bytes()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path != "/api/v1/fleet":
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state.mkdir(parents=True, exist_ok=True)
    pid = PidFile(state)
    pid.acquire()
    write_info(state, {"pid": os.getpid(), "port": server.server_address[1], "addresses": ["127.0.0.1"],
                       "interfaces": ["127.0.0.1"], "session": SESSION, "node_id": OWN_NODE})
    print("ready", flush=True)
    server.serve_forever()


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, float, bytes]:
    """(wall seconds, CPU seconds of the process, its standard output) of one command."""
    with tempfile.TemporaryFile() as out:
        t = time.monotonic()
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.DEVNULL)
        _, status, usage = os.wait4(proc.pid, 0)
        took = time.monotonic() - t
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        return took, usage.ru_utime + usage.ru_stime, out.read()


def list_env(state: Path, src: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(src), GPUSD_STATE_DIR=str(state), GPUSD_INTERFACES="127.0.0.1")
    for var in ("GPUSD_TOKEN", "GPUSD_TOKEN_FILE", "GPUSD_PEERS", "GPUSD_PEERS_FILE", "GPUSD_DNS_SD_DOMAIN",
                "PYTHONDONTWRITEBYTECODE"):
        env.pop(var, None)
    return env


def span(xs: list[float]) -> str:
    return f"{min(xs):.2f}-{max(xs):.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=1000)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--loads", default="0,3", help="busy loops beside the runs, comma-separated (default 0,3)")
    ap.add_argument("--before", metavar="SRC", help="the tree before (its src directory), timed interleaved")
    ap.add_argument("--serve", nargs=2, metavar=("STATE", "BODY"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(Path(args.serve[0]), Path(args.serve[1]))
        return 0

    tmp = Path(tempfile.mkdtemp(prefix="gpusd-bench-list-"))
    stub = None
    try:
        trees = {"this tree": REPO / "src"}
        if args.before:
            before = tmp / "before"
            shutil.copytree(args.before, before / "src", ignore=shutil.ignore_patterns("__pycache__"))
            trees["before"] = before / "src"
        for src in trees.values():  # as installed: bytecode written once (the image sets PYTHONDONTWRITEBYTECODE)
            compileall.compile_dir(str(src), quiet=1)
        body = answer(args.hosts, args.gpus)
        (tmp / "body.json").write_bytes(body)
        state = tmp / "state"
        stub = subprocess.Popen([sys.executable, __file__, "--serve", str(state), str(tmp / "body.json")],
                                stdout=subprocess.PIPE, text=True)
        assert stub.stdout is not None
        if stub.stdout.readline().strip() != "ready":
            raise SystemExit("the stub daemon did not start")
        port = json.loads((state / "gpusd.json").read_text())["port"]
        print(f"{args.hosts} hosts x {args.gpus} GPUs, answer {len(body) / 1e6:.1f} MB; {os.cpu_count()} CPUs; "
              f"runs interleaved: floor, {', '.join(trees)}", flush=True)
        argv = [sys.executable, "-m", "gpusd", "list", "--json", "-i", "127.0.0.1", "--session", SESSION]
        for busy in [int(x) for x in args.loads.split(",")]:
            figures: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in ["floor", *trees]}
            loads: list[float] = []
            with busy_load(busy):
                for run in range(args.runs):
                    took, cpu, _ = timed([sys.executable, "-c", FLOOR, f"http://127.0.0.1:{port}/api/v1/fleet"],
                                         dict(os.environ))
                    figures["floor"][0].append(took)
                    figures["floor"][1].append(cpu)
                    outputs = {}
                    for name, src in trees.items():
                        took, cpu, out = timed(argv, list_env(state, src))
                        figures[name][0].append(took)
                        figures[name][1].append(cpu)
                        outputs[name] = out
                    devices = len(json.loads(outputs["this tree"] or b"[]"))
                    if devices != args.hosts * args.gpus:
                        raise SystemExit(f"this tree listed {devices} devices, not {args.hosts * args.gpus}")
                    if "before" in outputs and outputs["before"] != outputs["this tree"]:
                        raise SystemExit("the two trees' outputs differ")
                    loads.append(os.getloadavg()[0])
                    print(f"  {busy} busy loops, run {run + 1}: load average {loads[-1]:.1f}; " + "; ".join(
                        f"{k} {v[0][-1]:.2f} s wall, {v[1][-1]:.2f} s CPU" for k, v in figures.items()), flush=True)
            print(f"{busy} busy loops (load average {span(loads)}), min-max of {args.runs} runs:")
            for name, (walls, cpus) in figures.items():
                print(f"  {name:10s} wall {span(walls)} s   CPU {span(cpus)} s")
            if "before" in trees:
                print("  outputs of this tree and before: identical in every run")
        print(f"goal: <= {GOAL:g} s at load 3")
    finally:
        if stub is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stub.pid, signal.SIGKILL)
            stub.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
