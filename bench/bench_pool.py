"""Issue 10 benchmark: the fleet pool on a LAN of network namespaces (tests/netns.py).

* race: 3 hosts x 8 fake GPUs; 64 reservations from 4 client namespaces (16 threads each) plus local
  ``gpusd run`` jobs on every host, all started together, for ``--rounds`` rounds. Counts GPUs given
  twice; the same clients then do genv-style pick-then-attach (each picks the least-loaded GPUs of the
  fleet view it sees, with no lease) on the same setup.
* latency: fleet select + remote lease (one signed HTTPS round trip, proof checked) from a client that
  has discovered the fleet, p50/p99 over ``--samples`` reservations.
* failure: kill -9 of a client holding reservations, and a cut link (``ip link set down``): time until
  the GPUs are free again on the host (TTL 3 s).

Namespaces only, bounded (about a minute with the defaults). Root and ``ip netns`` needed.

    sudo python3 bench/bench_pool.py [--rounds 5] [--samples 60] [--latency-hosts 32]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, make_gpus, pct  # noqa: E402

sys.path.insert(0, str(REPO / "tests"))
from netns import GpuHost, Lan, Node, unavailable  # noqa: E402

TTL = 3.0
WORKER = r"""
import json, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from gpusd.discovery.sync import Client
from gpusd.pool.client import reserve
from gpusd.alloc.select import Constraints, candidates, score
from gpusd.wire.signing import FleetKey, load_secret
key = FleetKey(load_secret(sys.argv[1]))
threads = int(sys.argv[2])
client = Client(key=key)
client.wait_settled(5)
deadline = time.monotonic() + 10
while sum(1 for h in client.hosts if h.verified and h.snapshot) < int(sys.argv[3]) and time.monotonic() < deadline:
    time.sleep(0.1)
print("ready", sum(1 for h in client.hosts if h.verified and h.snapshot), flush=True)
held = []
for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "race":
        def one(_):
            try:
                return reserve(1, key=key, client=client, ttl=float(cmd[1]))
            except Exception as exc:
                return None
        with ThreadPoolExecutor(threads) as pool:
            got = [r for r in pool.map(one, range(threads)) if r is not None]
        held.extend(got)
        print(json.dumps([[r.host, d["uuid"]] for r in got for d in r.devices]), flush=True)
    elif cmd[0] == "genv":
        # pick-then-attach: the least-loaded GPUs of the fleet view this client sees, no lease (each
        # client's jobs pick distinct GPUs; other clients' picks are invisible until attached)
        c = Constraints(count=1)
        seen = []
        for h in client.hosts:
            if h.verified and h.snapshot:
                ok, _ = candidates(h.snapshot, c, [le for g in h.snapshot.gpus for le in g.leases], env={})
                seen += [(score(x, c), h.hostname, x.uuid) for x in ok]
        seen.sort()
        print(json.dumps([[h, u] for _, h, u in seen[:threads]]), flush=True)
    elif cmd[0] == "latency":
        out = []
        for _ in range(int(cmd[1])):
            t = time.perf_counter()
            r = reserve(1, key=key, client=client, ttl=30)
            out.append(time.perf_counter() - t)
            r.release()
        print(json.dumps(out), flush=True)
    elif cmd[0] == "hold":
        rs = [reserve(1, key=key, client=client, ttl=float(cmd[1])) for _ in range(int(cmd[2]))]
        for r in rs:
            r.start_renewing()
        print(json.dumps([[r.host, r.lease_id] for r in rs]), flush=True)
    elif cmd[0] == "release":
        for r in held:
            r.release()
        held = []
        print("[]", flush=True)
