"""Issue 20 on a LAN of network namespaces: alice's ``gpusd reserve`` from another host, her key in her
ssh-agent, is alice's lease on the GPU host in every view and in ``gpusd report --by user``; bob's key
can neither renew nor release it; a key no account lists cannot reserve.  Real accounts (useradd),
real keys (ssh-keygen) and real agents (ssh-agent): tests/user_keys.py."""

from __future__ import annotations

import json
import os
import secrets
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from test_pool_lan import TTL, devices_json, gpu_host, gpusd, leases_of, secret_file, signed, start_all, wait_for

from netns import Lan, Node, lan, netns_ok  # noqa: F401
from user_keys import Accounts, accounts, keygen, needs_accounts  # noqa: F401

pytestmark = needs_accounts  # the lan fixture skips where network namespaces cannot be made


def as_agent(lan: Lan, node: Node, agent: str, method: str, url: str, key_file: Path,  # noqa: F811
             body: Any = None) -> dict[str, Any]:
    """One signed write from ``node``, signed by the first key of the agent at ``agent`` too."""
    code = f"""
import json
from urllib.parse import urlsplit
from gpusd.wire.http import fetch_json, request_json
from gpusd.wire.signing import FleetKey, load_secret
key = FleetKey(load_secret({str(key_file)!r}))
parts = urlsplit({url!r})
node = fetch_json(f"{{parts.scheme}}://{{parts.netloc}}/api/v1/host").data["node_id"]
r = request_json({method!r}, {url!r}, {body!r}, key=key, node_id=node)
print(json.dumps({{"status": r.status, "data": r.data}}))
"""
    env = {**lan.base_env(node), "SSH_AUTH_SOCK": agent}
    r = lan.run(node, [sys.executable, "-c", code], env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    return dict(json.loads(r.stdout))


@pytest.mark.timeout(300)
def test_alices_reservation_from_another_host_is_alices_everywhere(lan: Lan, tmp_path: Path,  # noqa: F811
                                                                    accounts: Accounts) -> None:  # noqa: F811
    alice, bob = accounts.add("alice"), accounts.add("bob")
    key = secret_file(tmp_path / "fleet.key", secrets.token_hex(32))
    h1 = gpu_host(lan, "node-1", 2, key)
    start_all([h1])
    client = lan.add_node("client")
    tok = ["--token-file", str(key)]
    env_alice = {**lan.base_env(client, GPUSD_MDNS_FAST="1"), "SSH_AUTH_SOCK": alice.agent}

    r = gpusd(lan, client, ["reserve", "-n", "1", "--ttl", str(TTL), "--for", "1h", "--note", "nb", "--json",
                            "--wait", "--timeout", "30", *tok], env=env_alice)  # --wait: until discovery has it
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    lease_id, renewer = res["leases"][0]["lease_id"], res["renewer_pid"]
    try:
        # on the GPU host: gpusd devices (JSON and table) and gpusd leases read the record
        local = wait_for(lambda: [le for le in leases_of(devices_json(lan, h1)) if le["lease_id"] == lease_id],
                         5, "the lease in gpusd devices")
        assert local[0]["user"] == alice.name and local[0]["remote_from"] == client.ip
        assert alice.name in gpusd(lan, h1.node, ["devices"], env=h1.env).stdout
        shown = gpusd(lan, h1.node, ["leases"], env=h1.env)
        assert alice.name in shown.stdout, shown.stdout + shown.stderr
        # renewed in the background (signed by her agent's key every time): still there after several TTLs
        time.sleep(2.5 * TTL)
        assert any(le["lease_id"] == lease_id for le in leases_of(devices_json(lan, h1)))
        # from the client: gpusd list, top, the dashboard's fleet view, the lease listing
        r = gpusd(lan, client, ["list", "--json", *tok], env=env_alice)
        listed = [le for d in json.loads(r.stdout) for le in d["gpu"]["leases"]]
        assert [le["user"] for le in listed if le["lease_id"] == lease_id] == [alice.name], r.stdout
        r = gpusd(lan, client, ["top", "--once", "--width", "200", *tok], env=env_alice)
        assert alice.name in r.stdout, r.stdout + r.stderr
        # the dashboard's data: the daemon's fleet view (signed, over HTTPS)
        fleet = signed(lan, client, "GET", f"https://{h1.ip}:4781/api/v1/fleet", key)
        shown = [le["user"] for host in fleet["data"]["hosts"] for g in (host["snapshot"] or {}).get("gpus", [])
                 for le in g["leases"] if le["lease_id"] == lease_id]
        assert shown == [alice.name], fleet
        r = gpusd(lan, client, ["reservations", "--json", "--all", *tok], env=env_alice)
        mine = json.loads(r.stdout)["reservations"]
        assert [(d["lease_id"], d["user"]) for d in mine] == [(lease_id, alice.name)], r.stdout

        # bob's key, listed for bob on this host: no renewal, no release
        https = f"https://{h1.ip}:4781/api/v1"
        got = as_agent(lan, client, bob.agent, "POST", f"{https}/leases/{lease_id}/renew", key, {"ttl": 2})
        assert got["status"] == 403 and alice.name in got["data"]["error"], got
        got = as_agent(lan, client, bob.agent, "DELETE", f"{https}/leases/{lease_id}", key)
        assert got["status"] == 403, got
        r = gpusd(lan, client, ["release", lease_id, *tok], env={**env_alice, "SSH_AUTH_SOCK": bob.agent})
        assert r.returncode != 0 and alice.name in r.stderr, r.stdout + r.stderr
        assert any(le["lease_id"] == lease_id for le in leases_of(devices_json(lan, h1)))

        # the usage history charges alice (the host's own report and the client's)
        def by_user() -> Any:
            out = gpusd(lan, client, ["report", "--url", f"https://{h1.ip}:4781", "--since", "1h", "--by", "user",
                                      "--format", "json", *tok], env=env_alice)
            if out.returncode != 0:
                return None
            rows = {row["user"]: row for row in json.loads(out.stdout)["rows"]}
            return rows if alice.name in rows and rows[alice.name]["gpu_hours_held"] > 0 else None

        rows = wait_for(by_user, 30, "alice in gpusd report --by user")
        assert "root" not in rows and not any(str(u).startswith("fleet@") for u in rows), rows
    finally:
        try:
            os.kill(renewer, signal.SIGTERM)
        except ProcessLookupError:
            pass
    wait_for(lambda: not leases_of(devices_json(lan, h1)), TTL + 10, "the lease to go")

    # a key no account on node-1 lists: refused, saying what to set up
    stranger = keygen(tmp_path / "stranger")
    r = gpusd(lan, client, ["reserve", "-n", "1", "--ttl", str(TTL), "--identity", str(stranger), *tok],
              env=lan.base_env(client, GPUSD_MDNS_FAST="1"))
    assert r.returncode != 0 and "not listed for any account" in r.stderr and "authorized_keys" in r.stderr, \
        r.stdout + r.stderr
    assert not leases_of(devices_json(lan, h1))


@pytest.mark.timeout(300)
def test_the_fleet_wide_cap_counts_the_users_gpus_on_every_host(lan: Lan, tmp_path: Path,  # noqa: F811
                                                                 accounts: Accounts) -> None:  # noqa: F811
    """fleet_max_gpus_per_user 1: alice's lease on node-1, once node-2's fleet view shows it, stops her
    second one on node-2 (naming the cap); bob still gets one there."""
    from fakenvml import make_gpus

    alice, bob = accounts.add("alice"), accounts.add("bob")
    key = secret_file(tmp_path / "fleet.key", secrets.token_hex(32))
    pol = tmp_path / "policy.json"
    pol.write_text(json.dumps({"fleet_max_gpus_per_user": 1}))
    pol.chmod(0o644)
    hosts = []
    for name in ("node-1", "node-2"):
        node_name = f"h{len(lan.nodes) + 1}"
        hosts.append(lan.add_gpu_host(name, make_gpus(2), fast=True, node_name=node_name,
                                      args=["--token-file", str(key), "--interval", "0.2"],
                                      extra_env={"GPUSD_LEASE_SOCKET": str(lan.workdir / f"{node_name}-lease.sock"),
                                                 "GPUSD_POLICY": str(pol)}))
    start_all(hosts)
    h1, h2 = hosts
    client = lan.add_node("client")
    first = as_agent(lan, client, alice.agent, "POST", f"https://{h1.ip}:4781/api/v1/leases", key,
                     {"count": 1, "holder": "a", "ttl": 60})
    assert first["status"] == 201 and first["data"]["user"] == alice.name, first
    url2 = f"https://{h2.ip}:4781/api/v1/leases"

    def refused_on_node2() -> Any:
        got = as_agent(lan, client, alice.agent, "POST", url2, key, {"count": 1, "holder": "a", "ttl": 60})
        if got["status"] == 201:  # node-2's view had not seen node-1's lease yet: give it back
            as_agent(lan, client, alice.agent, "DELETE", f"{url2}/{got['data']['lease_id']}", key)
            return None
        return got

    got = wait_for(refused_on_node2, 30, "node-2 to count alice's lease on node-1")
    assert got["status"] == 429 and "fleet_max_gpus_per_user 1" in got["data"]["error"], got
    theirs = as_agent(lan, client, bob.agent, "POST", url2, key, {"count": 1, "holder": "b", "ttl": 60})
    assert theirs["status"] == 201 and theirs["data"]["user"] == bob.name, theirs
