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
from user_keys import Accounts, User, accounts, keygen, needs_accounts  # noqa: F401

pytestmark = needs_accounts  # the lan fixture skips where network namespaces cannot be made


def as_agent(lan: Lan, node: Node, user: User, method: str, url: str, key_file: Path,  # noqa: F811
             body: Any = None) -> dict[str, Any]:
    """One signed write from ``node``, signed by the first key of ``user``'s agent too, as ``user``."""
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
    env = {**lan.base_env(node), **user.env()}
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
    env_alice = {**lan.base_env(client, GPUSD_MDNS_FAST="1"), **alice.env()}

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
        got = as_agent(lan, client, bob, "POST", f"{https}/leases/{lease_id}/renew", key, {"ttl": 2})
        assert got["status"] == 403 and alice.name in got["data"]["error"], got
        got = as_agent(lan, client, bob, "DELETE", f"{https}/leases/{lease_id}", key)
        assert got["status"] == 403, got
        r = gpusd(lan, client, ["release", lease_id, *tok], env={**env_alice, **bob.env()})
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
    assert r.returncode != 0 and "not listed for the account" in r.stderr and "authorized_keys" in r.stderr, \
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
    first = as_agent(lan, client, alice, "POST", f"https://{h1.ip}:4781/api/v1/leases", key,
                     {"count": 1, "holder": "a", "ttl": 60})
    assert first["status"] == 201 and first["data"]["user"] == alice.name, first
    url2 = f"https://{h2.ip}:4781/api/v1/leases"

    def refused_on_node2() -> Any:
        got = as_agent(lan, client, alice, "POST", url2, key, {"count": 1, "holder": "a", "ttl": 60})
        if got["status"] == 201:  # node-2's view had not seen node-1's lease yet: give it back
            as_agent(lan, client, alice, "DELETE", f"{url2}/{got['data']['lease_id']}", key)
            return None
        return got

    got = wait_for(refused_on_node2, 30, "node-2 to count alice's lease on node-1")
    assert got["status"] == 429 and "fleet_max_gpus_per_user 1" in got["data"]["error"], got
    theirs = as_agent(lan, client, bob, "POST", url2, key, {"count": 1, "holder": "b", "ttl": 60})
    assert theirs["status"] == 201 and theirs["data"]["user"] == bob.name, theirs


def burst(lan: Lan, node: Node, user: User, urls: list[str], key_file: Path, body: Any) -> list[dict[str, Any]]:
    """The same signed write to every URL at once, as ``user``: each connection made and each request
    signed first (TLS handshakes and agent signatures out of the race), then sent together."""
    code = f"""
import http.client, json, ssl, threading
from urllib.parse import urlsplit
from gpusd.wire.http import fetch_json
from gpusd.wire.signing import FleetKey, fingerprint, load_secret
from gpusd.wire.sshsig import default_signer
key, signer = FleetKey(load_secret({str(key_file)!r})), default_signer()
urls, payload = {urls!r}, json.dumps({body!r}).encode()
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
ready = []
for u in urls:
    parts = urlsplit(u)
    node = fetch_json(f"{{parts.scheme}}://{{parts.netloc}}/api/v1/host").data["node_id"]
    conn = http.client.HTTPSConnection(parts.hostname, parts.port, context=ctx, timeout=30)
    conn.connect()
    fp = fingerprint(conn.sock.getpeercert(binary_form=True))
    headers, _ = key.sign_request("POST", u, body=payload, node_id=node, user=signer, cert_fp=fp)
    ready.append((conn, parts.path, {{**headers, "Host": parts.netloc, "Content-Type": "application/json"}}))
go, out = threading.Barrier(len(urls)), [None] * len(urls)
def one(i):
    conn, path, headers = ready[i]
    go.wait()
    conn.request("POST", path, body=payload, headers=headers)
    r = conn.getresponse()
    out[i] = {{"status": r.status, "data": json.loads(r.read())}}
threads = [threading.Thread(target=one, args=(i,)) for i in range(len(urls))]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps(out))
"""
    r = lan.run(node, [sys.executable, "-c", code], env={**lan.base_env(node), **user.env()}, timeout=60)
    assert r.returncode == 0, r.stderr
    return list(json.loads(r.stdout))


