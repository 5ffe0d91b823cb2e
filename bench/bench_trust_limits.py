"""Issue 17, attacks 3-6 ("limits"), before/after, on a LAN of network namespaces (tests/netns.py).

    python bench/bench_trust_limits.py [--old SRC] [--streams 300] [--addresses 10]

For each code version (this tree's ``src/``, and with ``--old SRC`` another ``src/`` directory,
e.g. that of a worktree of commit 1d43830: ``git worktree add /tmp/t17-limits-base 1d43830``), one
daemon with the fleet secret (fake NVML, 4 GPUs, TLS on) is started in its own namespace of a fresh
namespace LAN (198.18.0.0/15; nothing leaves the machine), with a *secret holder* and a *stranger*
in two more namespaces.  The clients always run this tree's code; only the daemon changes.

* **row 3**: the secret holder lists the fleet (``gpusd.Client`` with the secret) until the host is
  listed verified, then reserves one GPU on it (``gpusd.pool.reserve``) and releases it: the time of
  each, first without a flood, then while the stranger holds ``--streams`` unsigned
  ``GET /api/v1/events`` streams (from ``--addresses`` addresses of its namespace); how many of those
  streams the daemon accepted.
* **row 4**: a lease request signed for ``localhost:4781`` without ``gpusd-node``, sent from the
  secret holder's namespace: the HTTP status.
* **row 5**: one secret holder, a new ``holder`` name per request (``shared`` GPUs, so the GPUs do not
  run out first): how many leases it gets before a 429, and whether another address then still
  gets one; the ``ttl`` granted for ``count=4, ttl=3600``.
* **row 6**: ``memory: -5`` (and ``count: -1``, ``ttl: 1e9``, ``count: true``): the HTTP statuses.

Everything is bounded (timeouts on every wait, the stranger's streams held at most 60 s) and stops
by itself; the LAN is removed at the end.  Needs root and ``ip netns``.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from fakenvml import make_gpus  # noqa: E402
from netns import Lan, Node, read_lines, unavailable  # noqa: E402

STRANGER = r"""
import asyncio, sys, time
ip, port, n, extra, hold = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(","), float(sys.argv[5])
async def one(i):
    src = extra[i % len(extra)]
    try:
        r, w = await asyncio.wait_for(asyncio.open_connection(ip, port, local_addr=(src, 0)), 5)
        w.write(f"GET /api/v1/events HTTP/1.1\r\nHost: {ip}:{port}\r\n\r\n".encode())
        line = await asyncio.wait_for(r.readline(), 5)
    except (OSError, asyncio.TimeoutError):
        return None
    return (r, w) if line.startswith(b"HTTP/1.1 200") else None
async def drain(r):
    try:
        while await r.read(65536):
            pass
    except OSError:
        pass
async def main():
    held = [c for c in [await one(i) for i in range(n)] if c]
    tasks = [asyncio.ensure_future(drain(r)) for r, _ in held]
    print(f"ready {len(held)}", flush=True)
    await asyncio.sleep(hold)
    for t in tasks:
        t.cancel()
asyncio.run(main())
"""

HOLDER = r"""
import json, sys, time
from gpusd.discovery.sync import Client
from gpusd.pool.client import reserve
from gpusd.wire.signing import FleetKey, load_secret
key = FleetKey(load_secret(sys.argv[1]))
t0 = time.perf_counter()
listed = None
with Client(key=key) as c:
    while time.perf_counter() - t0 < 15:
        if any(h.verified is True and h.snapshot is not None for h in c.hosts):
            listed = time.perf_counter() - t0
            break
        time.sleep(0.02)
    reserved = None
    if listed is not None:
        t1 = time.perf_counter()
        try:
            r = reserve(1, key=key, client=c, ttl=30, discover=0.0)
            reserved = time.perf_counter() - t1
            r.release()
        except Exception as exc:
            print(json.dumps({"error": str(exc)[:200]}), file=sys.stderr)
