"""Users sign remote writes with their own SSH keys; the daemon attributes them to a local account
(issue 20, docs/security.md "Identity"), in process on 127.0.0.1 with real accounts, keys and files.
Each attack here succeeded before issue 20 (the lease was granted, renewed or released, or shown
under the name the request declared)."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
from pathlib import Path
from typing import Any

import pytest

from daemon_helpers import running_daemon, unique_session
from user_keys import Accounts, accounts, keygen, needs_accounts  # noqa: F401

pytestmark = needs_accounts

TOKEN = secrets.token_hex(32)


def node_of(url: str) -> str:
    from urllib.parse import urlsplit

    from gpusd.wire.http import fetch_json

    parts = urlsplit(url)
    return str(fetch_json(f"{parts.scheme}://{parts.netloc}/api/v1/host").data["node_id"])


def call(method: str, url: str, body: Any = None, user: Any = None) -> Any:
    from gpusd.wire.http import request_json
    from gpusd.wire.signing import FleetKey

    return request_json(method, url, body, key=FleetKey(TOKEN), node_id=node_of(url), user=user)


async def acall(*a: Any, **kw: Any) -> Any:
    return await asyncio.to_thread(call, *a, **kw)


def base(d: Any) -> str:
    return f"http://127.0.0.1:{d.port}/api/v1"


def held() -> list[Any]:
    from gpusd.alloc.leases import LeaseStore

    return LeaseStore().leases()


async def test_a_signed_write_is_the_keys_account_and_only_it_acts_on_the_lease(
        tmp_path: Path, accounts: Accounts) -> None:  # noqa: F811
    alice, bob = accounts.add("alice"), accounts.add("bob")
    async with running_daemon(tmp_path, unique_session(), token=TOKEN, simulate="2xA100-80GB", tls=False) as d:
        sub = d.events.subscribe()
        # the request claims to be root: the lease is alice's, as her key says
        r = await acall("POST", base(d) + "/leases", {"count": 1, "holder": "root", "note": "nb"}, user=alice.signer())
        assert r.status == 201, r.data
        lease_id = r.data["lease_id"]
        assert r.data["user"] == alice.name
        (le,) = held()
        assert le.user == alice.name  # the record every view reads (devices, list, top, dashboard, history)
        msg = await asyncio.wait_for(sub.get(), 5)
        while msg is not None and not msg.startswith(b"event: lease_granted"):
            msg = await asyncio.wait_for(sub.get(), 5)
        assert msg is not None and json.loads(msg.decode().partition("\ndata: ")[2])["leases"][0]["user"] == alice.name
        d.events.unsubscribe(sub)
        # bob's key (listed for bob) can neither renew nor release it
        r = await acall("POST", f"{base(d)}/leases/{lease_id}/renew", {"ttl": 2}, user=bob.signer())
        assert r.status == 403 and alice.name in r.data["error"] and r.data["reason"] == "not_owner", r.data
        r = await acall("DELETE", f"{base(d)}/leases/{lease_id}", user=bob.signer())
        assert r.status == 403 and alice.name in r.data["error"], r.data
        # nor can a fleet member without a user key
        r = await acall("DELETE", f"{base(d)}/leases/{lease_id}", user=None)
        assert r.status == 403, r.data
        assert [x.lease_id for x in held()] == [lease_id]
        # alice can
        r = await acall("POST", f"{base(d)}/leases/{lease_id}/renew", {"ttl": 20}, user=alice.signer())
        assert r.status == 200, r.data
        r = await acall("DELETE", f"{base(d)}/leases/{lease_id}", user=alice.signer())
        assert r.status == 200 and held() == [], r.data


async def test_a_key_no_account_lists_is_refused_naming_what_to_set_up(tmp_path: Path,
                                                                      accounts: Accounts) -> None:  # noqa: F811
    from gpusd.wire.sshsig import FileSigner

    accounts.add("alice")
    stranger = FileSigner.load(str(keygen(tmp_path / "stranger")))
    async with running_daemon(tmp_path, unique_session(), token=TOKEN, simulate="2xA100-80GB", tls=False) as d:
        r = await acall("POST", base(d) + "/leases", {"count": 1, "holder": "alice"}, user=stranger)
        assert r.status == 403 and r.data["reason"] == "unknown_key", r.data
        assert "not listed for any account" in r.data["error"] and "authorized_keys" in r.data["error"]
        assert "/etc/gpusd/users" in r.data["error"]
        assert held() == []


async def test_a_replayed_user_signature_is_refused(tmp_path: Path, accounts: Accounts) -> None:  # noqa: F811
    """A fleet member copies alice's user signature onto a request of its own (new nonce): refused."""
    from gpusd.wire.signing import FleetKey
    from gpusd.wire.sshsig import HEADER

    alice = accounts.add("alice")
    async with running_daemon(tmp_path, unique_session(), token=TOKEN, simulate="2xA100-80GB", tls=False) as d:
        url = base(d) + "/leases"
        node = await asyncio.to_thread(node_of, url)
        key = FleetKey(TOKEN)
        body = json.dumps({"count": 1, "holder": "x"}).encode()
        captured, _ = key.sign_request("POST", url, body=body, node_id=node, user=alice.signer())
        # the same request again (the whole of it): the nonce was used
        first = await asyncio.to_thread(_replay, url, body, captured)
        assert first == 201
        assert await asyncio.to_thread(_replay, url, body, captured) == 401
        # her user signature on a fresh fleet signature (another nonce, the same body): refused
        fresh, _ = key.sign_request("POST", url, body=body, node_id=node)
        fresh[HEADER] = captured[HEADER]
        assert await asyncio.to_thread(_replay, url, body, fresh) == 401
        assert len(held()) == 1


