"""Issue 4 benchmark: discovery on a LAN of network namespaces (tests/netns.py), real multicast.

    sudo python bench/bench_discovery.py [--neigh-gc-thresh 8192] [--reps 5] [--updates 20]
        [--hosts 32] [--gpus 8] [--rest 60] [--load 30] [--skip-latency] [--skip-scale] [--json FILE]
    sudo python bench/bench_discovery.py --list-only [--hosts 32] [--list-reps 5] [--old-src DIR]

Every daemon runs with gpusd's shipped timings (mDNS probing/announcing as python-zeroconf does it,
1 s sampling, 2 s heartbeats, 10 s liveness bound) on its own fake NVML, pinned to its namespace's
address; the client is ``gpusd watch --json`` in another namespace.  Measured:

* latency: daemon start -> client's ``host_added``; NVML state-file change -> ``device_updated``;
  ``gpusd stop`` / ``kill -9`` / cable pulled -> ``host_removed``;
* cold ``gpusd list`` (``--list-only``): with ``--hosts`` hosts up, from a node without a daemon (the
  one-shot browse) and on a host whose daemon runs (its fleet view), optionally against another
  source tree (``--old-src``);
* scale: ``--hosts`` hosts with ``--gpus`` GPUs each: time until the client has every GPU; mDNS
  multicast bytes per host per minute at rest and under changing load (frames on the bridge
  ports, Ethernet headers included); each daemon's CPU share and resident memory.

Nothing leaves the namespaces; everything started is stopped and every namespace deleted, also on
Ctrl-C.  Needs root.  Reference figure (stated, not run): gpustat-web polls every host over SSH every
5 s, so a change shows up after 2.5 s on average and up to 5 s plus the SSH round trip.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from fakenvml import make_gpus  # noqa: E402
from netns import GpuHost, Lan, unavailable  # noqa: E402

GiB = 2**30

SNIFFER = textwrap.dedent('''
    # Count mDNS frames entering the bridge from each host port (multicast and unicast apart).
    import json, socket, struct, sys, time
    dur = float(sys.argv[1])
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(3))
    s.settimeout(0.2)
    out = {}
    end = time.monotonic() + dur
    while time.monotonic() < end:
        try:
            data, addr = s.recvfrom(65535)
        except socket.timeout:
            continue
        if addr[2] == socket.PACKET_OUTGOING or not addr[0].startswith("v"):  # (ifname, proto, pkttype, ...)
            continue
        if len(data) < 42 or data[12:14] != b"\\x08\\x00" or data[23] != 17:
            continue
        ihl = (data[14] & 15) * 4
        sport, dport = struct.unpack("!HH", data[14 + ihl:18 + ihl])
        if 5353 not in (sport, dport):
            continue
        src = socket.inet_ntoa(data[26:30])
        kind = "multicast" if data[30:34] == socket.inet_aton("224.0.0.251") else "unicast"
        c = out.setdefault(src, {"multicast": [0, 0], "unicast": [0, 0]})
        c[kind][0] += 1
        c[kind][1] += len(data) + 4  # + Ethernet FCS
    print(json.dumps(out), flush=True)
''')


def stats(xs: list[float]) -> str:
    if not xs:
        return "-"
    xs = sorted(xs)
    p95 = xs[min(len(xs) - 1, int(round(0.95 * (len(xs) - 1))))]
    return (f"median {statistics.median(xs) * 1000:.0f} ms, p95 {p95 * 1000:.0f} ms, "
            f"max {xs[-1] * 1000:.0f} ms (n={len(xs)})")


def is_(kind: str, host: str | None = None) -> Any:
    return lambda e: e["event"] == kind and (host is None or e["hostname"] == host)


class Sniffer:
    def __init__(self, lan: Lan, seconds: float) -> None:
        self.proc = subprocess.Popen(["ip", "netns", "exec", lan.switch, sys.executable, "-c", SNIFFER, str(seconds)],
                                     stdout=subprocess.PIPE, text=True)
        lan.procs.append(self.proc)

    def result(self) -> dict[str, Any]:
        out, _ = self.proc.communicate(timeout=600)
        return json.loads(out or "{}")


# -- latency ---------------------------------------------------------------------------------------
def latency(args: argparse.Namespace, results: dict[str, Any]) -> None:
    with Lan(tag="lat") as lan:
        hosts = [lan.add_gpu_host(f"lat-{i}", make_gpus(2)) for i in range(1, 4)]
        client = lan.add_node("client")
        w = lan.watch(client)
        time.sleep(1.0)  # the watcher is up and browsing
        start, stop, kill = [], [], []
        h = hosts[0]
        for _ in range(args.reps):
            mark = w.mark()
            t0 = h.start(wait=False)
            ev = w.wait_for(is_("host_added", h.hostname), timeout=20, start=mark)
            start.append(ev["_received"] - t0)
            time.sleep(random.uniform(0.5, 1.5))
            mark = w.mark()
            t1 = time.time()
            h.stop()
            ev = w.wait_for(is_("host_removed", h.hostname), timeout=15, start=mark)
            stop.append(ev["_received"] - t1)
            time.sleep(0.5)
        h = hosts[1]
        for _ in range(args.reps):
            mark = w.mark()
            h.start(wait=False)
            w.wait_for(is_("host_added", h.hostname), timeout=20, start=mark)
            time.sleep(random.uniform(0.5, 1.5))
            mark = w.mark()
            t1 = h.kill()
            ev = w.wait_for(is_("host_removed", h.hostname), timeout=15, start=mark)
            kill.append(ev["_received"] - t1)
        # state-file changes at random phases of the 1 s sampling
        h = hosts[2]
        mark = w.mark()
        h.start()
        w.wait_for(is_("device_added", h.hostname), timeout=20, start=mark)
        time.sleep(2.0)
        updates = []
        for i in range(args.updates):
            time.sleep(random.uniform(0.3, 1.3))
            mark = w.mark()
            h.gpus[0].memory_used = (i % 40 + 1) * GiB
            t = h.write()
            ev = w.wait_for(lambda e: e["event"] == "device_updated" and e["hostname"] == h.hostname
                            and "memory_used" in e.get("changed", ()), timeout=10, start=mark)
            updates.append(ev["_received"] - t)
        # cable pulled: bounded by the liveness check, not by mDNS caches
        cable = []
        for rep in range(args.cable_reps):
            if rep:
                h.plug()
                w.wait_for(is_("host_added", h.hostname), timeout=30, start=mark)
            mark = w.mark()
            t = h.unplug()
            ev = w.wait_for(is_("host_removed", h.hostname), timeout=20, start=mark)
            cable.append(ev["_received"] - t)
        w.stop()
    results["latency"] = {"start_to_host_added": start, "state_change_to_device_updated": updates,
                          "clean_stop_to_host_removed": stop, "kill9_to_host_removed": kill,
                          "cable_pulled_to_host_removed": cable}
    print("\n## latency (3 hosts + 1 client, default timings)")
    print(f"daemon start -> host_added:           {stats(start)}")
    print(f"state change -> device_updated:       {stats(updates)}   "
          "(goal < 1500 ms; gpustat-web: 2500 ms mean, 5000 ms max + SSH)")
    print(f"gpusd stop -> host_removed:           {stats(stop)}")
    print(f"kill -9 -> host_removed:              {stats(kill)}")
    print(f"cable pulled -> host_removed:         {stats(cable)}   (bound 10 s; mDNS caches alone: 1125-4500 s)")


# -- scale -----------------------------------------------------------------------------------------
def proc_usage(hosts: list[GpuHost]) -> dict[int, tuple[float, int]]:
    import psutil

    out = {}
    for h in hosts:
        if h.proc is None:
            continue
        try:
            p = psutil.Process(h.proc.pid)
            t = p.cpu_times()
            out[h.proc.pid] = (t.user + t.system, p.memory_info().rss)
        except psutil.Error:
            continue
    return out


def window(lan: Lan, hosts: list[GpuHost], seconds: float, during: Any = None) -> dict[str, Any]:
    sniff = Sniffer(lan, seconds)
    before = proc_usage(hosts)
    t0 = time.monotonic()
    stop = threading.Event()
    th = None
    if during is not None:
        th = threading.Thread(target=during, args=(stop,), daemon=True)
        th.start()
    counts = sniff.result()
    elapsed = time.monotonic() - t0
    stop.set()
    if th is not None:
        th.join(10)
    after = proc_usage(hosts)
    cpu = [(after[p][0] - before[p][0]) / elapsed * 100 for p in after if p in before]
    rss = [after[p][1] / 2**20 for p in after]
    ips = {h.ip for h in hosts}
    per_min = [counts.get(ip, {}).get("multicast", [0, 0])[1] * 60 / seconds for ip in ips]
    pkts_min = [counts.get(ip, {}).get("multicast", [0, 0])[0] * 60 / seconds for ip in ips]
    client_ips = set(counts) - ips
    client_bytes = sum(counts[ip]["multicast"][1] + counts[ip]["unicast"][1] for ip in client_ips) * 60 / seconds
    return {"multicast_bytes_per_host_per_min": {"mean": statistics.mean(per_min), "max": max(per_min)},
            "multicast_packets_per_host_per_min": {"mean": statistics.mean(pkts_min), "max": max(pkts_min)},
            "client_mdns_bytes_per_min": client_bytes,
            "daemon_cpu_percent": {"mean": statistics.mean(cpu), "max": max(cpu)} if cpu else None,
            "daemon_rss_mib": {"mean": statistics.mean(rss), "max": max(rss)} if rss else None}


def scale(args: argparse.Namespace, results: dict[str, Any]) -> None:
    n, g = args.hosts, args.gpus
    total = n * g
    with Lan(tag="scale") as lan:
        t_setup = time.monotonic()
        hosts = [lan.add_gpu_host(f"gpu-{i:02d}", make_gpus(g, util_gpu=random.randint(0, 60),
                                                                memory_used=random.randint(1, 30) * GiB))
                 for i in range(1, n + 1)]
        client = lan.add_node("client")
        setup = time.monotonic() - t_setup
        w = lan.watch(client)
        time.sleep(1.0)
        sniff = Sniffer(lan, 600)
        t0 = time.time()
        with ThreadPoolExecutor(n) as pool:
            ready = dict(pool.map(lambda h: (h.hostname, (h.start(timeout=120), time.time())[1]), hosts))
        w.wait_count(is_("device_added"), total, timeout=120)
        last = max(e["_received"] for e in w.events if e["event"] == "device_added")
        all_seen = last - t0
        after_ready = last - max(ready.values())
        added = {e["hostname"]: e["_received"] for e in w.events if e["event"] == "host_added"}
        lags = sorted(added[h] - ready[h] for h in ready)
        sniff.proc.terminate()
        thresh = Path(NEIGH.format(3)).read_text().strip()
        print(f"\n## scale: {n} hosts x {g} GPUs = {total} GPUs (namespaces set up in {setup:.1f} s; "
              f"machine-wide ARP table limit gc_thresh3={thresh})")
        print(f"launch of {n} daemons -> client has all {total} GPUs: {all_seen:.1f} s "
              f"(last daemon ready -> all seen: {after_ready * 1000:.0f} ms; "
              f"daemon ready -> its host_added: median {statistics.median(lags) * 1000:.0f} ms, "
              f"max {lags[-1] * 1000:.0f} ms)")
        time.sleep(5)  # let start-up traffic (announcements, first queries) die down
        rest = window(lan, hosts, args.rest)
        print(f"at rest ({args.rest:.0f} s): "
              f"multicast {rest['multicast_bytes_per_host_per_min']['mean']:.0f} B/host/min "
              f"(max {rest['multicast_bytes_per_host_per_min']['max']:.0f}), "
              f"{rest['multicast_packets_per_host_per_min']['mean']:.1f} packets/host/min; "
              f"daemon CPU {rest['daemon_cpu_percent']['mean']:.2f} % of a core "
              f"(max {rest['daemon_cpu_percent']['max']:.2f}), "
              f"RSS {rest['daemon_rss_mib']['mean']:.0f} MiB (max {rest['daemon_rss_mib']['max']:.0f})")

        def churn(stop: threading.Event) -> None:
            """Every second, every host: new load on every GPU; GPUs flip between idle and busy."""
            k = 0
            while not stop.is_set():
                k += 1
                for h in hosts:
                    for gpu in h.gpus:
                        busy = random.random() < 0.5
                        gpu.util_gpu = random.randint(20, 100) if busy else 0
                        gpu.memory_used = random.randint(1, 70) * GiB
                    h.write()
                stop.wait(1.0)

        mark = w.mark()
        load = window(lan, hosts, args.load, churn)
        updates = sum(1 for e in w.events[mark:] if e["event"] == "device_updated")
        print(f"changing load ({args.load:.0f} s, every GPU changes every second): multicast "
              f"{load['multicast_bytes_per_host_per_min']['mean']:.0f} B/host/min "
              f"(max {load['multicast_bytes_per_host_per_min']['max']:.0f}), "
              f"{load['multicast_packets_per_host_per_min']['mean']:.1f} packets/host/min; "
              f"daemon CPU {load['daemon_cpu_percent']['mean']:.2f} % (max {load['daemon_cpu_percent']['max']:.2f}), "
              f"RSS {load['daemon_rss_mib']['mean']:.0f} MiB; client got {updates / args.load:.0f} device_updated/s")
        t = time.monotonic()
        r = lan.gpusd(client, ["list", "--json"], timeout=60)
        cold = time.monotonic() - t
        listed = len(json.loads(r.stdout or "[]"))
        print(f"cold `gpusd list` (new process) with {n} hosts up: {cold:.2f} s, {listed} GPUs listed")
        w.stop()
        t = time.monotonic()
    print(f"teardown: {time.monotonic() - t:.1f} s")
    results["scale"] = {"hosts": n, "gpus_per_host": g, "launch_to_all_gpus_s": all_seen, "ready_to_added_s": lags,
                        "last_ready_to_all_gpus_s": after_ready, "rest": rest, "load": load,
                        "device_updated_per_s": updates / args.load, "cold_list_s": cold, "cold_list_gpus": listed}


def cold_list(args: argparse.Namespace, results: dict[str, Any]) -> None:
    """Cold ``gpusd list`` (a new process each run) with ``--hosts`` hosts up: from a node without a
    daemon (one-shot browse) and on a host whose daemon runs (its fleet view); with ``--old-src``,
    the same from that source tree (the fixed 1.5 s browse of gpusd 0.1)."""
    n, g = args.hosts, args.gpus
    total = n * g
    with Lan(tag="list") as lan:
        hosts = [lan.add_gpu_host(f"gpu-{i:02d}", make_gpus(g, util_gpu=random.randint(0, 60)))
                 for i in range(1, n + 1)]
        client = lan.add_node("client")
        w = lan.watch(client)
        t0 = time.monotonic()
        with ThreadPoolExecutor(n) as pool:
            list(pool.map(lambda h: h.start(timeout=120), hosts))
        w.wait_count(is_("device_added"), total, timeout=120)
        w.stop()
        up = time.monotonic() - t0
        print(f"\n## cold `gpusd list`: {n} hosts x {g} GPUs = {total} GPUs (all up after {up:.1f} s)")
        time.sleep(3)  # start-up traffic (announcements, first queries) dies down
        empty = lan.workdir / "client-state"
        empty.mkdir()
        client_env = lan.base_env(client, GPUSD_STATE_DIR=str(empty))
        here = hosts[0]
        runs: list[tuple[str, Any, dict[str, str], list[str]]] = [
            ("client, no daemon: one-shot browse", client, client_env, []),
            (f"{here.hostname}, its daemon runs: fleet view", here.node, here.env, []),
        ]
        if args.old_src:
            old = str(Path(args.old_src).resolve())
            runs += [("client, no daemon: before (--old-src)", client, dict(client_env, PYTHONPATH=old), []),
                     (f"{here.hostname}, its daemon runs: before (--old-src)", here.node,
                      dict(here.env, PYTHONPATH=old), [])]
        # the floors: the interpreter alone; a bare Python reading the daemon's fleet answer and parsing it
        port = json.loads((here.state_dir / "gpusd.json").read_text())["port"]
        fetch = ("import json, sys, urllib.request\n"
                 "with urllib.request.urlopen(sys.argv[1], timeout=30) as r: json.loads(r.read())\n")
        runs += [("floor: python -c pass", client, client_env, [sys.executable, "-c", "pass"]),
                 (f"floor: {here.hostname}, python reads /api/v1/fleet", here.node, here.env,
                  [sys.executable, "-c", fetch, f"http://127.0.0.1:{port}/api/v1/fleet"])]
        print(f"{'where, how':52s} {'first s':>8s} {'median s':>9s} {'max s':>7s} {'CPU s':>6s} {'GPUs listed':>12s}")
        times: dict[str, list[float]] = {label: [] for label, *_ in runs}
        cpus: dict[str, list[float]] = {label: [] for label, *_ in runs}
        counts: dict[str, list[int]] = {label: [] for label, *_ in runs}
        for _ in range(args.list_reps):  # interleaved: every case once per round
            for label, node, env, argv in runs:
                t = time.monotonic()
                proc = lan.popen(node, argv or [sys.executable, "-m", "gpusd", "list", "--json"], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
                stdout = proc.stdout.read() if proc.stdout is not None else b""
                _, _, usage = os.wait4(proc.pid, 0)
                proc.returncode = 0  # reaped by wait4
                times[label].append(time.monotonic() - t)
                cpus[label].append(usage.ru_utime + usage.ru_stime)  # ip netns exec execs the command: its CPU
                if not argv:
                    counts[label].append(len(json.loads(stdout or b"[]")))
                time.sleep(0.3)
        out = {}
        for label, *_ in runs:
            rest = times[label][1:] or times[label]
            listed = (f"{min(counts[label]):>5d}-{max(counts[label])} of {total}" if counts[label] else "")
            print(f"{label:52s} {times[label][0]:8.2f} {statistics.median(rest):9.2f} {max(rest):7.2f} "
                  f"{statistics.median(cpus[label]):6.2f} {listed}")
            out[label] = {"seconds": times[label], "cpu_seconds": cpus[label], "gpus_listed": counts[label]}
        print(f"(interleaved, {args.list_reps} rounds; median and max leave out the first round; load average "
              f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
    results["cold_list"] = {"hosts": n, "gpus_per_host": g, "runs": out}


NEIGH = "/proc/sys/net/ipv4/neigh/default/gc_thresh{}"


class NeighLimit:
    """Raise the kernel's neighbour-table limits for the run (restored afterwards).

    All namespaces share one ARP table (``gc_thresh3`` = 1024 entries by default, machine-wide).
    python-zeroconf probes with a QU question for the service type, which every running daemon
    answers by unicast, so N daemons starting together make about N² ARP entries: with 32 hosts the
    shared table overflows and some TCP connects fail for seconds -- an artefact of emulating 33
    machines in one kernel (each real machine has its own table with ~N entries)."""

    def __init__(self, thresh3: int) -> None:
        self.thresh3 = thresh3
        self.saved: dict[int, str] = {}

    def __enter__(self) -> "NeighLimit":
        if self.thresh3 <= 0:
            return self
        for i in (2, 3):
            self.saved[i] = Path(NEIGH.format(i)).read_text().strip()
        if int(self.saved[3]) < self.thresh3:
            Path(NEIGH.format(2)).write_text(str(max(int(self.saved[2]), self.thresh3 // 2)))
            Path(NEIGH.format(3)).write_text(str(self.thresh3))
        return self

    def __exit__(self, *exc: object) -> None:
        for i in (3, 2):
            if i in self.saved:
                Path(NEIGH.format(i)).write_text(self.saved[i])


def main() -> int:
    # as installed: gpusd's modules compiled once (the first run writes their .pyc), then read from it; with
    # PYTHONDONTWRITEBYTECODE every cold command compiles them anew (~40 ms a list on this machine)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5, help="start/stop/kill repetitions (default 5)")
    ap.add_argument("--updates", type=int, default=20, help="state changes timed (default 20)")
    ap.add_argument("--cable-reps", type=int, default=2, help="cable pulls timed (default 2)")
    ap.add_argument("--hosts", type=int, default=32, help="hosts in the scale run (default 32)")
    ap.add_argument("--gpus", type=int, default=8, help="GPUs per host in the scale run (default 8)")
    ap.add_argument("--rest", type=float, default=60, help="seconds measured at rest (default 60)")
    ap.add_argument("--load", type=float, default=30, help="seconds measured under changing load (default 30)")
    ap.add_argument("--skip-latency", action="store_true")
    ap.add_argument("--skip-scale", action="store_true")
    ap.add_argument("--list-only", action="store_true",
                    help="only time cold `gpusd list` with --hosts hosts (about a minute with 32)")
    ap.add_argument("--list-reps", type=int, default=5, help="cold `gpusd list` runs per case (default 5)")
    ap.add_argument("--old-src", metavar="DIR", help="also time `gpusd list` from this source tree (another version)")
    ap.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    ap.add_argument("--neigh-gc-thresh", type=int, default=0, metavar="N",
                    help="raise the machine-wide ARP table limit (gc_thresh3) to N for the run, restored "
                    "afterwards (default: leave it; see NeighLimit)")
    args = ap.parse_args()
    reason = unavailable()
    if reason:
        print(f"bench_discovery: {reason}", file=sys.stderr)
        return 2
    if not 1 <= args.hosts <= 200:
        ap.error("--hosts: 1..200")
    results: dict[str, Any] = {"cpus": os.cpu_count(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    t = time.monotonic()
    if args.list_only:
        with NeighLimit(args.neigh_gc_thresh):
            cold_list(args, results)
        args.skip_latency = args.skip_scale = True
    if not args.skip_latency:
        latency(args, results)
    if not args.skip_scale:
        with NeighLimit(args.neigh_gc_thresh):
            results["neigh_gc_thresh3"] = Path(NEIGH.format(3)).read_text().strip()
            scale(args, results)
    print(f"\ntotal {time.monotonic() - t:.0f} s on {os.cpu_count()} CPU(s)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
