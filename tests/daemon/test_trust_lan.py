"""Trust on a LAN of network namespaces (tests/netns.py, issue 9 findings 1 and 2): a stranger
announces a fake gpusd host and records every request it gets; it must learn nothing it can use.
Skipped (with the reason) without root or ``ip netns``."""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from fakenvml import FakeProcess, make_gpus
from lan_helpers import python_in, secret_file, start_script
from netns import GpuHost, Lan, Node, lan, netns_ok  # noqa: F401

GiB = 2**30


def start_all(hosts: list[GpuHost]) -> None:
    with ThreadPoolExecutor(len(hosts)) as pool:
        list(pool.map(lambda h: h.start(), hosts))


def signed_fleet(lan: Lan, node: Node, url: str, key_file: Path) -> dict[str, Any]:  # noqa: F811
    """GET the fleet view from ``node``, signed with the secret in ``key_file``; with the proof's verdict."""
    return python_in(lan, node, f"""
        import json
        from gpusd.views.sources import FleetSource
        from gpusd.wire.http import fetch_json
        from gpusd.wire.signing import FleetKey, load_secret
        key = FleetKey(load_secret({str(key_file)!r}))
        base, path = {url!r}.split("/api/v1/")
        secure, pin = FleetSource(base, key)._secure_url()   # the daemon's HTTPS port, as gpusd top --url does
        a = fetch_json(secure + "/api/v1/" + path, key, pin=pin)
        clear = fetch_json({url!r}, key)                     # the same, signed, over plain HTTP
        print(json.dumps({{"verified": a.verified, "data": a.data, "url": secure,
                           "clear": {{"verified": clear.verified, "data": clear.data}}}}))
    """)


@pytest.mark.timeout(240)
def test_a_stranger_announcing_a_host_learns_nothing_and_is_shown_unverified(lan: Lan, tmp_path: Path) -> None:  # noqa: F811
    fleet_secret = secrets.token_hex(32)
    key_file = secret_file(tmp_path / "fleet.key", fleet_secret)
    gpus = make_gpus(1)
    gpus[0].processes = [FakeProcess(os.getpid(), 2 * GiB)]  # this test process: "python ... pytest"
    h1 = lan.add_gpu_host("node-1", make_gpus(1), fast=True, args=["--token-file", str(key_file)])
    h2 = lan.add_gpu_host("node-2", gpus, fast=True, args=["--token-file", str(key_file)])
    client = lan.add_node("client")
    evil = lan.add_node("evil")
    seen_by_evil = tmp_path / "evil-requests.jsonl"
    seen_by_canary = tmp_path / "canary-requests.jsonl"
    # the stranger: a fake host at its own address, and a record pointing at 127.0.0.1:4780 with its own path
    start_script(lan, evil, ["serve", evil.ip, str(seen_by_evil), "--loopback-record"])
    # what sits at 127.0.0.1:4780 on node-1 (where finding 2 sent the daemon's token)
    start_script(lan, h1.node, ["canary", "4780", str(seen_by_canary)])
    start_all([h1, h2])
    base = f"http://{h1.ip}:4780/api/v1/fleet"

    # Finding 1: one unauthenticated GET /api/v1/fleet from the stranger starts node-1's fleet client ...
    fetch = f"import urllib.request; urllib.request.urlopen({base!r}, timeout=10).read()"
    r = lan.run(evil, [sys.executable, "-c", fetch])
    assert r.returncode == 0, r.stderr
    # ... which follows every host announced, the stranger's too
    for _ in range(40):
        view = signed_fleet(lan, client, base, key_file)
        names = {h["hostname"]: h for h in view["data"]["hosts"] if h["snapshot"]}
        if {"node-1", "node-2", "evil"} <= set(names):
            break
        time.sleep(0.5)
    assert view["verified"] is True  # node-1 proved it holds the secret to the client
    assert view["url"] == f"https://{h1.ip}:4781"  # over TLS, certificate pinned
    assert {"node-1", "node-2", "evil"} <= set(names), names.keys()
    # the fleet view: node-2 verified, with its owners; the stranger unverified, its "owners" dropped
    assert names["node-2"]["verified"] is True and names["node-1"]["verified"] is True
    assert names["node-2"]["url"] == f"http://{h2.ip}:4780/api/v1"  # the public base (Prometheus, dashboard)
    proc = names["node-2"]["snapshot"]["gpus"][0]["processes"][0]
    assert "pytest" in proc["command"] and proc["user"]
    assert names["evil"]["verified"] is False
    evil_proc = names["evil"]["snapshot"]["gpus"][0]["processes"][0]
    assert evil_proc == {**evil_proc, "user": None, "command": None}
    assert "loop" not in names  # the record pointing at loopback was never followed

    # gpusd list with the secret (from a file): the same verdicts, a marked stranger
    r = lan.gpusd(client, ["list", "--json", "--token-file", str(key_file), "--browse", "6"])
    assert r.returncode == 0, r.stderr
    devices = json.loads(r.stdout)
    verdict = {d["hostname"]: d["verified"] for d in devices}
    assert verdict == {"node-1": True, "node-2": True, "evil": False}
    assert "mallory" not in r.stdout and "pytest" in r.stdout
    table = lan.gpusd(client, ["list", "--token-file", str(key_file), "--browse", "6"]).stdout
    assert next(ln for ln in table.splitlines() if ln.startswith("evil")).endswith("[unverified]")

    # gpusd top --url: the fleet as node-1 sees it, over its HTTPS port, the stranger marked
    r = lan.gpusd(client, ["top", "--once", "--width", "160", "--url", f"http://{h1.ip}:4780",
                           "--token-file", str(key_file)])
    assert r.returncode == 0, r.stderr
    assert "evil  [unverified]" in r.stdout and r.stdout.count("[unverified]") == 1
    # node-2's process with its owner and command; the stranger's with its pid alone
    program = os.path.basename(proc["command"].split()[0])  # python3, or python: as pytest was started
    assert "mallory" not in r.stdout and "pid 666" in r.stdout and f"root {program}" in r.stdout, r.stdout

    # What the stranger got: requests, some signed, none carrying the secret or a bearer header
    requests = [json.loads(ln) for ln in seen_by_evil.read_text().splitlines()]
    signed = [q for q in requests if any(k.lower() == "signature" for k, _ in q["headers"])]
    assert signed, requests  # both node-1's fleet client and gpusd list did sign their requests
    for q in requests:
        assert not any(k.lower() == "authorization" for k, _ in q["headers"]), q
        assert fleet_secret not in json.dumps(q)
        assert q["path"] == "/api/v1/events"  # our fixed path, whatever the TXT record says
    # ... and nothing it can reuse: each captured request replayed to node-1, as captured and
    # with node-1's own Host, is refused
    replays = python_in(lan, evil, f"""
        import http.client, json
        out = []
        for line in open({str(seen_by_evil)!r}):
            q = json.loads(line)
            if not any(k.lower() == "signature" for k, _ in q["headers"]):
                continue
            for host in (None, "{h1.ip}:4780"):
                headers = {{k: v for k, v in q["headers"] if k.lower() not in ("host", "content-length")}}
                headers["Host"] = host or dict((k.lower(), v) for k, v in q["headers"])["host"]
                for path in (q["path"], "/api/v1/gpus"):
                    c = http.client.HTTPConnection("{h1.ip}", 4780, timeout=10)
                    c.request(q["method"], path, headers=headers)
                    r = c.getresponse()
                    out.append(r.status)
                    r.read()
                    c.close()
        print(json.dumps(out))
    """)
    assert replays and set(replays) == {401}, replays

    # Finding 2: nothing ever went to 127.0.0.1:4780 on node-1
    assert not seen_by_canary.exists() or seen_by_canary.read_text() == ""
    # and the daemons logged no traceback for any of it
    for h in (h1, h2):
        assert "Traceback" not in (h.state_dir / "gpusd.log").read_text()


