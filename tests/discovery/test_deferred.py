"""A client that defers snapshots (``AsyncClient.defer_snapshots``, what a daemon's fleet view does
while nobody streams its events): a host's later snapshots are parsed when the hosts are read, with the
same checks and the same events; a snapshot kept from one connection never counts under the next
one's proof."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from test_discovery import announce, client_for, good_txt, http_peer, sse

from daemon_helpers import fast_mdns, make_snapshot, unique_session, wait_until  # noqa: F401
from gpusd.discovery import client as client_mod
from gpusd.wire.sse import format_event
from gpusd.wire.txt import SERVICE_TYPE

pytestmark = pytest.mark.usefixtures("fast_mdns")

NODE = "dddd0001"


def snap(util: float, node: str = NODE) -> str:
    return make_snapshot(1, hostname="deferred", node_id=node, util=util).to_json()


async def test_later_snapshots_are_parsed_when_the_hosts_are_read(tmp_path: Path) -> None:
    session = unique_session()
    more = asyncio.Event()

    async def events(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(format_event("snapshot", snap(10.0)))
        await more.wait()
        await resp.write(format_event("snapshot", snap(50.0)) + format_event("snapshot", snap(90.0))
                         + format_event("snapshot", snap(70.0, node="eeee0002")))  # the last names another node
        await asyncio.sleep(30)
        return resp

    async with http_peer(events) as port, announce("deferred-dddd0001", good_txt(NODE, "deferred", session), port), \
            client_for(session) as (client, rec):
        client.defer_snapshots = lambda: True
        await rec.wait("device_added")
        peer = client.follower(f"deferred-dddd0001.{SERVICE_TYPE}")
        assert peer is not None
        more.set()
        await wait_until(lambda: peer.pending is not None and "eeee0002" in peer.pending)
        await asyncio.sleep(0.1)
        assert not rec.of("device_updated")  # nothing parsed on arrival
        assert peer.host is not None and peer.host.snapshot is not None
        assert peer.host.snapshot.gpus[0].utilization_gpu == 10.0
        # read: the newest snapshot is checked like one on arrival (another node's: skipped, logged),
        # so the host keeps what it had
        [host] = [h for h in client.hosts if h.node_id == NODE]
        assert host.snapshot is not None and host.snapshot.gpus[0].utilization_gpu == 10.0
        assert not rec.of("device_updated") and peer.pending is None


async def test_the_newest_kept_snapshot_is_reported_on_read(tmp_path: Path) -> None:
    session = unique_session()
    more = asyncio.Event()

    async def events(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(format_event("snapshot", snap(10.0)))
        await more.wait()
        await resp.write(format_event("snapshot", snap(50.0)) + format_event("snapshot", snap(90.0)))
        await asyncio.sleep(30)
        return resp

    async with http_peer(events) as port, announce("deferred-dddd0001", good_txt(NODE, "deferred", session), port), \
            client_for(session) as (client, rec):
        client.defer_snapshots = lambda: True
        await rec.wait("device_added")
        peer = client.follower(f"deferred-dddd0001.{SERVICE_TYPE}")
        assert peer is not None
        more.set()
        await wait_until(lambda: peer.pending is not None and '"utilization_gpu":90.0' in peer.pending)
        assert not rec.of("device_updated")
        devices = client.list_devices()  # read: parsed now, the newest only, its events emitted now
        assert [d.utilization for d in devices] == [90.0]
        [updated] = rec.of("device_updated")
        assert updated.changed == ("utilization_gpu",) and updated.previous is not None
        assert updated.previous.utilization == 10.0


async def test_a_snapshot_kept_from_one_connection_is_dropped_by_the_next(tmp_path: Path) -> None:
    """A snapshot received over one connection is believed as that connection's proof allows; the next
    connection may prove something else (or nothing): what the last one left unparsed is dropped."""
    session = unique_session()
    calls = 0

    async def events(request: web.Request) -> web.StreamResponse:
        nonlocal calls
        calls += 1
        if calls == 1:  # two snapshots in one write (the second kept unparsed), then the stream closes
            return await sse(request, format_event("snapshot", snap(10.0)) + format_event("snapshot", snap(90.0)),
                             hold=0.2)
        return await sse(request)  # the reconnection: accepted, nothing sent yet

    async with http_peer(events) as port, announce("deferred-dddd0001", good_txt(NODE, "deferred", session), port), \
            client_for(session) as (client, rec):
        client.defer_snapshots = lambda: True
        await rec.wait("device_added")
        peer = client.follower(f"deferred-dddd0001.{SERVICE_TYPE}")
        assert peer is not None
        await wait_until(lambda: calls >= 2, timeout=10)
        await wait_until(lambda: peer.pending is None)
        [host] = [h for h in client.hosts if h.node_id == NODE]
        assert host.snapshot is not None and host.snapshot.gpus[0].utilization_gpu == 10.0


async def test_a_large_fleet_view_parses_snapshots_when_read_and_live_while_streamed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon's fleet view beyond ``DEFER_ABOVE`` hosts: while nobody streams its events, a host's
    later snapshots wait unparsed and the answer (``GET /api/v1/fleet``) still shows the newest; while a
    reader streams them, each is parsed on arrival and its events go out."""
    from gpusd.daemon import fleet as fleet_mod
    from gpusd.daemon.config import DaemonConfig
    from gpusd.daemon.fleet import Fleet

    monkeypatch.setattr(fleet_mod, "DEFER_ABOVE", 0)  # a fleet of one host counts as large here
    session = unique_session()
    utils = asyncio.Queue[float]()

    async def events(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(format_event("snapshot", snap(10.0)))
        while True:
            await resp.write(format_event("snapshot", snap(await utils.get())))

    fleet = Fleet(DaemonConfig(session=session, interfaces=["127.0.0.1"], fleet="on", peers=[]), None,
                  allow_loopback=True)
    async with http_peer(events) as port, announce("deferred-dddd0001", good_txt(NODE, "deferred", session), port):
        try:
            await fleet.ensure_started(settle=0.1)
            client = fleet.client
            assert client is not None
            await wait_until(lambda: client.follower(f"deferred-dddd0001.{SERVICE_TYPE}") is not None, 10)
            peer = client.follower(f"deferred-dddd0001.{SERVICE_TYPE}")
            assert peer is not None
            await wait_until(lambda: peer.reported, 10)

            def shown(document: Any) -> float:
                [host] = [h for h in document["hosts"] if h["node_id"] == NODE]
                return float(host["snapshot"]["gpus"][0]["utilization_gpu"])

            utils.put_nowait(50.0)
            await wait_until(lambda: peer.pending is not None)  # kept, not parsed
            # GET /api/v1/fleet: each host as last parsed, at most REPARSE s older than the newest received
            assert shown(json.loads(fleet.answer())) == 10.0
            monkeypatch.setattr(client_mod, "REPARSE", 0.0)  # the last parse is old enough now: the kept one is
            await wait_until(lambda: peer.pending is None, 10)  # parsed by the view's own timer, not by an answer
            assert shown(json.loads(fleet.answer())) == 50.0
            utils.put_nowait(70.0)  # ... and a new one on arrival
            await wait_until(lambda: shown(json.loads(fleet.answer())) == 70.0)
            assert peer.pending is None

            # a read that catches up (the pool's fleet-wide cap, a stream's replay) parses what is kept
            monkeypatch.setattr(client_mod, "REPARSE", 60.0)
            utils.put_nowait(80.0)
            await wait_until(lambda: peer.pending is not None)
            assert shown(json.loads(fleet.answer())) == 70.0
            assert shown(fleet.to_dict()) == 80.0 and peer.pending is None

            sub = fleet.hub.subscribe()  # a reader streams the fleet's events: parsed on arrival again
            utils.put_nowait(90.0)
            message = await asyncio.wait_for(sub.queue.get(), 10)
            assert message is not None and b"device_updated" in message and b'"utilization_gpu":90.0' in message
            assert peer.pending is None
        finally:
            await fleet.stop()


def test_the_fleet_answers_bytes_are_its_document() -> None:
    """``FleetView.to_json`` (what ``GET /api/v1/fleet`` sends, each snapshot encoded once) is the
    document ``to_dict`` describes, strict JSON, whatever the hosts hold."""
    import math

    from gpusd.model import LeaseInfo
    from gpusd.wire.fleet import FleetView, HostHeads, HostRecord, host_json

    odd = make_snapshot(2, hostname='q"u\\ote\u00e9\x01', node_id="n2")
    odd.gpus[0].power_draw = math.nan  # never sent as NaN
    odd.gpus[1].leases = [LeaseInfo(lease_id="l1", pid=7, user="bob", command="python train.py \u2603")]
    view = FleetView(session="s", hosts_dropped=3, hosts=[
        HostRecord(hostname="a", node_id="n1", snapshot=make_snapshot(1, hostname="a", node_id="n1"), session="s",
                   url="http://198.18.0.1:4780/api/v1", last_seen=1.5, verified=True, via="dns-sd"),
        HostRecord(hostname='q"u\\ote\u00e9\x01', node_id="n2", snapshot=odd, session="s", alive=False,
                   last_seen=2.25, verified=False),
        HostRecord(hostname="hw", node_id="n3", source="hwsd"),  # no snapshot
    ])
    calls: list[str] = []
    heads = HostHeads()  # the fleet view's: each head's unchanging fields kept encoded

    def cached(h: Any) -> bytes:
        calls.append(h.node_id)
        snap = None if h.snapshot is None else json.dumps(h.snapshot.to_dict(), separators=(",", ":"),
                                                          allow_nan=False).encode()
        return host_json(h, heads, snap)

    fresh = view.to_json()
    for body in (fresh, view.to_json(cached), view.to_json(cached)):
        assert json.loads(body, parse_constant=lambda c: pytest.fail(f"{c} in the answer")) == json.loads(
            json.dumps(view.to_dict()))
        assert body == fresh  # the kept parts give the very bytes encoding afresh gives
        heads.rotate()
    assert calls == ["n1", "n2", "n3"] * 2
    view.hosts[0].last_seen, view.hosts[0].alive, view.hosts[0].url = 9.75, False, "http://198.18.0.9:4780/api/v1"
    assert view.to_json(cached) == view.to_json()  # what changed is written anew
