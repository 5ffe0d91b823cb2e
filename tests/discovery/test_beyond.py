"""Static peers and wide-area DNS-SD settings (gpusd.discovery.beyond): validated, bounded."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from gpusd.discovery import beyond
from gpusd.discovery.client import AsyncClient
from gpusd.errors import ConfigError


def test_peer_specs_are_validated() -> None:
    assert beyond.parse_peer("198.18.2.1") == beyond.PeerSpec("198.18.2.1", 4780)
    assert beyond.parse_peer("GPU-1.lab.example:4790") == beyond.PeerSpec("gpu-1.lab.example", 4790)
    for bad in ("", "host:0", "host:65536", "host:http", "-bad-.lab", "a b", "[::1]:4780", "::1",
                "0.0.0.0", "224.0.0.251", "999.1.1.1", "x" * 300, "host/../x"):
        with pytest.raises(ConfigError):
            beyond.parse_peer(bad)


def test_peers_are_bounded_and_deduplicated() -> None:
    assert beyond.parse_peers(["h1", "h1:4780", "h2"]) == [beyond.PeerSpec("h1"), beyond.PeerSpec("h2")]
    with pytest.raises(ConfigError, match="at most"):
        beyond.parse_peers([f"198.18.{i // 250}.{i % 250 + 1}" for i in range(beyond.MAX_PEERS + 1)])


def test_peers_file_and_environment(tmp_path: Path) -> None:
    f = tmp_path / "peers"
    f.write_text("# lab servers\n198.18.2.1\n\n  gpu-2.lab:4790  # the big one\n")
    assert beyond.read_peers_file(f) == ["198.18.2.1", "gpu-2.lab:4790"]
    assert beyond.read_peers_file(tmp_path / "missing") == []
    f.write_bytes(b"h\n" * beyond.MAX_PEERS_FILE)
    with pytest.raises(ConfigError, match="larger"):
        beyond.read_peers_file(f)
    assert beyond.peers_from_env({"GPUSD_PEERS": " h1 , h2:4790,,"}) == ["h1", "h2:4790"]


def test_dns_sd_domain_and_server_are_validated() -> None:
    assert beyond.valid_domain("Lab.Example.") == "lab.example."
    for bad in ("local", "gpus.local", "bad domain", ""):
        with pytest.raises(ConfigError):
            beyond.valid_domain(bad)
    with pytest.raises(ConfigError):
        beyond.valid_dns_server("dns.lab")


def test_the_client_refuses_bad_settings_in_the_caller() -> None:
    with pytest.raises(ConfigError):
        AsyncClient(peers=["host:99999"], interfaces=["127.0.0.1"])
    with pytest.raises(ConfigError):
        AsyncClient(dns_sd_domain="local", interfaces=["127.0.0.1"])
    from gpusd.discovery import Client

    with pytest.raises(ConfigError):
        Client(peers=["198.18.2.1", "bad host"], interfaces=["127.0.0.1"])
    c = AsyncClient(peers=["198.18.2.1"], dns_sd_domain="lab.example", interfaces=["127.0.0.1"])
    assert c.peer_specs == [beyond.PeerSpec("198.18.2.1")] and c.dns_sd_domain == "lab.example."


def test_zone_records_publish_hosts_that_a_browser_reads_back() -> None:
    import dns.zone

    from gpusd.discovery.types import RemoteHost
    from gpusd.wire.txt import decode_txt, encode_txt

    def host(name: str, node: str, address: str) -> RemoteHost:
        txt = decode_txt(encode_txt(node_id=node, hostname=name, session="lab", inventory=[("A100", 81920)],
                                    free=1))
        return RemoteHost(key=name, txt=txt, addresses=[address, "fe80::1"], port=4780)

    hostile = 'evil" IN A 6.6.6.6 ; \\ $INCLUDE /etc/shadow'  # what the TXT codec lets through
    lines = beyond.zone_records([host("node-b", "7b676f27867c74e8", "198.18.2.1"),
                                 host(hostile, "e71100000000beef", "198.18.2.9")], "lab.example", ttl=60)
    soa = "lab.example. 60 IN SOA ns.lab.example. admin.lab.example. 1 60 60 60 60"  # what the lab's zone has
    ns = "lab.example. 60 IN NS ns.lab.example."
    zone = dns.zone.from_text("\n".join([soa, ns, *lines]) + "\n", origin="lab.example.", relativize=False)
    ptrs = sorted(r.target.to_text() for r in zone.find_rdataset("_gpusd._tcp.lab.example.", "PTR"))
    assert ptrs == ["evil-in-a-6-6-6-6-include-etc-shadow-e7110000._gpusd._tcp.lab.example.",
                    "node-b-7b676f27._gpusd._tcp.lab.example."]
    for ptr in ptrs:
        srv = next(iter(zone.find_rdataset(ptr, "SRV")))
        raw = b"".join(bytes([len(s)]) + s for r in zone.find_rdataset(ptr, "TXT") for s in r.strings)
        txt = decode_txt(raw)
        a = [r.address for r in zone.find_rdataset(srv.target, "A")]
        assert srv.port == 4780 and txt.session == "lab" and a[0].startswith("198.18.2.")
    # the hostile name stays inside one TXT string: no record of its own
    hosts = [decode_txt(b"".join(bytes([len(s)]) + s for r in zone.find_rdataset(p, "TXT") for s in r.strings)).hostname
             for p in ptrs]
    assert hosts == [hostile, "node-b"]
    addresses = [r.address for name in zone.nodes for r in (zone.get_rdataset(name, "A") or ())]
    assert sorted(addresses) == ["198.18.2.1", "198.18.2.9"]


@pytest.fixture
def dns_server(tmp_path: Path) -> Any:
    """dnsmasq on 127.0.0.1 (a free port, never 53 or 5353), serving the records a test gives."""
    import shutil
    import socket
    import subprocess

    if shutil.which("dnsmasq") is None:
        pytest.skip("dnsmasq is not installed (apt-get install dnsmasq-base)")
    procs: list[subprocess.Popen[bytes]] = []

    def start(records: list[str]) -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        pid_file = tmp_path / f"dnsmasq-{port}.pid"
        p = subprocess.Popen(["dnsmasq", "-k", "-C", "/dev/null", "--no-resolv", "--no-hosts", "--bind-interfaces",
                              "--listen-address=127.0.0.1", f"--port={port}", f"--pid-file={pid_file}",
                              "--user=root", *records], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(p)
        for _ in range(50):
            if pid_file.exists() and pid_file.read_text().strip():
                break
            time.sleep(0.1)
        return port

    yield start
    for p in procs:
        if p.poll() is None:
            p.terminate()
        p.wait(10)


async def test_browse_reads_the_zone_and_skips_bad_records(dns_server: Any) -> None:
    from gpusd.wire.txt import encode_txt

    good = encode_txt(node_id="7b676f27867c74e8", hostname="node-b", session="lab", inventory=[], free=0)
    z = "_gpusd._tcp.lab.example"
    port = dns_server([
        f"--ptr-record={z},node-b.{z}", f"--ptr-record={z},bad.{z}", f"--ptr-record={z},nosrv.{z}",
        f"--ptr-record={z},elsewhere.other.example",  # not under the service: ignored
        f"--srv-host=node-b.{z},node-b.lab.example,4780", f"--srv-host=bad.{z},bad.lab.example,4780",
        f"--txt-record=node-b.{z}," + ",".join(f"{k}={v}" for k, v in good.items()),
        f"--txt-record=bad.{z},v=1,id=no spaces allowed,host=x,n=0",
        "--host-record=node-b.lab.example,198.18.2.1", "--host-record=bad.lab.example,198.18.2.2",
        "--local=/example/",  # answered here: NXDOMAIN for the rest, not REFUSED
    ])
    browse = await beyond.browse_dns_sd("lab.example.", "127.0.0.1", port)
    assert browse.complete
    assert [(i.name, i.port, i.addresses, i.txt.node_id, i.txt.session) for i in browse.found] == [
        (f"node-b.{z}.", 4780, ["198.18.2.1"], "7b676f27867c74e8", "lab")]
    assert any(p.startswith(f"bad.{z}.") and "node id" in p for p in browse.problems), browse.problems
    assert any(p.startswith(f"nosrv.{z}.") for p in browse.problems), browse.problems
    assert beyond.DNS_SD_MIN_INTERVAL <= browse.ttl <= beyond.DNS_SD_INTERVAL
    # a domain with no gpusd service: nothing, and complete (hosts listed before are gone)
    empty = await beyond.browse_dns_sd("nothing.example.", "127.0.0.1", port)
    assert empty.found == [] and empty.complete
    # a server that refuses (no answer): incomplete, so the caller drops nothing
    refused = await beyond.browse_dns_sd("lab.other.", "127.0.0.1", port)
    assert refused.found == [] and not refused.complete


async def test_a_dns_server_that_does_not_answer_drops_no_host(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpusd.wire.txt import decode_txt, encode_txt

    session = f"beyond-{os.getpid()}"  # hermetic: a gpusd daemon announcing on 127.0.0.1 is not in this session
    txt = decode_txt(encode_txt(node_id="7b676f27867c74e8", hostname="node-b", session=session, inventory=[],
                                free=0))
    name = "node-b._gpusd._tcp.lab.example."
    inst = beyond.DnsSdInstance(name, "node-b.lab.example.", 1, txt, ["127.0.0.1"], 60.0)  # port 1: refused
    answers = [beyond.Browse([inst], 0.05, [], set()),
               beyond.Browse([], 0.05, ["timeout"], set(), complete=False),  # the server is down
               beyond.Browse([], 0.05, [], set())]  # the zone no longer lists it
    seen: list[list[str]] = []
    done = asyncio.Event()

    async def fake_browse(domain: str, server: str | None = None, port: int = 53) -> beyond.Browse:
        if len(seen) < len(answers) + 1:
            seen.append([h.hostname for h in client.announced()])
        if len(seen) > len(answers):
            done.set()
            return beyond.Browse([], 10.0, [], set(), complete=False)
        return answers[len(seen) - 1]

    monkeypatch.setattr(beyond, "browse_dns_sd", fake_browse)
    client = AsyncClient(session, dns_sd_domain="lab.example", interfaces=["127.0.0.1"])
    async with client:
        await asyncio.wait_for(done.wait(), 10)
    # before each browse: nothing yet; found; kept while the server was down; gone once the zone dropped it
    assert seen == [[], ["node-b"], ["node-b"], []]


async def test_a_peer_is_read_through_the_txt_codec_and_bounded() -> None:
    import aiohttp
    from aiohttp import web

    answers: dict[str, Any] = {}

    async def handler(request: web.Request) -> web.StreamResponse:
        body = answers[request.path]
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        return web.Response(body=raw, content_type="application/json")

    app = web.Application()
    app.router.add_get("/{tail:.*}", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    node = "7b676f27867c74e8"
    try:
        async with aiohttp.ClientSession() as http:
            answers["/healthz"] = {"ok": True, "node_id": node}
            answers["/api/v1/host"] = {"node_id": node, "hostname": "node-b", "session": "lab",
                                       "snapshot": {"gpus": [{}, {}]}}
            txt = await beyond.peer_txt(http, "127.0.0.1", port)
            assert (txt.node_id, txt.hostname, txt.session, txt.count, txt.tls_port) == (node, "node-b", "lab", 2, None)
            bad = [
                {"node_id": "not a node id!", "hostname": "x", "session": "lab"},  # the codec refuses it
                {"node_id": node, "hostname": "x", "session": "bad session"},
                {"node_id": "0" * 16, "hostname": "x", "session": "lab"},  # /healthz names another node
                b"[" * 300_000,  # larger than the bound
                b"not json",
            ]
            for answer in bad:
                answers["/api/v1/host"] = answer
                with pytest.raises(ValueError):
                    await beyond.peer_txt(http, "127.0.0.1", port)
    finally:
        await runner.cleanup()