@pytest.mark.timeout(180)
def test_a_reader_without_the_secret_gets_public_data_only(lan: Lan, tmp_path: Path) -> None:  # noqa: F811
    """The daemons of a fleet show each other their owners; a reader without the secret, on another
    machine, gets them as null (and its writes are refused)."""
    key_file = secret_file(tmp_path / "fleet.key", secrets.token_hex(32))
    gpus = make_gpus(1)
    gpus[0].processes = [FakeProcess(os.getpid(), 2 * GiB)]
    h1 = lan.add_gpu_host("node-1", gpus, fast=True, args=["--token-file", str(key_file)])
    client = lan.add_node("client")
    start_all([h1])
    anon = python_in(lan, client, f"""
        import json, urllib.request, urllib.error
        body = urllib.request.urlopen("http://{h1.ip}:4780/api/v1/gpus", timeout=10).read().decode()
        try:
            urllib.request.urlopen(urllib.request.Request("http://{h1.ip}:4780/api/v1/host", data=b"{{}}"), timeout=10)
            status = 200
        except urllib.error.HTTPError as e:
            status = e.code
        print(json.dumps({{"gpus": json.loads(body), "write": status}}))
    """)
    proc = anon["gpus"][0]["processes"][0]
    assert proc["pid"] == os.getpid() and proc["user"] is None and proc["command"] is None
    assert anon["write"] == 401
    mine = signed_fleet(lan, client, f"http://{h1.ip}:4780/api/v1/gpus", key_file)
    assert mine["verified"] is True and "pytest" in mine["data"][0]["processes"][0]["command"]
    # signed but in clear: the daemon proves itself, and keeps private fields for its HTTPS port
    assert mine["clear"]["verified"] is True and mine["clear"]["data"][0]["processes"][0]["command"] is None
    # over TLS, one verified signature authenticates its connection: later reads on it need none,
    # while another connection (someone else's) gets the public view
    conn = python_in(lan, client, f"""
        import http.client, json, ssl
        from gpusd.wire.signing import FleetKey, fingerprint, load_secret
        key = FleetKey(load_secret({str(key_file)!r}))
        ctx = ssl._create_unverified_context()
        def get(c, headers):
            c.request("GET", "/api/v1/gpus", headers=headers)
            r = c.getresponse()
            return r.status, json.loads(r.read())[0]["processes"][0]["command"]
        url = "https://{h1.ip}:4781/api/v1/gpus"
        mine = http.client.HTTPSConnection("{h1.ip}", 4781, context=ctx)
        mine.connect()  # the signature covers the certificate this connection shows
        first = get(mine, key.sign_request("GET", url, cert_fp=fingerprint(mine.sock.getpeercert(True)))[0])
        second = get(mine, {{}})
        other = get(http.client.HTTPSConnection("{h1.ip}", 4781, context=ctx), {{}})
        print(json.dumps([first, second, other]))
    """)
    assert conn[0][0] == conn[1][0] == conn[2][0] == 200
    assert "pytest" in conn[0][1] and "pytest" in conn[1][1] and conn[2][1] is None
    r = lan.gpusd(client, ["list", "--json", "--browse", "6"])
    assert r.returncode == 0 and "pytest" not in r.stdout and str(os.getpid()) in r.stdout
    assert {d["verified"] for d in json.loads(r.stdout)} == {None}  # nothing to verify with
