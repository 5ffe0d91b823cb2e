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
