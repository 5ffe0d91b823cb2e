"""Beyond one link (issue 10, item 4): two namespace LANs joined only by a routed namespace
(tests/netns.py ``join``); mDNS does not cross the router, so a daemon on LAN B is part of LAN A's pool
only through ``--peer`` or a wide-area DNS-SD zone (served by dnsmasq, started here).  Verified with
the fleet secret; a stranger added as a peer is shown unverified and gets nothing reusable.
Skipped (with the reason) without root, ``ip netns`` or dnsmasq."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from fakenvml import FakeProcess, make_gpus
from lan_helpers import python_in, secret_file, signed_fleet, start_script
from netns import Lan, lans, netns_ok  # noqa: F401

GiB = 2**30


def list_json(lan: Lan, node: Any, args: list[str]) -> list[dict[str, Any]]:
    r = lan.gpusd(node, ["list", "--json", "--browse", "8", *args])
    assert r.returncode in (0, 3), r.stderr  # 3: no host found
    return json.loads(r.stdout) if r.stdout.strip() else []


def fleet_until(lan: Lan, node: Any, url: str, key_file: Path, names: set[str]) -> dict[str, dict[str, Any]]:
    hosts: dict[str, dict[str, Any]] = {}
    for _ in range(40):
        view = signed_fleet(lan, node, url, key_file)
        hosts = {h["hostname"]: h for h in view["data"]["hosts"] if h["snapshot"]}
        if names <= set(hosts):
            break
        time.sleep(0.5)
    return hosts


@pytest.mark.timeout(300)
def test_a_host_behind_a_router_joins_the_pool_through_peer(lans: tuple[Lan, Lan], tmp_path: Path) -> None:
    a, b = lans
    fleet_secret = secrets.token_hex(32)
    key = secret_file(tmp_path / "fleet.key", fleet_secret)
    gpus = make_gpus(1)
    gpus[0].processes = [FakeProcess(os.getpid(), 2 * GiB)]
    hb = b.add_gpu_host("node-b", gpus, fast=True, args=["--token-file", str(key)])
    evil = b.add_node("evil")
    seen_by_evil = tmp_path / "evil-requests.jsonl"
    start_script(b, evil, ["serve", evil.ip, str(seen_by_evil)])
    hb.start()
    peers = ["--peer", f"{hb.ip}:4780", "--peer", evil.ip]
    ha = a.add_gpu_host("node-a", make_gpus(1), fast=True, args=["--token-file", str(key), *peers])
    ha.start()
    client = a.add_node("client")

    # mDNS stays on its link: without the peers, LAN A sees only node-a
    names = {d["hostname"] for d in list_json(a, client, ["--token-file", str(key)])}
    assert names == {"node-a"}
    # with them: node-b verified (its process owner shown), the stranger unverified and without owners
    devices = list_json(a, client, ["--token-file", str(key), *peers])
    verdict = {d["hostname"]: (d["verified"], d["via"]) for d in devices}
    assert verdict == {"node-a": (True, "mdns"), "node-b": (True, "peer"), "evil": (False, "peer")}
    assert "mallory" not in json.dumps(devices) and "pytest" in json.dumps(devices)
    # the same through $GPUSD_PEERS
    env = a.base_env(client, GPUSD_PEERS=f"{hb.ip}:4780")
    r = a.gpusd(client, ["list", "--json", "--browse", "8", "--token-file", str(key)], env=env)
    assert {d["hostname"] for d in json.loads(r.stdout)} == {"node-a", "node-b"}, r.stderr

    # gpusd top with the peers: node-b's GPU and its process owner, the stranger marked
    r = a.gpusd(client, ["top", "--once", "--width", "160", "--token-file", str(key), *peers])
    assert r.returncode == 0, r.stderr
    assert "node-b" in r.stdout and "evil  [unverified]" in r.stdout and "mallory" not in r.stdout, r.stdout

    # on LAN B node-b is announced too: found both ways, it is listed once
    cb = b.add_node("client-b")
    on_b = list_json(b, cb, ["--token-file", str(key), "--peer", hb.ip])
    assert [(d["hostname"], d["verified"]) for d in on_b if d["hostname"] == "node-b"] == [("node-b", True)]

    # node-a's fleet view (the daemon told --peer): node-b via peer, verified; the stranger not
    hosts = fleet_until(a, client, f"http://{ha.ip}:4780/api/v1/fleet", key, {"node-a", "node-b", "evil"})
    assert hosts["node-b"]["via"] == "peer" and hosts["node-b"]["verified"] is True
    assert hosts["node-a"]["via"] == "mdns"
    assert hosts["evil"]["verified"] is False
    assert hosts["evil"]["snapshot"]["gpus"][0]["processes"][0]["user"] is None

    # Prometheus http_sd from node-a: the verified hosts' metric targets, public labels only
    sd = python_in(a, client, f"""
        import json, urllib.request
        with urllib.request.urlopen("http://{ha.ip}:4780/api/v1/prometheus/http_sd", timeout=10) as r:
            print(json.dumps({{"type": r.headers["Content-Type"], "body": json.loads(r.read())}}))
    """)
    assert sd["type"].startswith("application/json")
    groups = {g["targets"][0]: g["labels"] for g in sd["body"]}
    assert set(groups) == {f"{ha.ip}:4780", f"{hb.ip}:4780"}  # the stranger is not a target
    assert groups[f"{hb.ip}:4780"] == {
        "__meta_gpusd_hostname": "node-b", "__meta_gpusd_node_id": hosts["node-b"]["node_id"],
        "__meta_gpusd_session": "default", "__meta_gpusd_verified": "true", "__meta_gpusd_via": "peer"}
    for g in sd["body"]:
        assert set(g) == {"targets", "labels"} and all(isinstance(v, str) for v in g["labels"].values())

    # what the stranger got: signed requests, never the secret nor a bearer header
    requests = [json.loads(ln) for ln in seen_by_evil.read_text().splitlines()]
    assert any(q["path"] == "/api/v1/events" for q in requests)
    for q in requests:
        assert not any(k.lower() == "authorization" for k, _ in q["headers"]), q
        assert fleet_secret not in json.dumps(q)
    # ... and nothing reusable: a captured signed request replayed to node-b is refused
    signed = [q for q in requests if any(k.lower() == "signature" for k, _ in q["headers"])]
    assert signed
    q = signed[-1]
    req = urllib.request.Request(f"http://{hb.ip}:4780{q['path']}",
                                 headers={k: v for k, v in q["headers"] if k.lower() != "host"})
    replay = python_in(b, evil, f"""
        import json, urllib.request, urllib.error
        req = urllib.request.Request({req.full_url!r}, headers={dict(req.header_items())!r})
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                print(json.dumps({{"status": r.status, "body": r.read(4096).decode(errors="replace")}}))
        except urllib.error.HTTPError as e:
            print(json.dumps({{"status": e.code, "body": ""}}))
    """)
    assert replay["status"] == 401 or "pytest" not in replay["body"], replay


def dnsmasq(lan: Lan, node: Any, tmp: Path, records: list[str]) -> subprocess.Popen[bytes]:
    pid_file = tmp / "dnsmasq.pid"
    argv = [shutil.which("dnsmasq") or "dnsmasq", "-k", "-C", "/dev/null", "--no-resolv", "--no-hosts",
            f"--listen-address={node.ip}", "--bind-interfaces", "--port=53", f"--pid-file={pid_file}",
            "--user=root", "--log-facility=-", *records]
    p = lan.popen(node, argv, env=lan.base_env(node), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    for _ in range(50):
        if pid_file.exists() and pid_file.read_text().strip():
            return p
        if p.poll() is not None:
            raise AssertionError(f"dnsmasq did not start: {p.stderr.read() if p.stderr else b''!r}")
        time.sleep(0.1)
    return p


def dnsmasq_records(zone_lines: str) -> list[str]:
    """dnsmasq options serving the records of a zone file's lines (PTR, SRV, TXT, A)."""
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
            strings = [s.decode() for s in rd.strings]
            assert not any("," in s for s in strings), strings  # dnsmasq separates strings by commas
            out.append(f"--txt-record={name}," + ",".join(strings))
        elif rtype == "A":
            out.append(f"--host-record={name},{rd.address}")
    return out


