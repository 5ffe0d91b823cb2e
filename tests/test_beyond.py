"""Static peers and wide-area DNS-SD settings (gpusd.discovery.beyond): validated, bounded."""

from __future__ import annotations

from pathlib import Path

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
