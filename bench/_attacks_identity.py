"""Issue 39's identity and request attacks (rows 1, 2, 3, 5, 12), for ``bench/bench_attacks.py --identity``.

Each code version (this tree, and ``--old REV``) is attacked by its own code: a child Python with
``PYTHONPATH`` at that version's ``src/`` runs the client and the daemon side, and reports what the
attacker got.  Rows 1, 2, 3 and 5 run in process (the daemon's access rules and account directory,
an in-process clock seam for row 3); row 12 starts two real daemons on 127.0.0.1 (simulated GPUs,
their own state and lock directories, a policy file with ``fleet_max_gpus_per_user`` 2) and bursts a
``count 2`` lease request to both at once, then renews for a bounded time.  Row 12 needs root (the
users file mapping the bench's key must be root's); elsewhere it is skipped with the reason.  Nothing
leaves 127.0.0.1; every daemon is stopped and every temporary directory removed.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

IN_PROCESS = r"""
import inspect, json, os, sys, tempfile, time
from pathlib import Path
from types import SimpleNamespace
from gpusd.daemon.access import Access
from gpusd.daemon import users as U
from gpusd.wire.signing import FleetKey
from gpusd.wire import sshsig

TOKEN = "bench-attacks-identity-0123456789"
key = FleetKey(TOKEN)
out = {}
sign_params = inspect.signature(key.sign_request).parameters

def sign(method, url, **kw):
    kw = {k: v for k, v in kw.items() if k in sign_params}
    return key.sign_request(method, url, **kw)[0]

# row 1: bob lists alice's public key in his own authorized_keys; alice signs a write
tmp = Path(tempfile.mkdtemp(prefix="gpusd-bench-id-"))
import atexit, shutil
atexit.register(shutil.rmtree, tmp, True)  # removed however the attacks end
subprocess_keygen = __import__("subprocess").run
subprocess_keygen(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp / "key-alice")], check=True)
alice = sshsig.FileSigner.load(str(tmp / "key-alice"))
alice.account = "alice"
pub = (tmp / "key-alice.pub").read_text().strip()
accts = []
for name in ("alice", "bob"):
    home = tmp / name
    (home / ".ssh").mkdir(parents=True, mode=0o700)
    home.chmod(0o755)
    (home / ".ssh" / "authorized_keys").write_text(pub + "\n")
    (home / ".ssh" / "authorized_keys").chmod(0o600)
    accts.append(SimpleNamespace(pw_name=name, pw_dir=str(home), pw_uid=os.geteuid()))
d = U.Directory(str(tmp / "no-users-file"), accounts=lambda: accts)
a = Access(TOKEN, own_addresses=lambda: ["127.0.0.1"], own_ports=lambda: [4780], node_id=lambda: "n1")
url = "http://127.0.0.1:4780/api/v1/leases"
h = sign("POST", url, body=b"{}", node_id="n1", user=alice)
req, why = a.verify("POST", "http", "127.0.0.1:4780", "/api/v1/leases", h, b"{}", remote="127.0.0.1")
blob = sshsig.verify(sshsig.read_header(h[sshsig.HEADER]), req.base)
named = req.result.covered_components.get('"gpusd-user"')
try:
    who = d.who(blob, "127.0.0.1", "bench", **({"account": named} if named else {}))
    out["39.1"] = f"alice's write attributed to {who.name}"
except U.Refused as exc:
    out["39.1"] = f"alice locked out: {str(exc)[:60]}..."

# row 2: a relay (its own certificate pinned by the client) replays a signed read on its own TLS connection
daemon_fp, relay_fp = "D" * 43, "R" * 43
a = Access(TOKEN, own_addresses=lambda: ["127.0.0.1"], own_ports=lambda: [4781], node_id=lambda: "n1",
           cert_fp=lambda: daemon_fp)
tls = "https://127.0.0.1:4781/api/v1/leases"
h = sign("GET", tls, node_id="n1", cert_fp=relay_fp)
req, why = a.verify("GET", "https", "127.0.0.1:4781", "/api/v1/leases", h, b"", remote="127.0.0.1")
out["39.2"] = ("relayed request verified: private answer, the relay's connection made a session" if req is not None
               else f"refused: {why[:70]}")