@pytest.mark.timeout(300)
def test_a_host_behind_a_router_joins_the_pool_through_wide_area_dns_sd(lans: tuple[Lan, Lan],
                                                                         tmp_path: Path) -> None:
    if shutil.which("dnsmasq") is None:
        pytest.skip("dnsmasq is not installed (apt-get install dnsmasq-base)")
    a, b = lans
    key = secret_file(tmp_path / "fleet.key", secrets.token_hex(32))
    hb = b.add_gpu_host("node-b", make_gpus(2), fast=True, args=["--token-file", str(key)])
    hb.start()
    dns = a.add_node("dns")
    client = a.add_node("client")
    # the lab publishes node-b: `gpusd export dns-sd-zone` (node-b reached as a peer) prints the records,
    # which dnsmasq serves
    r = a.gpusd(client, ["export", "dns-sd-zone", "--domain", "lab.example", "--peer", hb.ip, "--browse", "4"])
    assert r.returncode == 0, r.stderr
    server = dnsmasq(a, dns, tmp_path, dnsmasq_records(r.stdout))
    try:
        ha = a.add_gpu_host("node-a", make_gpus(1), fast=True,
                            args=["--token-file", str(key), "--dns-sd-domain", "lab.example", "--dns-server", dns.ip])
        ha.start()
        wide = ["--dns-sd-domain", "lab.example", "--dns-server", dns.ip]
        assert {d["hostname"] for d in list_json(a, client, ["--token-file", str(key)])} == {"node-a"}
        devices = list_json(a, client, ["--token-file", str(key), *wide])
        assert sorted((d["hostname"], d["verified"], d["via"]) for d in devices) == [
            ("node-a", True, "mdns"), ("node-b", True, "dns-sd"), ("node-b", True, "dns-sd")]
        hosts = fleet_until(a, client, f"http://{ha.ip}:4780/api/v1/fleet", key, {"node-a", "node-b"})
        assert hosts["node-b"]["via"] == "dns-sd" and hosts["node-b"]["verified"] is True
        assert hosts["node-b"]["url"] == f"http://{hb.ip}:4780/api/v1"
    finally:
        pid = int((tmp_path / "dnsmasq.pid").read_text().strip() or 0)
        if pid == server.pid and server.poll() is None:
            os.kill(pid, signal.SIGTERM)
        server.wait(10)


