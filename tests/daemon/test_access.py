"""Privacy and access: who sees process owners and commands, and who may write."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from daemon_helpers import private_values
from gpusd.daemon.access import Access, redact
from gpusd.wire.signing import FleetKey
from monitor_fakes import FakeDaemon, make_app, sim_host
from waiting import wait_until

TOKEN = "s3cret-fleet-token-0123"


async def client_for(daemon: FakeDaemon, trust_loopback: bool = False) -> TestClient:
    client = TestClient(TestServer(make_app(daemon, trust_loopback=trust_loopback), host="127.0.0.1"))
    await client.start_server()
    return client


@pytest.fixture
async def remote() -> AsyncIterator[tuple[FakeDaemon, TestClient]]:
    """A daemon with a token, read as a remote reader would (loopback not trusted)."""
    d = FakeDaemon([sim_host("gpu-node-1"), sim_host("gpu-node-2")], token=TOKEN)
    c = await client_for(d)
    yield d, c
    await c.close()


def test_redact_nulls_owner_and_command_everywhere():
    snap = sim_host("h").to_dict()
    fleet = {"hosts": [{"hostname": "h", "snapshot": snap}]}
    red = redact(fleet)
    assert private_values(fleet) == ["alice", "python train.py --secret"] * 2
    assert set(private_values(red)) == {None}
    g = red["hosts"][0]["snapshot"]["gpus"][0]
    assert g["processes"][0]["pid"] == 4242 and g["processes"][0]["used_memory"] == 3 * 2**30  # load stays
    assert g["leases"][0]["lease_id"] == "l1"
    assert private_values(fleet) == ["alice", "python train.py --secret"] * 2  # the original is untouched


def test_redact_event():
    from gpusd.daemon.access import redact_event

    plain = b'event: heartbeat\ndata: {"ts": 1}\n\n'
    assert redact_event(plain) is plain
    msg = b'event: snapshot\ndata: {"gpus": [{"processes": [{"pid": 1, "user": "alice", "command": "x"}]}]}\n\n'
    out = redact_event(msg)
    assert out.startswith(b"event: snapshot\ndata: ") and out.endswith(b"\n\n")
    assert b"alice" not in out and json.loads(out.split(b"data: ")[1])["gpus"][0]["processes"][0]["pid"] == 1
    split = b'event: x\ndata: {"processes": [{"user":\ndata: "bob"}]}\n\n'  # data over two lines
    assert b"bob" not in redact_event(split) and b'"user":null' in redact_event(split)
    assert redact_event(b'event: x\ndata: {"user": "carol", oops\n\n') == b""  # unparseable: dropped


def test_host_names_the_daemon():
    from gpusd.daemon.access import split_host

    assert split_host("Gpu-Node-1.local.:4780") == ("gpu-node-1.local", 4780)
    assert split_host("[::1]:4780") == ("::1", 4780) and split_host("198.18.0.2") == ("198.18.0.2", None)
    for bad in ("", "a b", "x:99999", "x:-1", "::1", "a/b", "user@host", "h\xff", "h:80:81"):
        assert split_host(bad) is None, bad
    a = Access(TOKEN, own_addresses=lambda: ["198.18.0.2"], own_names=lambda: ["gpu-node-1"], own_ports=lambda: [4780])
    for ok in ("198.18.0.2:4780", "gpu-node-1:4780", "GPU-NODE-1.local:4780"):
        assert a.host_ok(ok, "198.18.0.7") and a.host_ok(ok, "127.0.0.1"), ok
    for ok in ("localhost:4780", "127.0.0.1:4780", "[::1]:4780"):
        # "localhost" names this daemon only for a peer on this machine's loopback (issue 17, row 4)
        assert a.host_ok(ok, "127.0.0.1") and a.host_ok(ok, "::1"), ok
        assert not a.host_ok(ok, "198.18.0.7") and not a.host_ok(ok, "198.18.0.2") and not a.host_ok(ok), ok
    for bad in ("evil.example:4780", "198.18.0.3:4780", "198.18.0.2:4781", "gpu-node-1", "gpu-node-1.evil:4780",
                None, "198.18.0.2:4780\x00"):
        assert not a.host_ok(bad, "127.0.0.1"), bad
    assert a.origin_ok(None) and a.origin_ok("http://gpu-node-1:4780", "198.18.0.7")
    assert a.origin_ok("http://localhost:4780", "127.0.0.1") and not a.origin_ok("http://localhost:4780", "198.18.0.7")
    assert not a.origin_ok("http://evil.example", "127.0.0.1") and not a.origin_ok("null", "127.0.0.1")


def signed(c: TestClient, path: str, secret: str = TOKEN, method: str = "GET", body: bytes = b"",
           **kw: Any) -> dict[str, str]:
    """The headers of a request to ``path`` on the test server, signed with ``secret`` (a write for
    the node of ``gpu-node-1``, the first host of the fake daemons here, unless ``node_id`` says)."""
    if method not in ("GET", "HEAD"):
        kw.setdefault("node_id", NODE_1)
    headers, _ = FleetKey(secret).sign_request(method, str(c.make_url(path)), body=body, **kw)
    return headers


NODE_1 = sim_host("gpu-node-1").node_id


async def test_remote_reader_without_signature_sees_load_but_no_owners(remote):
    _, c = remote
    r = await c.get("/api/v1/fleet")
    assert r.status == 200
    fleet = await r.json()
    assert len(fleet["hosts"]) == 2
    assert fleet["hosts"][0]["snapshot"]["gpus"][0]["utilization_gpu"] is not None
    assert private_values(fleet) and set(private_values(fleet)) == {None}
    gpus = await (await c.get("/api/v1/gpus")).json()
    assert gpus[0]["processes"][0]["pid"] == 4242 and gpus[0]["processes"][0]["user"] is None
    assert "secret" not in await (await c.get("/api/v1/gpus")).text()
    assert "Signature" not in r.headers  # unsigned reads get no proof (and cost none)


async def test_signed_reader_sees_owners_and_gets_the_daemons_proof(remote):
    from gpusd.wire.signing import Headers, Request, Response

    d, c = remote
    key = FleetKey(TOKEN)
    url = str(c.make_url("/api/v1/fleet"))
    headers, nonce = key.sign_request("GET", url, node_id=d.node_id)
    r = await c.get("/api/v1/fleet", headers=headers)
    assert r.status == 200
    body = await r.read()
    fleet = json.loads(body)
    assert "alice" in private_values(fleet) and "python train.py --secret" in private_values(fleet)
    answer = Response(200, Request("GET", url, Headers(headers)), Headers(r.headers.items()))
    assert key.verify_response(answer, nonce, node_id=d.node_id, body=body)
    assert not key.verify_response(answer, nonce, node_id="another-node", body=body)
    assert not key.verify_response(answer, "another-nonce", node_id=d.node_id, body=body)
    assert not key.verify_response(answer, nonce, node_id=d.node_id, body=body.replace(b"alice", b"mallory"))
    assert not FleetKey("another-fleet-secret-0123").verify_response(answer, nonce, node_id=d.node_id, body=body)
    assert TOKEN not in json.dumps(dict(r.headers)) and TOKEN not in json.dumps(headers)  # no secret on the wire


async def test_bad_signatures_are_refused_with_401(remote):
    _, c = remote
    key = FleetKey(TOKEN)
    url = str(c.make_url("/api/v1/gpus"))
    cases = {
        "another fleet": FleetKey("another-fleet-secret-0123").sign_request("GET", url)[0],
        "stale": key.sign_request("GET", url, now=time.time() - 120)[0],
        "from the future": key.sign_request("GET", url, now=time.time() + 120)[0],
        "another path": key.sign_request("GET", str(c.make_url("/api/v1/host")))[0],
        "another method": key.sign_request("POST", url)[0],
        "another authority": key.sign_request("GET", url.replace("127.0.0.1", "198.18.0.9"))[0],
        "another node": key.sign_request("GET", url, node_id="0123456789abcdef")[0],
    }
    tampered = key.sign_request("GET", url)[0]
    tampered["Signature"] = tampered["Signature"].replace("gpusd=:", "gpusd=:AA")
    cases["tampered"] = tampered
    cases["garbage"] = {"Signature-Input": 'gpusd=("@method";created=x', "Signature": "gpusd=:!!:"}
    from gpusd.wire.signing import Headers, Request

    partial = Request("GET", url, Headers())  # a valid HMAC over too little (no path, query, digest)
    key._req_signer.sign(partial, key_id=key.key_id, nonce="n-partial", label="gpusd", tag="gpusd-request",
                         covered_component_ids=("@method", "@authority"))
    cases["covering too little"] = dict(partial.headers)
    cases["bearer"] = {"Authorization": f"Bearer {TOKEN}"}
    for what, headers in cases.items():
        r = await c.get("/api/v1/gpus", headers=headers)
        assert r.status == 401, what
        assert "Signature" in r.headers["WWW-Authenticate"] and "error" in await r.json()
    good = key.sign_request("GET", url)[0]
    assert (await c.get("/api/v1/gpus", headers=good)).status == 200
    r = await c.get("/api/v1/gpus", headers=good)  # the same request again: a replay
    assert r.status == 401 and "replayed" in (await r.json())["error"]


async def test_non_utf8_credentials_get_401_not_500(remote, caplog):
    """Finding 8 of issue 9: a header that is not UTF-8 made a 500 and a traceback per request."""
    import logging

    caplog.set_level(logging.INFO)
    _, c = remote
    for name in (b"Authorization: Bearer \xff\xfe", b"Signature: gpusd=:\xff:", b"Signature-Input: gpusd=(\xc3\x28)"):
        reader, writer = await asyncio.open_connection("127.0.0.1", c.port)
        writer.write(b"GET /api/v1/gpus HTTP/1.1\r\nHost: 127.0.0.1\r\n" + name + b"\r\nConnection: close\r\n\r\n")
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 401"), (name, answer[:200])
        assert b"Traceback" not in answer
    # nothing in the log above debug level: a stranger cannot fill it with refusals
    # (the test server's access log aside: the daemon runs without one)
    assert [r.getMessage()[:100] for r in caplog.records
            if r.levelno >= logging.INFO and r.name != "aiohttp.access"] == []


async def test_loopback_reader_with_a_foreign_host_gets_no_private_fields():
    """Finding 3 of issue 9 (DNS rebinding): a page on evil.example resolving to 127.0.0.1."""
    d = FakeDaemon([sim_host("gpu-node-1")], token=TOKEN)
    c = await client_for(d, trust_loopback=True)
    try:
        mine = await (await c.get("/api/v1/gpus")).json()  # Host: 127.0.0.1:port
        assert mine[0]["processes"][0]["user"] == "alice"
        for host in ("evil.example", f"evil.example:{c.port}", "127.0.0.1.evil.example", "", "a b"):
            theirs = await (await c.get("/api/v1/gpus", headers={"Host": host})).json()
            assert theirs[0]["processes"][0]["user"] is None, host
            assert theirs[0]["processes"][0]["pid"] == 4242
        r = await c.post("/api/v1/echo", json={}, headers={"Host": "evil.example",
                                                           **signed(c, "/api/v1/echo", method="POST", body=b"{}")})
        assert r.status == 401  # signed for 127.0.0.1:port, sent as evil.example: not this daemon
    finally:
        await c.close()


async def read_events(resp: Any, want: str, timeout: float = 5.0) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        event = ""
        while True:
            line = (await resp.content.readline()).decode().rstrip("\n")
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: ") and event == want:
                return json.loads(line[6:])
    return await asyncio.wait_for(go(), timeout)


@pytest.mark.parametrize("with_token", [False, True])
async def test_event_stream_is_redacted_without_signature(remote, with_token):
    d, c = remote
    headers = signed(c, "/api/v1/fleet/events") if with_token else {}
    resp = await c.get("/api/v1/fleet/events", headers=headers)
    assert resp.status == 200 and ("Signature" in resp.headers) == with_token  # a stream carries a proof too
    await wait_until(lambda: d.subscribers, 1.0, what="a subscriber")
    d.set_gpu(d.local, 0, utilization_gpu=77.0)
    data = await read_events(resp, "device_updated")
    assert data["gpu"]["utilization_gpu"] == 77.0
    proc = data["gpu"]["processes"][0]
    assert (proc["user"], proc["command"]) == (("alice", "python train.py --secret") if with_token else (None, None))
    resp.close()


async def test_writes_refused_without_signature(remote):
    _, c = remote
    r = await c.post("/api/v1/echo", json={})
    assert r.status == 401
    assert "Signature" in r.headers["WWW-Authenticate"]
    assert "signed" in (await r.json())["error"]
    for method in ("PUT", "DELETE", "PATCH"):
        assert (await c.request(method, "/api/v1/fleet")).status == 401
    body = b'{"x": 1}'
    r = await c.post("/api/v1/echo", data=body, headers=signed(c, "/api/v1/echo", method="POST", body=body))
    assert r.status == 200 and (await r.json()) == {"written": True}
    # the body is covered (content-digest): another body under the same signature is refused
    r = await c.post("/api/v1/echo", data=b'{"x": 2}', headers=signed(c, "/api/v1/echo", method="POST", body=body))
    assert r.status == 401
    # a browser page of another site cannot write, even with a signature it somehow got
    r = await c.post("/api/v1/echo", data=body, headers={"Origin": "http://evil.example",
                                                        **signed(c, "/api/v1/echo", method="POST", body=body)})
    assert r.status == 403


async def test_a_signed_write_names_one_daemon(remote):
    """Issue 17, row 4: a write signed without ``gpusd-node`` was good for every daemon of the fleet
    (once each); one signed for another node is refused too."""
    d, c = remote
    body = b'{"x": 1}'
    for node in (None, "", "0123456789abcdef"):
        r = await c.post("/api/v1/echo", data=body,
                         headers=signed(c, "/api/v1/echo", method="POST", body=body, node_id=node))
        assert r.status == 401, node
        assert "gpusd-node" in (await r.json())["error"] or node, node
    r = await c.post("/api/v1/echo", data=body,
                     headers=signed(c, "/api/v1/echo", method="POST", body=body, node_id=d.node_id))
    assert r.status == 200
    # reads need no node id (docs/security.md): a signed read without one still verifies
    r = await c.get("/api/v1/gpus", headers=signed(c, "/api/v1/gpus"))
    assert r.status == 200 and "Signature" in r.headers


def test_a_loopback_authority_is_accepted_from_loopback_peers_only():
    """Issue 17, row 4: a request signed for ``localhost:4781`` (with or without a node id), sent
    from another machine, names that machine's loopback, not this daemon."""
    fp = "A" * 43  # the daemon's certificate, which a request over TLS covers (gpusd-cert)
    a = Access(TOKEN, own_addresses=lambda: ["198.18.0.2"], own_ports=lambda: [4781], node_id=lambda: "n1",
               cert_fp=lambda: fp)
    key = FleetKey(TOKEN)
    for authority in ("localhost:4781", "127.0.0.1:4781", "[::1]:4781"):
        for method, node in (("POST", "n1"), ("POST", None), ("GET", None)):
            url = f"https://{authority}/api/v1/leases"
            headers, _ = key.sign_request(method, url, body=b"{}", node_id=node, cert_fp=fp)
            req, why = a.verify(method, "https", authority, "/api/v1/leases", headers, b"{}", remote="198.18.0.7")
            assert req is None and "name this daemon" in str(why), (authority, method, node)
            headers, _ = key.sign_request(method, url, body=b"{}", node_id=node, cert_fp=fp)
            req, why = a.verify(method, "https", authority, "/api/v1/leases", headers, b"{}", remote="127.0.0.1")
            assert (req is not None) == (method == "GET" or node is not None), (authority, method, node, why)


