"""Issue 20: the fleet-wide cap's propagation window and a burst's overshoot, on a LAN of network
namespaces (tests/netns.py; 198.18.0.0/15, nothing leaves the machine).

    python bench/bench_fleet_cap.py [--interval 0.2 --interval 1.0] [--rounds 10]

Two GPU hosts (fake NVML, 4 GPUs each, TLS on, the same fleet secret) and a client, for each
``--interval`` (the daemons' sampling interval, ``gpusd start --interval``).  The policy file says
``fleet_max_gpus_per_user: 1``.  A test account (``useradd``, deleted at the end) lists a fresh
Ed25519 key in its ``~/.ssh/authorized_keys``; the client signs with it.

* **window**: the client takes one GPU on node-1, then polls node-2 (a signed lease request, given
  back at once when granted) until node-2 refuses it by the cap: the time from node-1's grant to
  node-2's first refusal.  The floor beside it: one sampling interval (node-1 shows a lease in its
  next sample; its event stream carries it to node-2's fleet view at once).
* **burst**: the client asks node-1 and node-2 for one GPU each, the second request ``delay`` seconds
  after the first (0, 0.1, 0.25, 0.5, 1, 2 s): how often both are granted (the cap exceeded by one).

Everything is bounded and stops by itself; the LAN and the account are removed at the end.  Needs
root, ``ip netns``, ``useradd`` and ``ssh-keygen``.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from fakenvml import make_gpus  # noqa: E402
from netns import Lan, unavailable  # noqa: E402

CLIENT = r"""
import json, sys, threading, time
from gpusd.wire.http import fetch_json, request_json
from gpusd.wire.signing import FleetKey, load_secret
from gpusd.wire.sshsig import FileSigner
key_file, ident, ip1, ip2, rounds = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
key, user = FleetKey(load_secret(key_file)), FileSigner.load(ident)
urls = [f"https://{ip}:4781/api/v1" for ip in (ip1, ip2)]
nodes = [fetch_json(u + "/host").data["node_id"] for u in urls]
def take(i):
    r = request_json("POST", urls[i] + "/leases", {"count": 1, "holder": "bench", "ttl": 60}, key=key,
                     node_id=nodes[i], user=user, timeout=10)
    return r.data.get("lease_id") if r.status == 201 else None, r.status
def give(i, lease):
    request_json("DELETE", f"{urls[i]}/leases/{lease}", key=key, node_id=nodes[i], user=user, timeout=10)
def settle():  # no lease of ours left anywhere, and node-2 grants again (its view caught up)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        lease, status = take(1)
        if lease:
            give(1, lease)
            lease0, _ = take(0)
            if lease0:
                give(0, lease0)
                return True
        time.sleep(0.1)
    return False
out = {"window": [], "burst": {}}
for _ in range(rounds):
    if not settle():
        break
    time.sleep(0.5)
    lease, _ = take(0)
    t0 = time.monotonic()
    refused = None
    while time.monotonic() - t0 < 20:
        other, status = take(1)
        if other:
            give(1, other)
            continue
        if status == 429:
            refused = time.monotonic() - t0
            break
    out["window"].append(refused)
    give(0, lease)
for delay in (0.0, 0.1, 0.25, 0.5, 1.0, 2.0):
    both = 0
    for _ in range(rounds):
        if not settle():
            break
        time.sleep(0.5)
        got = [None, None]
        def second():
            time.sleep(delay)
            got[1] = take(1)[0]
        t = threading.Thread(target=second)
        t.start()
        got[0] = take(0)[0]
        t.join()
        both += all(got)
        for i, lease in enumerate(got):
            if lease:
                give(i, lease)
    out["burst"][str(delay)] = [both, rounds]
print(json.dumps(out))
"""


def one(interval: float, rounds: int, tmp: Path, ident: Path) -> dict[str, Any]:
    key = tmp / f"fleet-{interval}.key"
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    pol = tmp / "policy.json"
    lan = Lan(workdir=tmp / f"lan-{interval}")
    try:
        hosts = [lan.add_gpu_host(f"node-{i}", make_gpus(4), fast=True, node_name=f"h{i}",
                                  args=["--token-file", str(key), "--interval", str(interval)],
                                  extra_env={"GPUSD_POLICY": str(pol),
                                             "GPUSD_LEASE_SOCKET": str(tmp / f"h{i}-{interval}.sock")})
                 for i in (1, 2)]
        for h in hosts:
            h.start()
        client = lan.add_node("client")
        r = lan.run(client, [sys.executable, "-c", CLIENT, str(key), str(ident), hosts[0].ip, hosts[1].ip,
                             str(rounds)], env=lan.base_env(client), timeout=900)
        if r.returncode != 0:
            raise SystemExit(f"the client failed: {r.stderr[-2000:]}")
        return dict(json.loads(r.stdout.strip().splitlines()[-1]))
    finally:
        lan.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--interval", type=float, action="append")
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    why = unavailable()
    if why or os.geteuid() != 0:
        print(f"skipped: {why or 'needs root'}")
        return 0
    intervals = args.interval or [0.2, 1.0]
    name = f"gbench{secrets.token_hex(3)}"
    with tempfile.TemporaryDirectory(prefix="gpusd-bench-fleetcap-") as t:
        tmp = Path(t)
        os.chmod(tmp, 0o755)
        (tmp / "policy.json").write_text(json.dumps({"fleet_max_gpus_per_user": 1}))
        (tmp / "policy.json").chmod(0o644)
        home = tmp / "home"
        subprocess.run(["useradd", "-M", "-d", str(home), "-s", "/usr/sbin/nologin", "-U", name], check=True)
        try:
            import pwd

            pw = pwd.getpwnam(name)
            (home / ".ssh").mkdir(parents=True)
            ident = tmp / "id"
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(ident)], check=True)
            (home / ".ssh" / "authorized_keys").write_text((tmp / "id.pub").read_text())
            for p in (home, home / ".ssh", home / ".ssh" / "authorized_keys"):
                os.chown(p, pw.pw_uid, pw.pw_gid)
            (home / ".ssh").chmod(0o700)
            rows = [(iv, one(iv, args.rounds, tmp, ident)) for iv in intervals]
        finally:
            subprocess.run(["userdel", name], capture_output=True)
    print(f"fleet_max_gpus_per_user = 1, two hosts, {args.rounds} rounds each")
    print(f"{'interval':>9}  {'floor':>6}  {'window median':>13}  {'window max':>10}  burst: both granted at delay")
    for iv, r in rows:
        w = [x for x in r["window"] if x is not None]
        burst = "  ".join(f"{d}s {b}/{n}" for d, (b, n) in r["burst"].items())
        med = f"{statistics.median(w):.2f}s" if w else "-"
        mx = f"{max(w):.2f}s" if w else "-"
        print(f"{iv:>8}s  {iv:>5}s  {med:>13}  {mx:>10}  {burst}  (no refusal in 20 s: "
              f"{sum(x is None for x in r['window'])})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