def _replay(url: str, body: bytes, headers: dict[str, str]) -> int:
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port or 80, timeout=10)
    try:
        conn.request("POST", parts.path, body=body, headers={**headers, "Content-Type": "application/json",
                                                              "Host": parts.netloc})
        return conn.getresponse().status
    finally:
        conn.close()


@pytest.mark.parametrize("how", ["symlink", "bobs-file", "group-writable"])
async def test_an_authorized_keys_that_is_not_safely_the_users_own_names_nobody(
        tmp_path: Path, accounts: Accounts, how: str) -> None:  # noqa: F811
    """alice's ~/.ssh/authorized_keys as a symlink to a file listing mallory's key, a file owned by
    bob (a hard link to his), or writable by her group: the key is not hers."""
    from gpusd.wire.sshsig import FileSigner

    alice, bob = accounts.add("alice"), accounts.add("bob")
    mallory = FileSigner.load(str(keygen(tmp_path / "mallory")))
    mallory_pub = (tmp_path / "mallory.pub").read_text().strip()
    ak = alice.home / ".ssh" / "authorized_keys"
    ak.unlink()
    if how == "symlink":
        target = tmp_path / "planted"
        target.write_text(mallory_pub + "\n")
        os.chown(target, alice.uid, alice.uid)
        ak.symlink_to(target)
    elif how == "bobs-file":
        bob.authorize(bob.pub, mallory_pub)
        os.link(bob.home / ".ssh" / "authorized_keys", ak)
    else:
        alice.authorize(mallory_pub)
        ak.chmod(0o660)
    async with running_daemon(tmp_path, unique_session(), token=TOKEN, simulate="2xA100-80GB", tls=False) as d:
        r = await acall("POST", base(d) + "/leases", {"count": 1, "holder": alice.name}, user=mallory)
        if how == "bobs-file":  # bob's own file lists the key: it is bob's (never alice's)
            assert r.status == 201 and r.data["user"] == bob.name, r.data
        else:
            assert r.status == 403 and r.data["reason"] == "unknown_key", r.data
            assert all(le.user != alice.name for le in held())


async def test_from_and_command_options_are_honoured(tmp_path: Path, accounts: Accounts) -> None:  # noqa: F811
    alice = accounts.add("alice")
    async with running_daemon(tmp_path, unique_session(), token=TOKEN, simulate="2xA100-80GB", tls=False) as d:
        for line, ok in ((f'from="198.18.0.0/15" {alice.pub}', False),
                         (f'command="/bin/true",restrict {alice.pub}', False),
                         (f'restrict,from="10.*,127.0.0.?" {alice.pub}', True),
                         (f'from="127.0.0.1,!127.0.0.1" {alice.pub}', False)):
            alice.authorize(line)
            r = await acall("POST", base(d) + "/leases", {"count": 1, "holder": "a"}, user=alice.signer())
            assert (r.status == 201) is ok, (line, r.data)
            if ok:
                gone = await acall("DELETE", f"{base(d)}/leases/{r.data['lease_id']}", user=alice.signer())
                assert gone.status == 200
            else:
                assert "from=" in r.data["error"] or "command=" in r.data["error"], r.data