print(json.dumps({"listed": listed, "reserved": reserved}))
"""

REQUESTS = r"""
import http.client, json, ssl, sys
from gpusd.wire.http import fetch_json
from gpusd.wire.signing import FleetKey, fingerprint, load_secret
key = FleetKey(load_secret(sys.argv[1]))
ip, other = sys.argv[2], sys.argv[3]
node = fetch_json(f"https://{ip}:4781/api/v1/host").data["node_id"]
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT); ctx.check_hostname = False; ctx.verify_mode = ssl.CERT_NONE
def call(method, path, body=None, authority=f"{ip}:4781", node_id=node, src=None):
    payload = json.dumps(body).encode() if body is not None else b""
    c = http.client.HTTPSConnection(ip, 4781, timeout=10, context=ctx, source_address=(src, 0) if src else None)
    try:
        c.connect()  # gpusd 0.4: over TLS the signature covers the certificate the connection shows
        fp = fingerprint(c.sock.getpeercert(binary_form=True))
        headers, _ = key.sign_request(method, f"https://{authority}{path}", body=payload, node_id=node_id, cert_fp=fp)
        headers.update({"Host": authority, "Content-Type": "application/json"})
        c.request(method, path, body=payload or None, headers=headers)
        r = c.getresponse()
        return r.status, json.loads(r.read() or b"{}")
    finally:
        c.close()
def release(d):
    if isinstance(d, dict) and d.get("lease_id"):
        call("DELETE", f"/api/v1/leases/{d['lease_id']}")
out = {}
# row 4: signed for localhost:4781, no gpusd-node, from another machine
s, d = call("POST", "/api/v1/leases", {"count": 1, "holder": "row-4", "ttl": 30}, authority="localhost:4781",
            node_id=None)
out["row4"] = s
release(d)
# row 6: hostile numbers
out["row6"] = {}
for name, body in (("memory: -5", {"memory": -5}), ("count: -1", {"count": -1}), ("ttl: 1e9", {"ttl": 1e9}),
                   ("count: true", {"count": True})):
    s, d = call("POST", "/api/v1/leases", {"count": 1, "holder": "row-6", **body})
    out["row6"][name] = s
    release(d)
# row 5: a holder name per request
got = []
for i in range(80):
    s, d = call("POST", "/api/v1/leases", {"count": 1, "holder": f"name-{i}", "shared": True, "ttl": 60})
    if s != 201:
        out["row5_stop"] = s
        break
    got.append(d)
out["row5_granted"] = len(got)
s, d = call("POST", "/api/v1/leases", {"count": 1, "holder": "other", "shared": True, "ttl": 60}, src=other)
out["row5_other"] = s
release(d)
for d in got:
    release(d)