@pytest.mark.timeout(300)
def test_a_burst_over_the_fleet_wide_cap_loses_its_newest_lease_at_renewal(lan: Lan, tmp_path: Path,  # noqa: F811
                                                                          accounts: Accounts) -> None:  # noqa: F811
    """Issue 39, row 12: fleet_max_gpus_per_user 2, and alice sends ``count 2`` to two hosts at the same
    moment: neither host's view shows the other's grant yet, so both are granted (4 GPUs).  Before, she
    kept all 4 for as long as she renewed.  Now a renewal re-checks the fleet view: the newest lease
    above the cap is refused renewal (429, ``reason: fleet_cap``, one line naming the cap) and ends at
    its expiry; the oldest keeps renewing."""
    from fakenvml import make_gpus

    alice = accounts.add("alice")
    key = secret_file(tmp_path / "fleet.key", secrets.token_hex(32))
    pol = tmp_path / "policy.json"
    pol.write_text(json.dumps({"fleet_max_gpus_per_user": 2}))
    pol.chmod(0o644)
    hosts = []
    for name in ("node-1", "node-2"):
        node_name = f"h{len(lan.nodes) + 1}"
        hosts.append(lan.add_gpu_host(name, make_gpus(2), fast=True, node_name=node_name,
                                      args=["--token-file", str(key), "--interval", "0.2", "--fleet-view", "on"],
                                      extra_env={"GPUSD_LEASE_SOCKET": str(lan.workdir / f"{node_name}-lease.sock"),
                                                 "GPUSD_POLICY": str(pol)}))
    start_all(hosts)
    client = lan.add_node("client")
    base = [f"https://{h.ip}:4781/api/v1" for h in hosts]
    ttl = 8

    def views_ready() -> bool | None:  # each daemon's fleet view follows the other, verified
        for b in base:
            fleet = signed(lan, client, "GET", f"{b}/fleet", key)["data"]
            if sum(1 for h in fleet.get("hosts", []) if h.get("verified") is True and h.get("snapshot")) < 2:
                return None
        return True

    wait_for(views_ready, 30, "both fleet views")
    got = burst(lan, client, alice, [b + "/leases" for b in base], key, {"count": 2, "holder": "a", "ttl": ttl})
    assert [g["status"] for g in got] == [201, 201], got  # the burst wins 4 GPUs: the views lag
    leases = [(b, g["data"]["lease_id"]) for b, g in zip(base, got)]

    def renew(lease: tuple[str, str]) -> dict[str, Any]:
        return as_agent(lan, client, alice, "POST", f"{lease[0]}/leases/{lease[1]}/renew", key, {"ttl": ttl})

    kept: list[tuple[str, str]] = []
    newest: list[tuple[str, str]] = []

    def refused() -> Any:  # renewing both, every heartbeat, until one is refused: never both
        answers = [renew(lease) for lease in leases]
        if all(a["status"] == 200 for a in answers):
            return None
        assert sorted(a["status"] for a in answers) == [200, 429], answers
        no = next(i for i, a in enumerate(answers) if a["status"] != 200)
        newest.append(leases[no])
        kept.append(leases[1 - no])
        return answers[no]

    got_refusal = wait_for(refused, 15, "the newest lease above the cap to be refused renewal")
    assert got_refusal["status"] == 429 and got_refusal["data"]["reason"] == "fleet_cap", got_refusal
    message = got_refusal["data"]["error"]
    assert "fleet_max_gpus_per_user 2" in message and alice.name in message and "\n" not in message, message
    # the refused lease ends at its expiry; the other, renewed, stays: alice is back within the cap
    newest_host = hosts[base.index(newest[0][0])]

    def gone() -> bool | None:
        assert renew(kept[0])["status"] == 200
        again = renew(newest[0])
        assert again["status"] in (429, 404), again  # refused again until it has expired
        return True if not any(le["lease_id"] == newest[0][1] for le in leases_of(devices_json(lan, newest_host))) \
            else None

    wait_for(gone, ttl + 10, "the refused lease to expire")
    assert renew(kept[0])["status"] == 200
