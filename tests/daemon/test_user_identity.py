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
        assert "not listed for the account" in r.data["error"] and "authorized_keys" in r.data["error"]
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
        mallory.account = alice.name
        r = await acall("POST", base(d) + "/leases", {"count": 1, "holder": alice.name}, user=mallory)
        if how == "bobs-file":  # bob's own file lists the key: it is bob's (never alice's)
            assert r.status == 403 and r.data["reason"] == "unknown_key", r.data
            mallory.account = bob.name
            r = await acall("POST", base(d) + "/leases", {"count": 1, "holder": alice.name}, user=mallory)
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
    carol.account = "carol"
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


async def test_a_key_another_account_lists_does_not_lock_its_owner_out(tmp_path: Path,
                                                                       accounts: Accounts) -> None:  # noqa: F811
    """Issue 39, row 1: bob lists alice's public key in his own authorized_keys.  Before, every write
    alice signed was refused ("listed by several accounts"): she could neither renew her lease nor
    take one.  Her signature names her account, as ssh's ``alice@host`` does, and only her file is
    read; bob's line only lets her key in as bob."""
    from gpusd.wire.signing import FleetKey

    alice, bob = accounts.add("alice"), accounts.add("bob")
    async with running_daemon(tmp_path, unique_session(), token=TOKEN, simulate="2xA100-80GB", tls=False) as d:
        r = await acall("POST", base(d) + "/leases", {"count": 1, "holder": "a", "ttl": 30}, user=alice.signer())
        assert r.status == 201 and r.data["user"] == alice.name, r.data
        lease_id = r.data["lease_id"]
        bob.authorize(bob.pub, alice.pub)  # public keys are public
        r = await acall("POST", f"{base(d)}/leases/{lease_id}/renew", {"ttl": 30}, user=alice.signer())
        assert r.status == 200, r.data
        r = await acall("POST", base(d) + "/leases", {"count": 1, "holder": "a"}, user=alice.signer())
        assert r.status == 201 and r.data["user"] == alice.name, r.data
        assert (await acall("DELETE", f"{base(d)}/leases/{r.data['lease_id']}", user=alice.signer())).status == 200
        # sshd's model: bob's line lets alice's key in as bob, and that is all it does
        r = await acall("POST", base(d) + "/leases", {"count": 1, "holder": "a"}, user=alice.signer(bob.name))
        assert r.status == 201 and r.data["user"] == bob.name, r.data
        r = await acall("DELETE", f"{base(d)}/leases/{lease_id}", user=alice.signer(bob.name))
        assert r.status == 403 and r.data["reason"] == "not_owner", r.data
        # the account is covered by what her key signs: renaming it afterwards breaks the signature
        url = f"{base(d)}/leases/{lease_id}/renew"
        body = json.dumps({"ttl": 30}).encode()
        headers, _ = FleetKey(TOKEN).sign_request("POST", url, body=body, node_id=await asyncio.to_thread(node_of, url),
                                                  user=alice.signer(bob.name))
        headers["Gpusd-User"] = alice.name
        assert await asyncio.to_thread(_replay, url, body, headers) == 401
        # a client before gpusd 0.4 names no account: a key two accounts list names nobody, as before
        headers, _ = FleetKey(TOKEN).sign_request("POST", url, body=body, node_id=await asyncio.to_thread(node_of, url),
                                                  user=alice.signer(), account="")
        assert "Gpusd-User" not in headers
        assert await asyncio.to_thread(_replay, url, body, headers) == 403
        assert [le.user for le in held() if le.lease_id == lease_id] == [alice.name]


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