s, d = call("POST", "/api/v1/leases", {"count": 4, "holder": "all", "ttl": 3600})
out["row5_ttl"] = d.get("ttl") if s == 201 else s
release(d)
print(json.dumps(out))
"""

def run_in(lan: Lan, node: Node, code: str, *args: str, timeout: float = 90) -> dict[str, Any]:
    r = lan.run(node, [sys.executable, "-c", code, *args], env=lan.base_env(node, GPUSD_MDNS_FAST="1"),
                timeout=timeout)
    if r.returncode != 0:
        raise SystemExit(f"a bench step failed: {r.stderr[-2000:]}")
    return dict(json.loads(r.stdout.strip().splitlines()[-1]))


def one_version(label: str, src: Path, streams: int, addresses: int) -> dict[str, Any]:
    out: dict[str, Any] = {"version": label}
    with tempfile.TemporaryDirectory(prefix="gpusd-bench-limits-") as tmp:
        key = Path(tmp) / "fleet.key"
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
        lan = Lan(workdir=Path(tmp) / "lan")
        try:
            host = lan.add_gpu_host("bench-node", make_gpus(4), fast=True,
                                    args=["--token-file", str(key), "--interval", "0.5"])
            host.env["PYTHONPATH"] = str(src)  # the daemon of this version
            holder, stranger = lan.add_node("holder"), lan.add_node("stranger")
            extra = [stranger.ip]
            base = stranger.ip.rsplit(".", 1)[0]
            for i in range(1, addresses):
                ip = f"{base}.{200 + i}"
                subprocess.run(["ip", "-n", stranger.ns, "addr", "add", f"{ip}/16", "dev", "eth0"], check=True)
                extra.append(ip)
            host.start()
            out["calm"] = run_in(lan, holder, HOLDER, str(key))
            p = lan.popen(stranger, [sys.executable, "-c", STRANGER, host.ip, "4780", str(streams), ",".join(extra),
                                     "60"], env=lan.base_env(stranger), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            assert p.stdout is not None
            lines = read_lines(p.stdout.fileno(), 1, 60)
            out["streams_accepted"] = int(lines[0].split()[1]) if lines and lines[0].startswith("ready") else None
            out["flood"] = run_in(lan, holder, HOLDER, str(key))
            p.terminate()
            p.wait(10)
            other_ip = f"{holder.ip.rsplit('.', 1)[0]}.199"  # a second address of the secret holder's machine
            subprocess.run(["ip", "-n", holder.ns, "addr", "add", f"{other_ip}/16", "dev", "eth0"], check=True)
            out.update(run_in(lan, holder, REQUESTS, str(key), host.ip, other_ip))
        finally:
            lan.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", type=Path, help="another src/ directory (e.g. /tmp/t17-limits-base/src)")
    ap.add_argument("--streams", type=int, default=300)
    ap.add_argument("--addresses", type=int, default=10)
    args = ap.parse_args()
    why = unavailable()
    if why:
        print(f"skipped: {why}")
        return 0
    rows = []
    if args.old is not None:
        rows.append(one_version(f"before ({args.old})", args.old, args.streams, args.addresses))
    rows.append(one_version("after (this tree)", REPO / "src", args.streams, args.addresses))

    def secs(v: Any) -> str:
        return f"{v:.2f} s" if isinstance(v, (int, float)) else "never (15 s)"

    print(f"\n{args.streams} unsigned streams from {args.addresses} addresses of one stranger; the daemon "
          "has the fleet secret, 4 GPUs, TLS\n")
    print("| | " + " | ".join(r["version"] for r in rows) + " |")
    print("|---|" + "---|" * len(rows))
    table = [
        ("row 3: unsigned streams the daemon accepted", lambda r: str(r["streams_accepted"])),
        ("row 3: signed client lists the host verified, no flood", lambda r: secs(r["calm"]["listed"])),
        ("row 3: ... and reserves a GPU, no flood", lambda r: secs(r["calm"]["reserved"])),
        ("row 3: lists it verified, under the flood", lambda r: secs(r["flood"]["listed"])),
        ("row 3: ... and reserves a GPU, under the flood", lambda r: secs(r["flood"]["reserved"])),
        ("row 4: signed for localhost:4781, no gpusd-node, from the LAN", lambda r: str(r["row4"])),
        ("row 5: leases one client gets with a new holder name each", lambda r: f"{r['row5_granted']} "
         f"(then {r.get('row5_stop', '-')})"),
        ("row 5: another address, meanwhile", lambda r: str(r["row5_other"])),
        ("row 5: ttl granted for count=4, ttl=3600", lambda r: str(r["row5_ttl"])),
    ]
    for name, cell in table:
        print(f"| {name} | " + " | ".join(cell(r) for r in rows) + " |")
    for k in rows[0]["row6"]:
        print(f"| row 6: {k} | " + " | ".join(str(r["row6"][k]) for r in rows) + " |")
    return 0


if __name__ == "__main__":
    t0 = time.monotonic()
    code = main()
    print(f"\n({time.monotonic() - t0:.0f} s)")
    sys.exit(code)
