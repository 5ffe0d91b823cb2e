"""Trust on one machine (issue 9; docs/security.md): where the fleet secret comes from, that it never
shows on a command line, and that clients trust private fields only from daemons that prove they
hold it.  Daemons and clients are bound to 127.0.0.1 only."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from conftest import gpusd_cli
from daemon_helpers import (  # noqa: F401
    LOOPBACK,
    FakeBackend,
    fast_mdns,
    make_snapshot,
    running_daemon,
    unique_session,
)
from gpusd.errors import SecretError
from gpusd.model import ProcessInfo
from gpusd.wire.signing import FleetKey, load_secret
from tests_paths import REPO

SECRET = "b3c1f0a2d4e6f8091a2b3c4d5e6f7081"


def secret_file(path: Path, value: str = SECRET, mode: int = 0o600) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    os.chmod(path, mode)
    return path


def test_the_secret_comes_from_a_private_file_or_the_environment(tmp_path):
    good = secret_file(tmp_path / "fleet.key")
    assert load_secret(good, environ={}) == SECRET
    assert load_secret(None, environ={"GPUSD_TOKEN_FILE": str(good)}) == SECRET
    assert load_secret(None, environ={"GPUSD_TOKEN": f" {SECRET} "}) == SECRET
    assert load_secret(None, environ={}) is None
    with pytest.raises(SecretError, match="readable by other users"):
        load_secret(secret_file(tmp_path / "open.key", mode=0o644), environ={})
    os.symlink(good, tmp_path / "link.key")
    with pytest.raises(SecretError, match="cannot read"):  # a symlink is not followed (O_NOFOLLOW)
        load_secret(tmp_path / "link.key", environ={})
    with pytest.raises(SecretError, match="at least 16 bytes"):
        load_secret(secret_file(tmp_path / "short.key", "tiny"), environ={})
    with pytest.raises(SecretError, match="at least 16 bytes"):
        load_secret(None, environ={"GPUSD_TOKEN": "short"})
    with pytest.raises(SecretError, match="not a regular file"):
        load_secret(tmp_path, environ={})


@pytest.mark.parametrize("command", [["start"], ["list"], ["watch"], ["scan"], ["top"],
                                     ["export", "prometheus-sd"]])
def test_no_secret_on_the_command_line(command):
    """Finding 10 of issue 9: ``--token VALUE`` showed the secret to every local user (ps)."""
    r = gpusd_cli([*command, "--token", SECRET], timeout=30)
    assert r.returncode == 2
    assert "--token-file" in r.stderr and SECRET not in r.stderr


def test_a_background_daemon_gets_the_secret_without_argv_and_proves_it(tmp_path):
    from gpusd.wire.http import SourceError, fetch_json

    key_file = secret_file(tmp_path / "fleet.key")
    state = tmp_path / "state"
    env = dict(os.environ, GPUSD_INTERFACES="127.0.0.1", GPUSD_STATE_DIR=str(state))
    env.pop("GPUSD_TOKEN", None)
    r = gpusd_cli(["start", "--simulate", "1xA100-80GB", "--interface", "127.0.0.1", "--port", "0",
                   "--session", unique_session("ps"), "--fleet-view", "off", "--token-file", str(key_file)], env=env)
    assert r.returncode == 0, r.stderr
    try:
        leaks = []
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit():
                try:
                    cmdline = (proc / "cmdline").read_bytes()
                except OSError:
                    continue
                if SECRET.encode() in cmdline:
                    leaks.append(cmdline.replace(b"\0", b" ").decode(errors="replace"))
        assert leaks == []
        st = gpusd_cli(["status", "--json"], env=env)
        port = json.loads(st.stdout)["port"]
        url = f"http://127.0.0.1:{port}/api/v1/host"
        assert fetch_json(url, FleetKey(SECRET)).verified is True  # the daemon holds the secret
        with pytest.raises(SourceError, match="401"):
            fetch_json(url, FleetKey("another-fleet-secret-0123"))
    finally:
        gpusd_cli(["stop"], env=env)


def _with_owner(d_node: str, hostname: str) -> FakeBackend:
    snap = make_snapshot(1, hostname=hostname, node_id=d_node)
    snap.gpus[0].processes = [ProcessInfo(pid=4242, used_memory=2**30, user=f"user-of-{hostname}",
                                          command=f"train-{hostname}")]
    return FakeBackend(snap)


async def test_a_client_with_the_secret_trusts_private_fields_of_verified_hosts_only(tmp_path, fast_mdns):  # noqa: F811
    """Three daemons on loopback -- one of our fleet, one of another fleet, one without a secret.
    All three would show a loopback reader its owners; the client keeps them from ours only."""
    from gpusd.discovery.client import AsyncClient

    session = unique_session("trust")
    async with (running_daemon(tmp_path, session, "ours", token=SECRET) as ours,
                running_daemon(tmp_path, session, "theirs", token="another-fleet-secret-0123") as theirs,
                running_daemon(tmp_path, session, "open") as open_):
        for d in (ours, theirs, open_):
            d.backend = _with_owner(d.node_id, d.hostname)
        await _settle_samples()
        for key in (FleetKey(SECRET), None):
            client = AsyncClient(session=session, interfaces=LOOPBACK, key=key)
            try:
                await client.wait_settled(8)
                hosts = {h.hostname: h for h in client.hosts}
                assert set(hosts) == {"ours", "theirs", "open"}
                owners = {name: h.snapshot.gpus[0].processes[0].user for name, h in hosts.items()}
                if key is not None:
                    assert hosts["ours"].url == f"http://127.0.0.1:{ours.port}/api/v1"  # the public base
                    from gpusd.daemon.monitoring import _app_key

                    assert len(ours.app[_app_key()].access.sessions) >= 1  # the stream came over TLS, signed
                    assert {n: h.verified for n, h in hosts.items()} == {"ours": True, "theirs": False, "open": False}
                    assert owners == {"ours": "user-of-ours", "theirs": None, "open": None}
                    devices = {d.hostname: d.verified for d in client.list_devices()}
                    assert devices == {"ours": True, "theirs": False, "open": False}
                else:  # nothing to check with: nothing verified, loopback readers see what daemons show
                    assert {h.verified for h in hosts.values()} == {None}
            finally:
                await client.stop_listening()


async def _settle_samples() -> None:
    import asyncio

    await asyncio.sleep(0.5)  # a few samples (interval 0.1 s) with the new backends


def test_the_tls_identity_is_made_once_privately_and_never_through_a_symlink(tmp_path):
    from gpusd.daemon.tls import CERT_FILE, KEY_FILE, load_or_create
    from gpusd.errors import ConfigError

    state = tmp_path / "state"
    first = load_or_create(state, "gpusd test")
    assert (state / KEY_FILE).stat().st_mode & 0o777 == 0o600
    assert load_or_create(state, "gpusd test").fingerprint == first.fingerprint  # kept across restarts
    # a local user who plants symlinks where the files will be gets a refusal, not a write through them
    victim = tmp_path / "victim"
    victim.write_text("precious")
    other = tmp_path / "other"
    other.mkdir()
    os.symlink(victim, other / KEY_FILE)
    os.symlink(victim, other / CERT_FILE)
    with pytest.raises(ConfigError, match="symlink"):
        load_or_create(other, "gpusd test")
    assert victim.read_text() == "precious"
    os.chmod(state / KEY_FILE, 0o644)  # made readable by someone: refused, not used (and not chmod-ed back)
    with pytest.raises(ConfigError, match="readable by other users"):
        load_or_create(state, "gpusd test")
    assert (state / KEY_FILE).stat().st_mode & 0o777 == 0o644
    (state / CERT_FILE).unlink()
    with pytest.raises(ConfigError, match="missing"):
        load_or_create(state, "gpusd test")


async def test_answers_over_tls_name_the_pinned_certificate(tmp_path, fast_mdns):  # noqa: F811
    """A proof names the certificate of the connection it came over: a relay with another certificate
    (or a pin that does not match) is not trusted."""
    import asyncio

    from gpusd.wire.http import SourceError, fetch_json

    session = unique_session("tls")
    async with running_daemon(tmp_path, session, "tls-host", token=SECRET) as d:
        assert d.tls_port and d.cert_fp
        d.backend = _with_owner(d.node_id, d.hostname)
        await asyncio.sleep(0.3)
        url = f"https://127.0.0.1:{d.tls_port}/api/v1/gpus"
        loop = asyncio.get_running_loop()
        a = await loop.run_in_executor(None, lambda: fetch_json(url, FleetKey(SECRET), pin=d.cert_fp))
        assert a.verified is True and a.data[0]["processes"][0]["user"] == "user-of-tls-host"
        with pytest.raises(SourceError, match="pinned"):
            await loop.run_in_executor(None, lambda: fetch_json(url, FleetKey(SECRET), pin="A" * 43))
        health = await loop.run_in_executor(None, lambda: fetch_json(
            f"http://127.0.0.1:{d.port}/healthz").data)
        assert (health["tls_port"], health["cert_fp"]) == (d.tls_port, d.cert_fp)
        # the proof covers the certificate: checked against another one, it fails
        from gpusd.wire.signing import Headers, Request, Response

        key = FleetKey(SECRET)
        req = Request("GET", "https://127.0.0.1:1/api/v1/gpus", Headers())
        resp = Response(200, req, Headers())
        key.sign_response(resp, "n0nce", d.node_id, d.cert_fp, b"[]")
        assert key.verify_response(resp, "n0nce", d.node_id, cert_fp=d.cert_fp, body=b"[]")
        assert not key.verify_response(resp, "n0nce", d.node_id, cert_fp="B" * 43, body=b"[]")


def test_stale_signatures_window_is_documented():
    from gpusd.wire.signing import MAX_SKEW

    text = (REPO / "docs" / "security.md").read_text()
    assert f"{MAX_SKEW:g} s" in text


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


def test_unverified_hosts_are_marked_in_top_and_in_the_fleet_source():
    from gpusd.views.sources import hosts_from_fleet
    from gpusd.views.top import render_text

    snap = make_snapshot(1, hostname="evil", node_id="e71100000000beef").to_dict()
    fleet = {"hosts": [{"hostname": "evil", "node_id": "e71100000000beef", "alive": True, "verified": False,
                        "snapshot": snap},
                       {"hostname": "good", "node_id": "9000000000000000", "alive": True, "verified": True,
                        "snapshot": {**snap, "hostname": "good", "node_id": "9000000000000000"}}]}
    views = hosts_from_fleet(fleet)
    assert [v.verified for v in views] == [False, True]
    text = render_text(views, width=160, color=False)
    assert "evil  [unverified]" in text and text.count("[unverified]") == 1
    # a daemon that did not prove itself vouches for nobody
    assert {v.verified for v in hosts_from_fleet(fleet, trusted=False)} == {False}


def test_a_daemon_that_cannot_enforce_access_does_not_start(tmp_path):
    """Finding 11 of issue 9: a bad rule through the Python API left the access layer out and the
    daemon served owners and commands to anyone.  Now the daemon is not even built."""
    from daemon_helpers import daemon_config
    from gpusd.daemon.service import Daemon
    from gpusd.errors import ConfigError

    with pytest.raises(ConfigError, match="bad threshold rule"):
        Daemon(daemon_config(tmp_path, unique_session("rule"), "h", thresholds=["temperature>>85"], token=SECRET))
    with pytest.raises(ConfigError, match="at least 16 bytes"):  # a weak secret is refused the same way
        Daemon(daemon_config(tmp_path, unique_session("weak"), "h", token="short"))


def test_a_signed_request_is_never_shown_to_a_certificate_that_is_not_the_pinned_one(tmp_path) -> None:
    """A man in the middle answering with a certificate of its own gets the TLS handshake and nothing
    else: the pin is checked before the request is written, so it never holds a fresh signed request to
    replay to the daemon (whose TLS connection that request would make a trusted session)."""
    import socket
    import ssl
    import threading

    from gpusd.daemon.tls import load_or_create
    from gpusd.wire.http import SourceError, fetch_json

    server_ctx = load_or_create(tmp_path, "mitm").server_context()
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    got: list[bytes] = []

    def serve() -> None:
        conn, _ = listener.accept()
        try:
            with server_ctx.wrap_socket(conn, server_side=True) as tls:
                tls.settimeout(5)
                while True:
                    data = tls.recv(65536)
                    if not data:
                        break
                    got.append(data)
        except (OSError, ssl.SSLError):
            pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        with pytest.raises(SourceError, match="pinned"):
            fetch_json(f"https://127.0.0.1:{port}/api/v1/gpus", FleetKey(SECRET), pin="A" * 43)
        t.join(10)
    finally:
        listener.close()
    assert b"".join(got) == b""  # not a byte of the request, let alone its signature


async def test_a_request_signed_for_plain_http_is_refused_over_tls(tmp_path, fast_mdns):  # noqa: F811
    """A signed GET for the daemon's plain HTTP port (a client's clear-text fallback, read off the wire)
    replayed over TLS: refused, and the connection it came over is no session (its unsigned reads stay
    public).  Without the check it was served private fields, and made the relay's TLS connection a
    session for as long as it was kept alive."""
    import asyncio

    import aiohttp

    async with running_daemon(tmp_path, unique_session("relay"), "relay-host", token=SECRET) as d:
        assert d.tls_port
        d.backend = _with_owner(d.node_id, d.hostname)
        await asyncio.sleep(0.3)
        signed, _ = FleetKey(SECRET).sign_request("GET", f"http://127.0.0.1:{d.port}/api/v1/gpus",
                                                  node_id=d.node_id)
        url = f"https://127.0.0.1:{d.tls_port}/api/v1/gpus"
        from gpusd.wire.signing import fingerprint_bytes

        pin = fingerprint_bytes(d.cert_fp)
        assert pin is not None
        connector = aiohttp.TCPConnector(limit=1, ssl=aiohttp.Fingerprint(pin))
        async with aiohttp.ClientSession(connector=connector) as s:
            async with s.get(url, headers={**signed, "Host": f"127.0.0.1:{d.port}"}) as r:
                assert r.status == 401
                await r.read()
            # the same connection, unsigned, naming another host (so not a local reader's: private only
            # for a session)
            async with s.get(url, headers={"Host": "elsewhere.invalid"}) as r:
                body = await r.text()
                assert r.status == 200 and "user-of-relay-host" not in body
        from gpusd.daemon.monitoring import _app_key

        assert len(d.app[_app_key()].access.sessions) == 0



async def test_a_signed_request_relayed_onto_another_tls_connection_opens_nothing(tmp_path, fast_mdns):  # noqa: F811
    """Issue 39, row 2: a relay that forged the pin (the client connected to it, over TLS to the relay's
    certificate) replays the client's signed request on its own TLS connection to the daemon.  Before,
    the daemon verified it, answered it with owners and command lines and made the relay's connection a
    session: its later *unsigned* reads got them too.  Now a signature over TLS covers the certificate
    the client saw (``Gpusd-Cert``) and the daemon checks it is its own: a request bound to another
    certificate, or to none (a client before 0.4), is refused, and its connection stays public."""
    import asyncio

    import aiohttp

    from gpusd.wire.signing import fingerprint_bytes

    async with running_daemon(tmp_path, unique_session("relay2"), "relay2-host", token=SECRET) as d:
        assert d.tls_port
        d.backend = _with_owner(d.node_id, d.hostname)
        await asyncio.sleep(0.3)
        url = f"https://127.0.0.1:{d.tls_port}/api/v1/gpus"
        pin = fingerprint_bytes(d.cert_fp)
        assert pin is not None
        made: list[int] = []  # connections opened: the unsigned reads must ride the relayed request's one

        async def opened(*_: object) -> None:
            made.append(1)

        def session() -> aiohttp.ClientSession:
            trace = aiohttp.TraceConfig()
            trace.on_connection_create_end.append(opened)
            connector = aiohttp.TCPConnector(limit=1, ssl=aiohttp.Fingerprint(pin))
            return aiohttp.ClientSession(connector=connector, trace_configs=[trace])

        relay_fp = "R" * 43  # the relay's own certificate, which the client was made to pin
        for bind in (None, relay_fp):  # a client before 0.4 binds nothing; one fooled by the relay binds its
            kw = {"cert_fp": bind} if bind else {}
            headers, _ = FleetKey(SECRET).sign_request("GET", url, node_id=d.node_id, **kw)
            made.clear()
            async with session() as s:
                async with s.get(url, headers=headers) as r:
                    body = await r.text()
                    assert r.status == 401 and "user-of-relay2-host" not in body, body
                # the relay's later unsigned reads, on that same connection
                for path in ("/api/v1/gpus", "/api/v1/host", "/api/v1/leases", "/api/v1/fleet"):
                    async with s.get(f"https://127.0.0.1:{d.tls_port}{path}",
                                     headers={"Host": "elsewhere.invalid"}) as r:
                        body = await r.text()
                        assert "user-of-relay2-host" not in body and "train-relay2-host" not in body, (path, body)
            assert made == [1]
        # the client's own request, bound to the certificate it pinned and saw, is served as before
        bound, _ = FleetKey(SECRET).sign_request("GET", url, node_id=d.node_id, cert_fp=d.cert_fp)
        made.clear()
        async with session() as s:
            async with s.get(url, headers=bound) as r:
                assert r.status == 200 and "user-of-relay2-host" in await r.text()
            async with s.get(url, headers={"Host": "elsewhere.invalid"}) as r:  # its connection: a session
                assert "user-of-relay2-host" in await r.text()
        assert made == [1]
        # and a signature bound to a certificate is no good in clear either
        plain = f"http://127.0.0.1:{d.port}/api/v1/gpus"
        bound_plain, _ = FleetKey(SECRET).sign_request("GET", plain, node_id=d.node_id, cert_fp=d.cert_fp)
        async with aiohttp.ClientSession() as s, s.get(plain, headers=bound_plain) as r:
            assert r.status == 401


async def test_a_local_reader_without_the_secret_sees_no_other_hosts_owners_in_the_fleet(tmp_path, fast_mdns):  # noqa: F811
    """The fleet view holds other hosts' owners and commands (they showed them to this daemon, a secret
    holder): a reader on this machine without the secret sees this host's (as on /api/v1/gpus, and as
    ``ps`` would) and no other's, in the fleet's answer and in its event stream; a signed reader sees both.
    Before, a local ``curl`` of /api/v1/fleet got every verified host's command lines."""
    import asyncio

    import aiohttp

    from gpusd.wire.http import fetch_json

    session = unique_session("fleet-local")
    async with (running_daemon(tmp_path, session, "here", token=SECRET) as here,
                running_daemon(tmp_path, session, "there", token=SECRET) as there):
        for d in (here, there):
            d.backend = _with_owner(d.node_id, d.hostname)
        await _settle_samples()
        url = f"http://127.0.0.1:{here.port}/api/v1/fleet"
        loop = asyncio.get_running_loop()

        def signed_owners() -> set[str]:
            text = json.dumps(fetch_json(url, FleetKey(SECRET), node_id=here.node_id).data)
            return {u for u in ("user-of-here", "user-of-there") if u in text}

        deadline = loop.time() + 15
        while await loop.run_in_executor(None, signed_owners) != {"user-of-here", "user-of-there"}:
            assert loop.time() < deadline, "the fleet view did not show both hosts' owners to a signed reader"
            await asyncio.sleep(0.3)
        async with aiohttp.ClientSession() as s:
            async with s.get(url) as r:  # unsigned, from loopback, naming this daemon: a local reader
                body = await r.text()
            assert r.status == 200 and "user-of-here" in body and "train-here" in body
            assert "user-of-there" not in body and "train-there" not in body
            async with s.get(url + "/events") as r:
                assert r.status == 200
                seen = b""

                async def until_both() -> None:  # the replay: each host's device_added, in either order
                    nonlocal seen
                    while seen.count(b'"event":"device_added"') < 2:
                        seen += await r.content.readany()

                try:
                    await asyncio.wait_for(until_both(), 5)
                except asyncio.TimeoutError:
                    pass
            events = [e for e in seen.split(b"\n\n") if b'"event":"device_added"' in e]
            assert {b'"hostname":"here"' in e for e in events} == {True, False}  # both hosts' GPUs came
            assert b"user-of-here" in seen and b"user-of-there" not in seen and b"train-there" not in seen
