"""Issue 10 (beyond one link): how long a host on another subnet takes to appear, found through a
static peer and through wide-area DNS-SD, side by side with mDNS on its own link.

    sudo python bench/bench_beyond.py [--reps 5]

Two LANs of network namespaces (tests/netns.py) joined only by a router namespace; one daemon
(node-b, 1 fake GPU) on LAN B; dnsmasq on LAN A serves the zone that ``gpusd export dns-sd-zone``
prints for it.  Each round starts a fresh ``gpusd watch --json`` and measures process start ->
``host_added`` for node-b: on LAN A with ``--peer``, on LAN A with ``--dns-sd-domain``, and on LAN B
by mDNS alone (the reference).  The watch process's own start-up (Python, imports) is in every
figure alike.  Nothing leaves the namespaces; everything is stopped and deleted at the end.  Needs
root and dnsmasq.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "src"))

from fakenvml import make_gpus  # noqa: E402
from netns import Lan, join, unavailable  # noqa: E402


def dnsmasq_args(zone_lines: str) -> list[str]:
    import dns.rdata
    import dns.rdataclass
    import dns.rdatatype

    out = []
    for line in zone_lines.splitlines():
        name, _ttl, _cls, rtype, rdata = line.split(None, 4)
        rd: Any = dns.rdata.from_text(dns.rdataclass.IN, dns.rdatatype.from_text(rtype), rdata)
        name = name.rstrip(".")
        if rtype == "PTR":
            out.append(f"--ptr-record={name},{rd.target.to_text().rstrip('.')}")
        elif rtype == "SRV":
            out.append(f"--srv-host={name},{rd.target.to_text().rstrip('.')},{rd.port}")
        elif rtype == "TXT":
            out.append(f"--txt-record={name}," + ",".join(s.decode() for s in rd.strings))
        elif rtype == "A":
            out.append(f"--host-record={name},{rd.address}")
    return out


def appear(lan: Lan, node: Any, args: list[str], timeout: float = 30.0) -> float:
    t0 = time.time()
    w = lan.watch(node, args)
    try:
        ev = w.wait_for(lambda e: e["event"] == "host_added" and e["hostname"] == "node-b", timeout)
        return float(ev["_received"]) - t0
    finally:
        w.stop()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    opts = ap.parse_args()
    why = unavailable()
    if why or shutil.which("dnsmasq") is None:
        print(f"skipped: {why or 'dnsmasq is not installed'}")
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="gpusd-bench-beyond-"))
    a = Lan(workdir=tmp / "a", net=1)
    b = Lan(workdir=tmp / "b", net=2)
    dns_proc = None
    try:
        (tmp / "a").mkdir(exist_ok=True)
        (tmp / "b").mkdir(exist_ok=True)
        join(a, b)
        hb = b.add_gpu_host("node-b", make_gpus(1))
        hb.start()
        dns, client, client_b = a.add_node("dns"), a.add_node("client"), b.add_node("client-b")
        r = a.gpusd(client, ["export", "dns-sd-zone", "--domain", "lab.example", "--peer", hb.ip])
        assert r.returncode == 0, r.stderr
        pid_file = tmp / "dnsmasq.pid"
        dns_proc = a.popen(dns, ["dnsmasq", "-k", "-C", "/dev/null", "--no-resolv", "--no-hosts",
                                 f"--listen-address={dns.ip}", "--bind-interfaces", "--port=53", "--user=root",
                                 f"--pid-file={pid_file}", *dnsmasq_args(r.stdout)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)
        ways = {
            "mDNS, same link (reference)": (b, client_b, []),
            "--peer, across the router": (a, client, ["--peer", hb.ip]),
            "wide-area DNS-SD, across the router": (a, client, ["--dns-sd-domain", "lab.example",
                                                                "--dns-server", dns.ip]),
        }
        results: dict[str, list[float]] = {k: [] for k in ways}
        for _ in range(opts.reps):
            for name, (lan, node, args) in ways.items():
                results[name].append(appear(lan, node, args))
        print(f"gpusd watch start -> host_added of node-b (another subnet), {opts.reps} rounds")
        print(f"{'found through':40} {'p50 s':>7} {'max s':>7}")
        for name, xs in results.items():
            print(f"{name:40} {statistics.median(xs):7.3f} {max(xs):7.3f}")
    finally:
        if dns_proc is not None and dns_proc.poll() is None:
            os.kill(dns_proc.pid, signal.SIGTERM)
            dns_proc.wait(10)
        b.close()
        a.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