def test_lines_sshd_refuses_list_no_key_and_expiry_times_read_as_sshd_reads_them(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 39, row 5: lines sshd(8) refuses whole (auth-options.c: a second ``from=``, an unknown
    option such as ``frm=``, an unquoted value) were accepted, the first ``from=`` dropped; a ``[0-9]``
    in ``from=`` matched as a class (match.c's match_pattern knows ``*`` and ``?`` only); and
    ``expiry-time="...Z"`` (UTC, as sshd reads it) was refused as expired."""
    import logging
    import time
    from types import SimpleNamespace

    from gpusd.daemon.users import Directory, Refused, from_allows, parse_line, why_not
    from gpusd.wire.sshsig import parse_public

    key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl"
    for refused in (f'from="10.0.0.0/8",from="198.18.0.7" {key}', f'frm="198.18.0.7" {key}',
                    f'from=198.18.0.7 {key}', f'from="198.18.0.7 {key}', f'command="a",command="b" {key}',
                    f'no-restrict {key}', f'restricted {key}', f'pty,,no-pty {key}', f'pty, {key}',
                    f'expiry-time="2030" {key}', f'expiry-time="20301301" {key}', f'environment="A-B=c" {key}',
                    f'permitopen="host" {key}', f'tunnel="x" {key}'):
        assert parse_line(refused) is None, refused
    for accepted in (f'restrict,pty,no-agent-forwarding,from="198.18.0.7" {key}', f'PTY,No-Pty {key}',
                     f'expiry-time="20300101",expiry-time="20290101" {key}', f'permitlisten="8080" {key}',
                     f'environment="A_1=x y",permitopen="h:*",tunnel="3" {key}', f'cert-authority {key}'):
        assert parse_line(accepted) is not None, accepted
    from gpusd.daemon.users import parse_entry, parse_expiry

    assert parse_entry(f'frm="x" {key}') == (None, "bad key options: unsupported option")
    assert parse_entry(f'expiry-time="20300101",expiry-time="20290101" {key}')[0].valid_before == parse_expiry(
        "20290101")  # the earliest wins
    # expiry-time in every form sshd accepts; Z and UTC mean UTC
    assert parse_expiry("20300102Z") == 1893542400.0 and parse_expiry("203001020000utc") == 1893542400.0
    assert parse_expiry("20300102000001Z") == 1893542401.0
    assert parse_expiry("20300102") == time.mktime(time.strptime("20300102", "%Y%m%d"))
    soon = time.strftime("%Y%m%d%H%M%SZ", time.gmtime(time.time() + 3600))
    entry = parse_entry(f'expiry-time="{soon}" {key}')[0]
    assert entry is not None and why_not(entry, "198.18.0.7") is None
    past = time.strftime("%Y%m%d%H%MZ", time.gmtime(time.time() - 120))
    entry = parse_entry(f'expiry-time="{past}" {key}')[0]
    assert entry is not None and why_not(entry, "198.18.0.7") == "its expiry-time has passed"
    # from=: * and ? only; [ is literal; a network with host bits set breaks the list, as in sshd
    assert not from_allows("198.18.0.[0-9]", "198.18.0.7") and from_allows("198.18.0.?", "198.18.0.7")
    assert not from_allows("198.18.0.0/24,198.18.0.1/24", "198.18.0.7")
    assert from_allows("!10.0.0.1,198.18.*", "198.18.0.7") and not from_allows("198.18.*,!198.18.0.7", "198.18.0.7")
    assert not from_allows("198.18.0.7,", "198.18.0.7")  # an empty entry breaks the list
    # in a file: the refused line lists nothing (logged, once), the good line after it still counts
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True, mode=0o700)
    home.chmod(0o755)
    ak = home / ".ssh" / "authorized_keys"
    ak.write_text(f'from="198.18.0.0/15",frm="x" {key}\nfrom="198.18.0.0/24",from="10.0.0.1" {key}\n')
    ak.chmod(0o600)
    me = SimpleNamespace(pw_name="root", pw_dir=str(home), pw_uid=os.geteuid())
    users = Directory(str(tmp_path / "no-users-file"), accounts=lambda: [me])
    blob = parse_public(key)
    with caplog.at_level(logging.WARNING, logger="gpusd.daemon.users"):
        with pytest.raises(Refused):
            users.who(blob, "198.18.0.7", account="root")
    assert "unsupported option" in caplog.text and 'multiple "from" clauses' in caplog.text
    ak.write_text(f'frm="x" {key}\nfrom="198.18.0.[0-9]" {key}\nfrom="198.18.0.7" {key}\n')
    assert users.who(blob, "198.18.0.7", account="root").name == "root"
    with pytest.raises(Refused):
        users.who(blob, "198.18.0.8", account="root")
