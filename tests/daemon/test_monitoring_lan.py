"""Monitoring end to end on a LAN of network namespaces (tests/netns.py): real daemons on fake NVML,
readers in another namespace.  Skipped (with the reason) without root or ``ip netns``."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fakenvml import FakeProcess, make_gpus
from netns import GpuHost, Lan, Node, lan, netns_ok  # noqa: F401

GiB = 2**30
TOKEN = "lan-shared-fleet-secret-0123456789"


def token_file(tmp_path: Any) -> str:
    path = tmp_path / "fleet.key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(TOKEN)
    return str(path)


def start_all(hosts: list[GpuHost]) -> None:
    with ThreadPoolExecutor(len(hosts)) as pool:
        list(pool.map(lambda h: h.start(), hosts))


def http(lan: Lan, node: Node,  # noqa: F811 - lan: the netns fixture's name
          url: str, method: str = "GET", token: str | None = None, sse: bool = False) -> Any:
    """One HTTP request made from inside ``node``: {"status", "body"} (for ``sse``: the first event's data),
    signed with ``token`` as the fleet secret when given."""
    code = textwrap.dedent(f"""
        import json, ssl, sys, urllib.request, urllib.error
        from gpusd.wire.signing import FleetKey
        body = b"{{}}" if {method!r} != "GET" else None
        req = urllib.request.Request({url!r}, method={method!r}, data=body)
        node = None
        if {token!r} and {method!r} != "GET":  # a signed write names the daemon's node (docs/security.md)
            from urllib.parse import urlsplit
            from gpusd.wire.http import fetch_json
            parts = urlsplit({url!r})
            node = fetch_json(f"{{parts.scheme}}://{{parts.netloc}}/api/v1/host").data["node_id"]
        cert = None
        if {token!r} and {url!r}.startswith("https:"):  # over TLS the signature covers the daemon's certificate
            from urllib.parse import urlsplit
            from gpusd.wire.signing import fingerprint
            parts = urlsplit({url!r})
            cert = fingerprint(ssl.PEM_cert_to_DER_cert(ssl.get_server_certificate((parts.hostname, parts.port))))
        if {token!r}:
            for k, v in FleetKey({token!r}).sign_request({method!r}, {url!r}, body=body or b"",
                                                         node_id=node, cert_fp=cert)[0].items():
                req.add_header(k, v)
        try:
            # the daemon's self-signed certificate (clients pin it; this test only reads)
            with urllib.request.urlopen(req, timeout=10, context=ssl._create_unverified_context()) as r:
                if {sse!r}:
                    for line in r:
                        if line.startswith(b"data:"):
                            body = line[5:].decode(); break
                else:
                    body = r.read().decode()
                print(json.dumps({{"status": r.status, "body": body}}))
        except urllib.error.HTTPError as e:
            print(json.dumps({{"status": e.code, "body": e.read().decode()}}))
    """)
    r = lan.run(node, [sys.executable, "-c", code], timeout=30)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.timeout(180)
def test_top_export_and_metrics_across_the_lan(lan: Lan) -> None:  # noqa: F811
    h1 = lan.add_gpu_host("node-1", make_gpus(2, util_gpu=20, memory_used=8 * GiB), fast=True)
    h2 = lan.add_gpu_host("node-2", make_gpus(1, model="NVIDIA H100 80GB HBM3", util_gpu=70), fast=True)
    client = lan.add_node("client")
    start_all([h1, h2])

    r = lan.gpusd(client, ["top", "--once", "--browse", "6", "--width", "160"])
    assert r.returncode == 0, r.stderr
    assert "2 hosts, 3 GPUs" in r.stdout and "● node-1" in r.stdout and "● node-2" in r.stdout
    assert "H100 80GB HBM3" in r.stdout and "A100-SXM4-80GB" in r.stdout

    r = lan.gpusd(client, ["export", "prometheus-sd", "--browse", "6"])
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert sorted(t for g in doc for t in g["targets"]) == sorted([f"{h1.ip}:4780", f"{h2.ip}:4780"])
    assert {g["labels"]["__meta_gpusd_hostname"] for g in doc} == {"node-1", "node-2"}

    # what Prometheus would scrape from each target: that host's GPUs, once
    for h, n in ((h1, 2), (h2, 1)):
        m = http(lan, client, f"http://{h.ip}:4780/metrics")
        assert m["status"] == 200
        fams = {f.name: f for f in text_string_to_metric_families(m["body"])}
        util = fams["gpusd_gpu_utilization_ratio"].samples
        assert len(util) == n and {s.labels["host"] for s in util} == {h.hostname}
        assert all(0 <= s.value <= 1 for s in util)


@pytest.mark.timeout(180)
def test_privacy_writes_and_thresholds_across_the_lan(lan: Lan, tmp_path: Any) -> None:  # noqa: F811
    gpus = make_gpus(2, util_gpu=10, temperature=50)
    gpus[0].processes = [FakeProcess(os.getpid(), 3 * GiB)]  # this test process: root, "python ... pytest"
    h1 = lan.add_gpu_host("node-1", gpus, fast=True,
                          args=["--token-file", token_file(tmp_path), "--threshold", "hot: temperature>80",
                                "--interval", "0.5"])
    h2 = lan.add_gpu_host("node-2", make_gpus(1), fast=True)
    client = lan.add_node("client")
    watcher = lan.watch(client, fast=True)
    start_all([h1, h2])
    base = f"http://{h1.ip}:4780"
    tls = f"https://{h1.ip}:4781"  # with a secret the daemon serves HTTPS too: private fields travel there

    # GPU load for anyone; owners and commands only with the token
    anon = json.loads(http(lan, client, f"{base}/api/v1/gpus")["body"])
    proc = anon[0]["processes"][0]
    assert proc["pid"] == os.getpid() and proc["used_memory"] == 3 * GiB
    assert proc["user"] is None and proc["command"] is None
    auth = json.loads(http(lan, client, f"{tls}/api/v1/gpus", token=TOKEN)["body"])
    assert auth[0]["processes"][0]["user"] and "pytest" in auth[0]["processes"][0]["command"]
    assert http(lan, client, f"{base}/api/v1/gpus", token="guess-another-fleet-secret")["status"] == 401
    # the same on the event stream (its first event is the snapshot)
    snap = json.loads(http(lan, client, f"{base}/api/v1/events", sse=True)["body"])
    assert snap["gpus"][0]["processes"][0]["command"] is None
    snap = json.loads(http(lan, client, f"{tls}/api/v1/events", token=TOKEN, sse=True)["body"])
    assert "pytest" in snap["gpus"][0]["processes"][0]["command"]
    host = json.loads(http(lan, client, f"{base}/api/v1/host")["body"])
    host.pop("lease_authority", None)  # the daemon's own setup (why it is not the authority: a socket's path)
    assert "pytest" not in json.dumps(host)  # no process's command

    # no writes without a signature; none at all on a daemon without a secret
    assert http(lan, client, f"{base}/api/v1/host", method="POST")["status"] == 401
    other = "guess-another-fleet-secret"
    assert http(lan, client, f"{base}/api/v1/host", method="DELETE", token=other)["status"] == 401
    assert http(lan, client, f"{base}/api/v1/host", method="POST", token=TOKEN)["status"] == 403  # not in clear
    assert http(lan, client, f"{tls}/api/v1/host", method="POST", token=TOKEN)["status"] == 405  # no such write
    assert http(lan, client, f"http://{h2.ip}:4780/api/v1/host", method="POST", token=TOKEN)["status"] == 405

    # a threshold crossed on node-1 reaches gpusd watch, the log and the alerts endpoint
    watcher.wait_count(lambda e: e["event"] == "device_added", 3, timeout=20)
    mark = watcher.mark()
    h1.gpus[1].temperature = 91
    h1.write()
    ev = watcher.wait_for(lambda e: e["event"] == "threshold_exceeded", timeout=10, start=mark)
    assert ev["hostname"] == "node-1" and ev["data"]["rule"] == "hot" and ev["data"]["value"] == 91
    assert ev["gpu"]["index"] == 1
    alerts = json.loads(http(lan, client, f"{base}/api/v1/alerts")["body"])["alerts"]
    assert [(a["rule"], a["index"]) for a in alerts] == [("hot", 1)]
    h1.gpus[1].temperature = 60
    h1.write()
    ev = watcher.wait_for(lambda e: e["event"] == "threshold_cleared", timeout=10, start=mark)
    assert ev["data"]["rule"] == "hot" and ev["data"]["value"] == 60
    watcher.stop()
    log = (h1.state_dir / "gpusd.log").read_text()
    assert "threshold exceeded: node-1 GPU 1 temperature 91 C > 80 C (hot: temperature>80C)" in log


@pytest.mark.timeout(180)
def test_token_holders_see_owners_of_every_host_in_the_fleet_view(lan: Lan, tmp_path: Any) -> None:  # noqa: F811
    """Daemons sharing a secret show each other (and so the secret holders reading any of them) their
    process owners; everyone else gets them as null, in the fleet view and in `gpusd list`."""
    gpus = make_gpus(1)
    gpus[0].processes = [FakeProcess(os.getpid(), 2 * GiB)]
    key = token_file(tmp_path)
    h1 = lan.add_gpu_host("node-1", make_gpus(1), fast=True, args=["--token-file", key])
    h2 = lan.add_gpu_host("node-2", gpus, fast=True, args=["--token-file", key])
    client = lan.add_node("client")
    start_all([h1, h2])

    def node2_procs(fleet: dict[str, Any]) -> list[dict[str, Any]]:
        return [p for h in fleet["hosts"] if h["hostname"] == "node-2" for p in h["snapshot"]["gpus"][0]["processes"]]

    base = f"https://{h1.ip}:4781/api/v1/fleet"
    for _ in range(30):  # the fleet view starts on first use and needs a moment to hear node-2
        fleet = json.loads(http(lan, client, base, token=TOKEN)["body"])
        if node2_procs(fleet):
            break
    procs = node2_procs(fleet)
    assert procs and procs[0]["pid"] == os.getpid() and "pytest" in procs[0]["command"]
    anon = node2_procs(json.loads(http(lan, client, f"http://{h1.ip}:4780/api/v1/fleet")["body"]))
    assert anon and anon[0]["pid"] == os.getpid() and anon[0]["command"] is None and anon[0]["user"] is None

    r = lan.gpusd(client, ["list", "--json", "--token-file", key])
    assert r.returncode == 0, r.stderr
    assert "pytest" in r.stdout
    r = lan.gpusd(client, ["list", "--json"])
    assert r.returncode == 0 and "pytest" not in r.stdout and str(os.getpid()) in r.stdout


@pytest.mark.timeout(180)
def test_usage_per_user_only_for_a_signed_scraper_across_the_lan(lan: Lan, tmp_path: Any) -> None:  # noqa: F811
    """--user-metrics: a Prometheus on another machine gets GPU-seconds per GPU; per user only when its
    scrape is signed with the fleet secret (over HTTPS), never anonymously."""
    import time

    gpus = make_gpus(2, util_gpu=40)
    gpus[0].processes = [FakeProcess(os.getpid(), GiB)]  # this test process: root
    h1 = lan.add_gpu_host("node-1", gpus, fast=True,
                          args=["--token-file", token_file(tmp_path), "--user-metrics", "--interval", "0.2"])
    client = lan.add_node("client")
    start_all([h1])
    time.sleep(1.5)  # some samples to count

    def series(body: str, name: str) -> dict[tuple[str, ...], float]:
        return {tuple(sorted(s.labels.items())): s.value for f in text_string_to_metric_families(body)
                for s in f.samples if s.name == name}

    anon = http(lan, client, f"http://{h1.ip}:4780/metrics")
    assert anon["status"] == 200
    used = {dict(k)["index"]: v for k, v in series(anon["body"], "gpusd_gpu_used_seconds_total").items()}
    assert used["0"] > 0 and used["1"] == 0
    assert series(anon["body"], "gpusd_user_gpu_seconds_total") == {} and "root" not in anon["body"]
    signed = http(lan, client, f"https://{h1.ip}:4781/metrics", token=TOKEN)
    assert signed["status"] == 200
    per_user = {(dict(k)["user"], dict(k)["kind"]): v
                for k, v in series(signed["body"], "gpusd_user_gpu_seconds_total").items()}
    assert per_user[("root", "used")] > 0 and per_user[("root", "held")] == 0