"""


class Worker:
    def __init__(self, lan: Lan, node: Node, key: Path, threads: int, hosts: int) -> None:
        env = lan.base_env(node, GPUSD_MDNS_FAST="1")
        self.p = subprocess.Popen(["ip", "netns", "exec", node.ns, sys.executable, "-c", WORKER, str(key),
                                   str(threads), str(hosts)], env=env, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        lan.procs.append(self.p)
        self.node = node
        assert self.p.stdout is not None
        line = self.p.stdout.readline().split()
        assert line and line[0] == "ready", line
        self.seen = int(line[1])  # verified hosts discovered before measuring

    def send(self, line: str) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def read(self) -> Any:
        assert self.p.stdout is not None
        return json.loads(self.p.stdout.readline())


def held_devices(h: GpuHost) -> list[str]:
    """The devices leased on ``h`` right now (its lock directory, read with the kernel's confirmation)."""
    from gpusd.alloc.leases import LeaseStore

    return [le.device or "" for le in LeaseStore(h.env["GPUSD_LOCK_DIR"]).leases()]


def setup(lan: Lan, key: Path, n_hosts: int, interval: str = "0.2") -> list[GpuHost]:
    hosts = []
    for i in range(n_hosts):
        name = f"h{len(lan.nodes) + 1}"
        hosts.append(lan.add_gpu_host(f"node-{i + 1}", make_gpus(8), fast=True, node_name=name,
                                      args=["--token-file", str(key), "--interval", interval],
                                      extra_env={"GPUSD_LEASE_SOCKET": str(lan.workdir / f"{name}.sock")}))
    with ThreadPoolExecutor(n_hosts) as pool:
        list(pool.map(lambda h: h.start(), hosts))
    return hosts


def _shared(grants: list[Any]) -> int:
    """How many GPUs were given to more than one job."""
    from collections import Counter

    return sum(1 for n in Counter(grants).values() if n > 1)


def race(lan: Lan, hosts: list[GpuHost], workers: list[Worker], rounds: int, local_per_host: int) -> dict[str, Any]:
    given_twice, granted, genv_twice = [], [], []
    uuid_of = dict(enumerate(g.uuid for g in make_gpus(8)))
    for _ in range(rounds):
        locals_ = [lan.popen(h.node, [sys.executable, "-m", "gpusd", "run", "-n", "1", "--",
                                      "sh", "-c", "echo $CUDA_VISIBLE_DEVICES; sleep 4"],
                             env=h.env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                   for h in hosts for _ in range(local_per_host)]
        for w in workers:
            w.send(f"race {TTL * 10}")
        remote = [tuple(x) for w in workers for x in w.read()]
        local = []
        for p, h in zip(locals_, [h for h in hosts for _ in range(local_per_host)]):
            assert p.stdout is not None
            line = p.stdout.readline().strip()
            if line.isdigit():
                local.append((h.hostname, uuid_of[int(line)]))
        every = remote + local
        given_twice.append(_shared(every))
        granted.append(len(every))
        for p in locals_:
            p.wait(30)
        for w in workers:
            w.send("release")
            w.read()
        time.sleep(0.5)  # the snapshots catch up with the releases
        for w in workers:
            w.send("genv")
        picks = [tuple(x) for w in workers for x in w.read()]
        genv_twice.append(_shared(picks))
    return {"rounds": rounds, "granted": granted, "given_twice": given_twice, "genv_given_twice": genv_twice}


def failure(lan: Lan, hosts: list[GpuHost], key: Path) -> dict[str, float]:
    out = {}
    for how in ("kill -9", "cut link"):
        node = lan.add_node(f"f{len(lan.nodes) + 1}")
        w = Worker(lan, node, key, 1, len(hosts))
        w.send(f"hold {TTL} 2")
        w.read()
        time.sleep(2 * TTL)  # renewed meanwhile: still held
        assert sum(len(held_devices(h)) for h in hosts) == 2
        t0 = time.monotonic()
        if how == "kill -9":
            os.kill(w.p.pid, signal.SIGKILL)
        else:
            subprocess.run(["ip", "-n", lan.switch, "link", "set", f"v{node.index}", "down"], check=True)
        while sum(len(held_devices(h)) for h in hosts) and time.monotonic() - t0 < 30:
            time.sleep(0.02)
        out[how] = time.monotonic() - t0
        if how == "kill -9":
            w.p.wait(5)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--samples", type=int, default=60)
    ap.add_argument("--local-per-host", type=int, default=2)
    ap.add_argument("--latency-hosts", type=int, default=0,
                    help="also measure the latency with this many hosts (e.g. 32; 1 s sampling)")
    args = ap.parse_args()
    why = unavailable()
    if why:
        print(f"skipped: {why}")
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="gpusd-bench-pool-"))
    key = tmp / "fleet.key"
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, secrets.token_hex(32).encode())
    os.close(fd)
    with Lan(tag="pool") as lan:
        hosts = setup(lan, key, 3)
        workers = [Worker(lan, lan.add_node(f"c{i}"), key, 16, len(hosts)) for i in range(4)]
        t = time.monotonic()
        r = race(lan, hosts, workers, args.rounds, args.local_per_host)
        race_s = time.monotonic() - t
        workers[0].send(f"latency {args.samples}")
        lat = workers[0].read()
        for w in workers:
            w.p.terminate()
        fail = failure(lan, hosts, key)
    big: list[float] = []
    seen = 0
    if args.latency_hosts:
        with Lan(tag="pool32") as lan:
            setup(lan, key, args.latency_hosts, interval="1")
            w = Worker(lan, lan.add_node("c"), key, 1, args.latency_hosts)
            w.send(f"latency {args.samples}")
            big = w.read()
            seen = w.seen
            w.p.terminate()
    print(f"race: {r['rounds']} rounds of 64 reservations + {3 * args.local_per_host} local gpusd run jobs "
          f"on 3 hosts x 8 GPUs ({race_s:.1f} s)")
    print(f"  gpusd pool (lease by the host's daemon): GPUs granted per round {r['granted']} (of 24; the rest "
          f"refused), given twice or more {r['given_twice']}")
    print(f"  genv-style pick-then-attach (no lease):  64 jobs placed per round, GPUs given twice or more "
          f"{r['genv_given_twice']} (of 24)")
    ms = [x * 1000 for x in lat]
    print(f"latency: fleet select + remote lease, 3 hosts, {len(ms)} samples: p50 {pct(ms, 50):.1f} ms, "
          f"p99 {pct(ms, 99):.1f} ms (goal p50 < 20 ms, p99 < 50 ms)")
    if big:
        ms = [x * 1000 for x in big]
        print(f"latency: fleet select + remote lease, {args.latency_hosts} hosts ({seen} discovered), "
              f"{len(ms)} samples: p50 {pct(ms, 50):.1f} ms, p99 {pct(ms, 99):.1f} ms")
    for how, s in fail.items():
        print(f"failure: {how} of the holder: GPUs free after {s:.2f} s (TTL {TTL:g} s; goal <= {TTL + 2:g} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