# row 3: the daemon's wall clock steps back 45 s; the captured write is replayed 63 s after it was accepted
real_time, real_mono = time.time, time.monotonic
clock = {"wall": real_time(), "mono": real_mono()}
time.time, time.monotonic = (lambda: clock["wall"]), (lambda: clock["mono"])
try:
    a = Access(TOKEN, own_addresses=lambda: ["127.0.0.1"], own_ports=lambda: [4780], node_id=lambda: "n1")
    h = sign("POST", url, body=b"{}", node_id="n1")
    first = a.verify("POST", "http", "127.0.0.1:4780", "/api/v1/leases", h, b"{}", remote="127.0.0.1")[0]
    clock["wall"] -= 45
    clock["wall"] += 63
    clock["mono"] += 63
    again, why = a.verify("POST", "http", "127.0.0.1:4780", "/api/v1/leases", h, b"{}", remote="127.0.0.1")
finally:
    time.time, time.monotonic = real_time, real_mono
out["39.3"] = ("replay accepted (a second lease)" if first is not None and again is not None
               else f"replay refused: {why[:70]}")

# row 5: lines sshd refuses, and an expiry-time in UTC
k = pub.split()[0] + " " + pub.split()[1]
lines = [f'from="10.0.0.0/8",from="127.0.0.1" {k}', f'frm="127.0.0.1" {k}', f'from=127.0.0.1 {k}']
taken = sum(1 for ln in lines if U.parse_line(ln) is not None)
matched = U.from_allows("127.0.0.[0-9]", "127.0.0.1")
soon = time.strftime("%Y%m%d%H%M%SZ", time.gmtime(time.time() + 3600))
e = U.parse_line(f'expiry-time="{soon}" {k}')
utc_ok = e is not None and U.why_not(e, "127.0.0.1") is None
out["39.5"] = (f"{taken} of 3 refused lines taken; [0-9] matched as a class: {matched}; "
               f"expiry-time ...Z an hour ahead accepted: {utc_ok}")
print(json.dumps(out))
"""

BURST = r"""
import http.client, json, ssl, sys, threading, time, inspect
from urllib.parse import urlsplit
from gpusd.wire.http import fetch_json, request_json
from gpusd.wire.signing import FleetKey, fingerprint, load_secret
from gpusd.wire.sshsig import FileSigner
key = FleetKey(load_secret(sys.argv[1]))
signer = FileSigner.load(sys.argv[2])
urls, seconds = json.loads(sys.argv[3]), float(sys.argv[4])
payload = json.dumps({"count": 2, "holder": "bench", "ttl": 6}).encode()
bind = "cert_fp" in inspect.signature(key.sign_request).parameters
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
ready, nodes = [], []
for u in urls:
    parts = urlsplit(u)
    node = fetch_json(f"{parts.scheme}://{parts.netloc}/api/v1/host").data["node_id"]
    nodes.append(node)
    conn = http.client.HTTPSConnection(parts.hostname, parts.port, context=ctx, timeout=30)
    conn.connect()
    kw = {"cert_fp": fingerprint(conn.sock.getpeercert(binary_form=True))} if bind else {}
    headers, _ = key.sign_request("POST", u, body=payload, node_id=node, user=signer, **kw)
    ready.append((conn, parts.path, {**headers, "Host": parts.netloc, "Content-Type": "application/json"}))
go, got = threading.Barrier(len(urls)), [None] * len(urls)
def one(i):
    conn, path, headers = ready[i]
    go.wait()
    conn.request("POST", path, body=payload, headers=headers)
    r = conn.getresponse()
    got[i] = (r.status, json.loads(r.read()))
threads = [threading.Thread(target=one, args=(i,)) for i in range(len(urls))]
for t in threads: t.start()
for t in threads: t.join()
held = {i: d["lease_id"] for i, (s, d) in enumerate(got) if s == 201}
won = sum(len(got[i][1]["devices"]) for i in held)
refusals, end = [], time.monotonic() + seconds
while time.monotonic() < end and held:
    for i, lease in list(held.items()):
        r = request_json("POST", f"{urls[i]}/{lease}/renew", {"ttl": 6}, key=key, node_id=nodes[i], user=signer)
        if r.status != 200:
            refusals.append(f"{r.status} {str(r.data.get('reason'))}")
            del held[i]
    time.sleep(2)
kept = sum(len(got[i][1]["devices"]) for i in held)
for i, lease in held.items():
    request_json("DELETE", f"{urls[i]}/{lease}", key=key, node_id=nodes[i], user=signer)