async def test_the_users_file_maps_keys_of_accounts_without_homes_and_must_be_roots(
        tmp_path: Path, accounts: Accounts, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    from gpusd.wire.sshsig import FileSigner

    carol = FileSigner.load(str(keygen(tmp_path / "carol")))
    users = tmp_path / "users"
    users.write_text("# name key\ncarol " + (tmp_path / "carol.pub").read_text())
    users.chmod(0o644)
    monkeypatch.setenv("GPUSD_USERS", str(users))
    async with running_daemon(tmp_path, unique_session(), token=TOKEN, simulate="2xA100-80GB", tls=False) as d:
        r = await acall("POST", base(d) + "/leases", {"count": 1, "holder": "x"}, user=carol)
        assert r.status == 201 and r.data["user"] == "carol", r.data
        assert (await acall("DELETE", f"{base(d)}/leases/{r.data['lease_id']}", user=carol)).status == 200
        users.chmod(0o666)  # writable by anyone: nobody's mapping
        r = await acall("POST", base(d) + "/leases", {"count": 1, "holder": "x"}, user=carol)
        assert r.status == 403, r.data


async def test_a_daemon_that_requires_user_keys_refuses_a_write_without_one(tmp_path: Path) -> None:
    async with running_daemon(tmp_path, unique_session(), token=TOKEN, simulate="2xA100-80GB", tls=False,
                              require_user_key=True) as d:
        r = await acall("POST", base(d) + "/leases", {"count": 1, "holder": "root"})
        assert r.status == 401 and "ssh-agent" in r.data["error"] and "--identity" in r.data["error"], r.data
        assert held() == []


async def test_max_gpus_per_user_caps_remote_leases_by_account_not_by_holder_name(
        tmp_path: Path, accounts: Accounts, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    alice, bob = accounts.add("alice"), accounts.add("bob")
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"max_gpus_per_user": 1}))
    policy.chmod(0o644)
    monkeypatch.setenv("GPUSD_POLICY", str(policy))
    async with running_daemon(tmp_path, unique_session(), token=TOKEN, simulate="3xA100-80GB", tls=False,
                              n=3) as d:
        r = await acall("POST", base(d) + "/leases", {"count": 1, "holder": "a1"}, user=alice.signer())
        assert r.status == 201, r.data
        r = await acall("POST", base(d) + "/leases", {"count": 1, "holder": "another-name"}, user=alice.signer())
        assert r.status == 429 and r.data["reason"] == "policy", r.data
        assert "max_gpus_per_user 1" in r.data["error"] and alice.name in r.data["error"]
        r = await acall("POST", base(d) + "/leases", {"count": 1, "holder": "a1"}, user=bob.signer())
        assert r.status == 201 and r.data["user"] == bob.name, r.data


async def test_root_of_the_host_may_release_anyones_lease(tmp_path: Path, accounts: Accounts,  # noqa: F811
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from gpusd.wire.sshsig import FileSigner

    alice = accounts.add("alice")
    admin = FileSigner.load(str(keygen(tmp_path / "admin")))
    users = tmp_path / "users"
    users.write_text("root " + (tmp_path / "admin.pub").read_text())
    users.chmod(0o644)
    monkeypatch.setenv("GPUSD_USERS", str(users))
    async with running_daemon(tmp_path, unique_session(), token=TOKEN, simulate="2xA100-80GB", tls=False) as d:
        r = await acall("POST", base(d) + "/leases", {"count": 1, "holder": "a"}, user=alice.signer())
        assert r.status == 201, r.data
        gone = await acall("DELETE", f"{base(d)}/leases/{r.data['lease_id']}", user=admin)
        assert gone.status == 200 and held() == [], gone.data


async def test_a_key_two_accounts_list_names_nobody(tmp_path: Path, accounts: Accounts) -> None:  # noqa: F811
    alice, bob = accounts.add("alice"), accounts.add("bob")
    bob.authorize(bob.pub, alice.pub)  # bob lists alice's key too: whose is it?
    async with running_daemon(tmp_path, unique_session(), token=TOKEN, simulate="2xA100-80GB", tls=False) as d:
        r = await acall("POST", base(d) + "/leases", {"count": 1, "holder": "a"}, user=alice.signer())
        assert r.status == 403 and "several accounts" in r.data["error"], r.data
        assert alice.name in r.data["error"] and bob.name in r.data["error"]


def test_authorized_keys_lines_and_from_patterns() -> None:
    from gpusd.daemon.users import from_allows, parse_line, why_not

    key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl"
    e = parse_line(f'from="10.0.0.0/8,!10.1.2.3",no-pty,command="echo \\"a b\\"" {key} me@x')
    assert e is not None and e.options["from"] == "10.0.0.0/8,!10.1.2.3" and "no-pty" in e.flags
    assert e.options["command"] == 'echo "a b"' and why_not(e, "10.0.0.1") is not None  # command=: no identity
    assert from_allows("10.0.0.0/8,!10.1.2.3", "10.9.9.9") and not from_allows("10.0.0.0/8,!10.1.2.3", "10.1.2.3")
    assert from_allows("198.18.*", "::ffff:198.18.0.7") and not from_allows("host.example", "198.18.0.7")
    assert not from_allows("10.0.0.0/99", "10.0.0.1")  # a bad CIDR fails the whole list, as in sshd
    old = parse_line(f'expiry-time="20200101" {key}')
    assert old is not None and why_not(old, "10.0.0.1") == "its expiry-time has passed"
    for junk in ("", "# comment", "ssh-ed25519 not-base64!", "ssh-dss AAAAB3NzaC1kc3MAAACBAP", "x" * 20000):
        assert parse_line(junk) is None
