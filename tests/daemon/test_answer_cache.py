"""The daemon's answers are built once per sample and redaction level: a cached private
body never reaches a public reader, and a new sample is served at once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from daemon_helpers import (  # noqa: F401
    FakeBackend,
    fast_mdns,
    make_snapshot,
    private_values,
    running_daemon,
    unique_session,
)
from gpusd.daemon.access import Access
from gpusd.daemon.http import Answers
from gpusd.daemon.routes import RouteDef, add_routes, install_access
from gpusd.model import LeaseInfo, ProcessInfo
from waiting import wait_until

pytestmark = pytest.mark.usefixtures("fast_mdns")

SECRET = "answer-cache-fleet-secret-0123456789"


def with_owners(snap: Any) -> Any:
    for g in snap.gpus:
        g.processes = [ProcessInfo(pid=4242, used_memory=2**30, user="alice", command="python train.py --secret")]
        g.leases = [LeaseInfo(lease_id="l1", pid=4242, user="alice", command="python train.py --secret",
                              device=g.uuid)]
    return snap


def test_one_body_per_level_built_once_per_snapshot() -> None:
    answers, built = Answers(), []
    snap = with_owners(make_snapshot(2))

    def build() -> Any:
        built.append(1)
        return [g.to_dict() for g in snap.gpus]

    private = answers.get(snap, "gpus", True, build)
    public = answers.get(snap, "gpus", False, build)
    assert "alice" in private_values(json.loads(private))
    assert set(private_values(json.loads(public))) == {None}  # the public level after a private read
    assert answers.get(snap, "gpus", False, build) is public and answers.get(snap, "gpus", True, build) is private
    assert len(built) == 2  # once per level, not per request
    snap2 = with_owners(make_snapshot(2))
    assert answers.get(snap2, "gpus", False, build) is not public and len(built) == 3  # a new sample: rebuilt


async def test_a_public_reader_after_a_private_read_gets_no_owners(tmp_path: Path) -> None:
    snap = with_owners(make_snapshot(2, hostname="cache-host"))
    backend = FakeBackend(snap)
    async with running_daemon(tmp_path, unique_session("cache"), "cache-host", backend=backend, token=SECRET,
                              tls=False) as d:
        base = f"http://127.0.0.1:{d.port}"
        async with aiohttp.ClientSession() as s:
            for path in ("/api/v1/gpus", "/api/v1/host"):
                for round_ in range(2):  # private, public, private, public: each from the cache after the first
                    async with s.get(base + path) as r:  # a loopback reader naming this daemon: private
                        mine = await r.json()
                    assert "alice" in private_values(mine), (path, round_)
                    # the same bytes were just served privately; a rebound name is a public reader
                    async with s.get(base + path, headers={"Host": "evil.example"}) as r:
                        text = await r.text()
                    assert "alice" not in text and "secret" not in text, (path, round_)
                    assert private_values(json.loads(text)) and set(private_values(json.loads(text))) == {None}
            # a new sample is served at once, at both levels
            backend.snap.gpus[0].utilization_gpu = 77
            await wait_until(lambda: d.snapshot.gpus[0].utilization_gpu == 77)
            async with s.get(base + "/api/v1/gpus", headers={"Host": "evil.example"}) as r:
                assert (await r.json())[0]["utilization_gpu"] == 77
            async with s.get(base + "/api/v1/gpus") as r:
                assert (await r.json())[0]["utilization_gpu"] == 77
            async with s.get(base + "/healthz") as r:
                health = await r.json()
            assert health["ok"] is True and health["node_id"] == d.node_id and health["uptime"] >= 0


async def test_the_middleware_never_remembers_a_private_body_as_clean() -> None:
    """A handler serving one bytes object with owners (a cache gone wrong) is redacted on every
    public request: only bodies without private values are remembered as checked (the access
    rules' check, applied to every route)."""
    body = json.dumps([{"processes": [{"pid": 1, "user": "alice", "command": "x" * 600}]}]).encode()
    assert len(body) > 512

    async def leaky(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    app = web.Application()
    install_access(app, Access(None, trust_loopback=False))
    add_routes(app, [RouteDef("GET", "/leaky", leaky)])
    client = TestClient(TestServer(app, host="127.0.0.1"))
    await client.start_server()
    try:
        for _ in range(3):
            text = await (await client.get("/leaky")).text()
            assert "alice" not in text and json.loads(text)[0]["processes"][0]["user"] is None
    finally:
        await client.close()


def test_one_redaction_per_event_never_another_events() -> None:
    """The hub hands one bytes object to every reader: its redaction is made once, and a different
    event never gets it."""
    from gpusd.daemon.access import redact_event
    from gpusd.wire.sse import format_event

    first = format_event("snapshot", {"gpus": [{"index": 0, "processes": [{"pid": 1, "user": "alice",
                                                                         "command": "a --secret"}]}]})
    second = format_event("snapshot", {"gpus": [{"index": 1, "processes": [{"pid": 2, "user": "bob",
                                                                         "command": "b --secret"}]}]})
    one = redact_event(first)
    assert redact_event(first) is one and b"alice" not in one and b"secret" not in one and b'"pid":1' in one
    two = redact_event(second)
    assert b"bob" not in two and b'"pid":2' in two and b'"index":1' in two and b'"pid":1' not in two
    assert redact_event(bytes(bytearray(first))) == one  # equal bytes, another object: made again, the same
