"""Privacy and access: who sees process owners and commands, and who may write."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from gpusd.daemon.access import Access, redact
from monitor_fakes import FakeDaemon, make_app, sim_host
from waiting import wait_until

TOKEN = "s3cret-token"


def private_values(payload: Any) -> list[Any]:
    """Every user/command value inside processes and leases."""
    out: list[Any] = []
    if isinstance(payload, dict):
        for k, v in payload.items():
            if k in ("processes", "leases") and isinstance(v, list):
                out += [e.get(f) for e in v for f in ("user", "command")]
            else:
                out += private_values(v)
    elif isinstance(payload, list):
        for v in payload:
            out += private_values(v)
    return out


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


def test_access_rules():
    from multidict import CIMultiDict

    a = Access(TOKEN)
    good, bad = CIMultiDict(Authorization=f"Bearer {TOKEN}"), CIMultiDict(Authorization="Bearer nope")
    assert a.may_see_private(good, "198.18.0.2")
    assert not a.may_see_private(bad, "198.18.0.2")
    assert not a.may_see_private(CIMultiDict(), "198.18.0.2")
    assert a.may_see_private(CIMultiDict(), "127.0.0.1") and a.may_see_private(CIMultiDict(), "::1")
    assert not Access(TOKEN, trust_loopback=False).may_see_private(CIMultiDict(), "127.0.0.1")
    assert not Access(None).may_see_private(CIMultiDict(Authorization="Bearer "), "198.18.0.2")
    own = Access(None, own_addresses=lambda: ["198.18.0.1"])  # the daemon reading itself over the LAN
    assert own.may_see_private(CIMultiDict(), "198.18.0.1") and not own.may_see_private(CIMultiDict(), "198.18.0.2")


async def test_remote_reader_without_token_sees_load_but_no_owners(remote):
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


async def test_remote_reader_with_token_sees_owners(remote):
    _, c = remote
    fleet = await (await c.get("/api/v1/fleet", headers={"Authorization": f"Bearer {TOKEN}"})).json()
    assert "alice" in private_values(fleet) and "python train.py --secret" in private_values(fleet)
    wrong = await (await c.get("/api/v1/fleet", headers={"Authorization": "Bearer guess"})).json()
    assert set(private_values(wrong)) == {None}


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
async def test_event_stream_is_redacted_without_token(remote, with_token):
    d, c = remote
    headers = {"Authorization": f"Bearer {TOKEN}"} if with_token else {}
    resp = await c.get("/api/v1/fleet/events", headers=headers)
    await wait_until(lambda: d.subscribers, 1.0, what="a subscriber")
    d.set_gpu(d.local, 0, utilization_gpu=77.0)
    data = await read_events(resp, "device_updated")
    assert data["gpu"]["utilization_gpu"] == 77.0
    proc = data["gpu"]["processes"][0]
    assert (proc["user"], proc["command"]) == (("alice", "python train.py --secret") if with_token else (None, None))
    resp.close()


async def test_writes_refused_without_token(remote):
    _, c = remote
    r = await c.post("/api/v1/echo", json={})
    assert r.status == 401
    assert "Bearer" in r.headers["WWW-Authenticate"]
    assert "token" in (await r.json())["error"]
    r = await c.post("/api/v1/echo", json={}, headers={"Authorization": "Bearer guess"})
    assert r.status == 401
    for method in ("PUT", "DELETE", "PATCH"):
        assert (await c.request(method, "/api/v1/fleet")).status == 401
    r = await c.post("/api/v1/echo", json={}, headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status == 200 and (await r.json()) == {"written": True}


async def test_no_writes_at_all_without_a_configured_token():
    d = FakeDaemon([sim_host("gpu-node-1")], token=None)
    c = await client_for(d, trust_loopback=True)
    try:
        r = await c.post("/api/v1/echo", json={})
        assert r.status == 405 and "GET" in r.headers["Allow"]
        # even from loopback: writes need the token
        r = await c.post("/api/v1/echo", json={}, headers={"Authorization": "Bearer anything"})
        assert r.status == 405
        # loopback readers see owners (they could run ps anyway)
        gpus = await (await c.get("/api/v1/gpus")).json()
        assert gpus[0]["processes"][0]["user"] == "alice"
    finally:
        await c.close()