async def test_no_writes_at_all_without_a_configured_token():
    d = FakeDaemon([sim_host("gpu-node-1")], token=None)
    c = await client_for(d, trust_loopback=True)
    try:
        r = await c.post("/api/v1/echo", json={})
        assert r.status == 405 and "GET" in r.headers["Allow"]
        # even from loopback, even signed: a daemon without a secret takes no writes
        r = await c.post("/api/v1/echo", data=b"{}", headers=signed(c, "/api/v1/echo", method="POST", body=b"{}"))
        assert r.status == 405
        # loopback readers see owners (they could run ps anyway)
        gpus = await (await c.get("/api/v1/gpus")).json()
        assert gpus[0]["processes"][0]["user"] == "alice"
    finally:
        await c.close()


def test_a_replay_after_the_wall_clock_steps_back_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 39, row 3: the daemon's wall clock stepped back 45 s, and a captured signed write replayed
    63 s after it was first accepted.  Before, it was accepted again (a second lease): its nonce was
    forgotten after 60 s of the monotonic clock, while its ``created`` was back inside the ±30 s window
    of the stepped wall clock.  Now a request created no later than a forgotten nonce's is refused;
    requests signed after the step still pass."""
    clock = {"wall": 1_800_000_000.0, "mono": 5_000.0}  # the daemon's clocks (an in-process seam)
    monkeypatch.setattr(time, "time", lambda: clock["wall"])
    monkeypatch.setattr(time, "monotonic", lambda: clock["mono"])
    a = Access(TOKEN, own_addresses=lambda: ["198.18.0.2"], own_ports=lambda: [4780], node_id=lambda: "n1")
    key = FleetKey(TOKEN)
    url = "http://198.18.0.2:4780/api/v1/leases"

    def verify(headers: dict[str, str]) -> tuple[Any, str | None]:
        return a.verify("POST", "http", "198.18.0.2:4780", "/api/v1/leases", headers, b"{}", remote="198.18.0.7")

    captured, _ = key.sign_request("POST", url, body=b"{}", node_id="n1")
    assert verify(captured)[0] is not None
    assert verify(captured)[0] is None  # replayed at once: the nonce is remembered
    clock["wall"] -= 45  # the step back
    for _ in range(63):  # a second passes, on both clocks; others keep writing meanwhile
        clock["wall"] += 1
        clock["mono"] += 1
        other, _ = key.sign_request("POST", url, body=b"{}", node_id="n1")
        req, why = verify(other)
        assert req is not None, why
    req, why = verify(captured)
    assert req is None and why is not None and "clock" in why, why
    fresh, _ = key.sign_request("POST", url, body=b"{}", node_id="n1")
    assert verify(fresh)[0] is not None