print(json.dumps({"statuses": [s for s, _ in got], "won": won, "kept": kept, "refusals": refusals}))
"""


def _run(src: Path, code: str, args: list[str], env: dict[str, str] | None = None, timeout: float = 120) -> Any:
    r = subprocess.run([sys.executable, "-c", code, *args], env={**os.environ, **(env or {}), "PYTHONPATH": str(src)},
                       capture_output=True, text=True, timeout=timeout, check=False)
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["failed"])[-1][:200]}
    return json.loads(r.stdout)


def _start(src: Path, state: Path, env: dict[str, str], session: str, name: str) -> dict[str, Any]:
    r = subprocess.run([sys.executable, "-m", "gpusd", "start", "--simulate", "2xA100-80GB", "--interface", "127.0.0.1",
                        "--port", "0", "--tls-port", "0", "--session", session, "--hostname", name, "--interval",
                        "0.2", "--fleet-view", "on"],
                       env={**env, "GPUSD_STATE_DIR": str(state)}, capture_output=True, text=True, timeout=60,
                       check=False)
    if r.returncode != 0:
        raise RuntimeError(f"the daemon did not start: {r.stderr.strip()[-200:]}")
    return dict(json.loads((state / "gpusd.json").read_text()))


def _stop(src: Path, state: Path, env: dict[str, str], pid: int) -> None:
    subprocess.run([sys.executable, "-m", "gpusd", "stop", "--force", "--timeout", "10"],
                   env={**env, "GPUSD_STATE_DIR": str(state)}, capture_output=True, timeout=60, check=False)
    try:
        os.kill(pid, 0)
        os.kill(pid, 9)
    except ProcessLookupError:
        pass


def burst(src: Path, seconds: float) -> str:
    """Row 12 on two loopback daemons of ``src``: what the burst won and what renewing kept."""
    if os.geteuid() != 0:
        return "skipped: needs root (the users file mapping the bench's key must be root's)"
    tmp = Path(tempfile.mkdtemp(prefix="gpusd-bench-burst-"))
    started: list[tuple[Path, int]] = []
    try:
        secret = tmp / "fleet.key"
        secret.write_text(secrets.token_hex(32))
        secret.chmod(0o600)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp / "user")], check=True)
        users = tmp / "users"
        users.write_text("benchuser " + (tmp / "user.pub").read_text())
        users.chmod(0o644)
        policy = tmp / "policy.json"
        policy.write_text(json.dumps({"fleet_max_gpus_per_user": 2}))
        policy.chmod(0o644)
        session = f"burst-{secrets.token_hex(3)}"
        base = {**os.environ, "PYTHONPATH": str(src), "GPUSD_INTERFACES": "127.0.0.1", "GPUSD_MDNS_FAST": "1",
                "GPUSD_TOKEN_FILE": str(secret), "GPUSD_USERS": str(users), "GPUSD_POLICY": str(policy),
                "GPUSD_ACCOUNT": "benchuser", "GPUSD_LEASE_SOCKET": "off"}
        base.pop("GPUSD_TOKEN", None)
        urls = []
        for name in ("burst-1", "burst-2"):
            state = tmp / name
            state.mkdir(mode=0o700)
            env = {**base, "GPUSD_LOCK_DIR": str(tmp / f"{name}-locks")}
            info = _start(src, state, env, session, name)
            started.append((state, int(info["pid"])))
            urls.append(f"https://127.0.0.1:{info['tls_port']}/api/v1/leases")
        time.sleep(4.0)  # the fleet views find each other (mDNS on loopback) and follow
        got = _run(src, BURST, [str(secret), str(tmp / "user"), json.dumps(urls), str(seconds)], base,
                   timeout=seconds + 60)
        if "error" in got:
            return f"error: {got['error']}"
        return (f"burst answers {got['statuses']}: {got['won']} GPUs won; after {seconds:g} s of renewing "
                f"{got['kept']} kept (renewals refused: {', '.join(got['refusals']) or 'none'})")
    finally:
        for state, pid in started:
            _stop(src, state, {**os.environ, "PYTHONPATH": str(src)}, pid)
        shutil.rmtree(tmp, ignore_errors=True)


def report(versions: list[tuple[str, Path]], seconds: float) -> list[str]:
    """Markdown rows: ``| code | row | what the attacker got |``."""
    rows = []
    for label, src in versions:
        got = _run(src, IN_PROCESS, [])
        if "error" in got:
            rows.append(f"| {label} | 39.1-39.5 | error: {got['error']} |")
        else:
            rows += [f"| {label} | {row} | {text} |" for row, text in sorted(got.items())]
        rows.append(f"| {label} | 39.12 | {burst(src, seconds)} |")
    return rows