@pytest.mark.timeout(300)
def test_a_dead_peer_is_retried_and_the_peers_file_is_followed_as_it_changes(lans: tuple[Lan, Lan],
                                                                              tmp_path: Path) -> None:
    a, b = lans
    key = secret_file(tmp_path / "fleet.key", secrets.token_hex(32))
    hb = b.add_gpu_host("node-b", make_gpus(1), fast=True, args=["--token-file", str(key)])
    client = a.add_node("client")
    peers_file = tmp_path / "peers"
    peers_file.write_text(f"# LAN B\n{hb.ip}:4780\n")
    watch = a.watch(client, ["--peers-file", str(peers_file), "--token-file", str(key)])
    try:
        # the peer is down at first: retried with back-off, found once it is up
        time.sleep(3)
        assert not any(e.get("hostname") == "node-b" for e in watch.events)
        hb.start()
        added = watch.wait_for(lambda e: e["event"] == "host_added" and e["hostname"] == "node-b", 40)
        assert added["via"] == "peer" and added["verified"] is True
        # the file no longer lists it: removed; listed again: back
        tmp = tmp_path / "peers.new"
        mark = watch.mark()
        tmp.write_text("# nobody\n")
        os.replace(tmp, peers_file)
        removed = watch.wait_for(lambda e: e["event"] == "host_removed" and e["hostname"] == "node-b", 30, mark)
        assert removed["data"]["reason"] == "no longer in the peers file"
        mark = watch.mark()
        tmp.write_text(f"{hb.ip}\n")
        os.replace(tmp, peers_file)
        watch.wait_for(lambda e: e["event"] == "host_added" and e["hostname"] == "node-b", 30, mark)
    finally:
        watch.stop()
