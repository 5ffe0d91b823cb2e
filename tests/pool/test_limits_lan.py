"""Issue 17, row 4, on a LAN of network namespaces (tests/netns.py): a lease request signed for
``localhost:4781`` (with or without ``gpusd-node``), sent from another machine, must be refused by
every daemon; the same request signed for the daemon's own address and node is granted.  Skipped
(with the reason) without root or ``ip netns``."""

from __future__ import annotations

import json
import secrets
import sys
from pathlib import Path
from typing import Any

import pytest

from fakenvml import make_gpus
from lan_helpers import secret_file
from netns import GpuHost, Lan, Node, lan, netns_ok  # noqa: F401


def gpu_host(lan: Lan, name: str, key: Path) -> GpuHost:  # noqa: F811
    node_name = f"h{len(lan.nodes) + 1}"
    return lan.add_gpu_host(name, make_gpus(2), fast=True, node_name=node_name,
                            args=["--token-file", str(key), "--interval", "0.2"],
                            extra_env={"GPUSD_LEASE_SOCKET": str(lan.workdir / f"{node_name}-lease.sock")})


def post_lease(lan: Lan, node: Node, ip: str, authority: str, key: Path, with_node: bool) -> dict[str, Any]:  # noqa: F811
    """From ``node``: ``POST https://IP:4781/api/v1/leases`` whose ``Host`` and signed ``@authority``
    are ``authority``; ``gpusd-node`` covered (the daemon's node id, from its public /host) or not."""
    code = f"""
import http.client, json, ssl
from gpusd.wire.http import fetch_json
from gpusd.wire.signing import FleetKey, fingerprint, load_secret
key = FleetKey(load_secret({str(key)!r}))
node = fetch_json("https://{ip}:4781/api/v1/host").data["node_id"] if {with_node!r} else None
body = json.dumps({{"count": 1, "holder": "row-4", "ttl": 30}}).encode()
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT); ctx.check_hostname = False; ctx.verify_mode = ssl.CERT_NONE
c = http.client.HTTPSConnection({ip!r}, 4781, timeout=10, context=ctx)
c.connect()  # over TLS the signature covers the certificate the connection shows
fp = fingerprint(c.sock.getpeercert(binary_form=True))
headers, _ = key.sign_request("POST", "https://{authority}/api/v1/leases", body=body, node_id=node, cert_fp=fp)
headers.update({{"Host": {authority!r}, "Content-Type": "application/json"}})
c.request("POST", "/api/v1/leases", body=body, headers=headers)
r = c.getresponse()
print(json.dumps({{"status": r.status, "body": r.read().decode()[:500]}}))
"""
    r = lan.run(node, [sys.executable, "-c", code], timeout=60)
    assert r.returncode == 0, r.stderr
    return dict(json.loads(r.stdout))


@pytest.mark.timeout(180)
def test_a_request_signed_for_localhost_is_refused_from_the_lan(lan: Lan, tmp_path: Path) -> None:  # noqa: F811
    key = secret_file(tmp_path / "fleet.key", secrets.token_hex(32))
    hosts = [gpu_host(lan, "node-1", key), gpu_host(lan, "node-2", key)]
    for h in hosts:
        h.start()
    client = lan.add_node("client")
    for h in hosts:
        for with_node in (False, True):
            got = post_lease(lan, client, h.ip, "localhost:4781", key, with_node)
            assert got["status"] == 401, (h.ip, with_node, got)
        # signed for the daemon's own address but without its node id: good for no daemon
        got = post_lease(lan, client, h.ip, f"{h.ip}:4781", key, False)
        assert got["status"] == 401 and "gpusd-node" in got["body"], got
        # the real thing is granted
        got = post_lease(lan, client, h.ip, f"{h.ip}:4781", key, True)
        assert got["status"] == 201, got
