"""The discovery client in-process on 127.0.0.1: events and diffs, filters, liveness, hostile
announcements and hostile HTTP peers, hwsd hosts, the synchronous ``Client``."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web

from daemon_helpers import (  # noqa: F401
    FakeBackend,
    GiB,
    fast_mdns,
    make_snapshot,
    running_daemon,
    unique_session,
    wait_until,
)
from gpusd.discovery.client import AsyncClient
from gpusd.discovery.types import DiscoveryEvent
from gpusd.model import GpuInfo
from gpusd.wire.sse import format_event
from gpusd.wire.txt import HWSD_TYPE, SERVICE_TYPE, encode_txt
from waiting import wait_until_sync

pytestmark = pytest.mark.usefixtures("fast_mdns")


class Recorder:
    def __init__(self, client: AsyncClient) -> None:
        self.events: list[DiscoveryEvent] = []
        client.register_event_handler("*", self.events.append)

    def of(self, kind: str, host: str | None = None) -> list[DiscoveryEvent]:
        return [e for e in self.events if e.event == kind and (host is None or e.hostname == host)]

    async def wait(self, kind: str, host: str | None = None, n: int = 1, timeout: float = 5.0) -> list[DiscoveryEvent]:
        await wait_until(lambda: len(self.of(kind, host)) >= n, timeout)
        return self.of(kind, host)


@asynccontextmanager
async def client_for(session: str | None, **kw: Any) -> AsyncIterator[tuple[AsyncClient, Recorder]]:
    client = AsyncClient(session=session, interfaces=["127.0.0.1"], **kw)
    rec = Recorder(client)
    await client.start_listening()
    try:
        yield client, rec
    finally:
        await client.stop_listening()


async def test_added_updated_removed(tmp_path: Path) -> None:
    session = unique_session()
    backend = FakeBackend(make_snapshot(2, hostname="n1"))
    async with running_daemon(tmp_path, session, "n1", backend=backend) as d, client_for(session) as (client, rec):
        await rec.wait("device_added", n=2)
        assert [e.event for e in rec.events[:3]] == ["host_added", "device_added", "device_added"]
        host = client.hosts[0]
        assert host.hostname == "n1" and host.node_id == d.node_id and host.alive and host.url == d.urls[0]
        assert [dev.index for dev in client.list_devices()] == [0, 1]
        # nothing changes: no device_updated
        await asyncio.sleep(0.5)
        assert not rec.of("device_updated")
        # a value changes: one device_updated, naming the field
        backend.snap.gpus[1].memory_used = 9 * GiB
        [ev] = await rec.wait("device_updated")
        assert ev.device is not None and ev.device.index == 1 and "memory_used" in ev.changed
        assert ev.previous is not None and ev.previous.memory_used == 0 and ev.device.memory_used == 9 * GiB
        # a GPU appears, one disappears
        backend.snap.gpus.append(GpuInfo(index=2, uuid="GPU-new", name="NVIDIA T4", memory_total=16 * GiB))
        ev = (await rec.wait("device_added", n=3))[-1]
        assert ev.device is not None and ev.device.uuid == "GPU-new"
        backend.snap.gpus.pop(0)
        [ev] = await rec.wait("device_removed")
        assert ev.device is not None and ev.device.uuid == "GPU-n1-0"
        # clean stop: bye + goodbye -> host_removed at once (devices first)
        t = time.monotonic()
        await d.stop()
        await rec.wait("host_removed", timeout=5)
        assert time.monotonic() - t < 5.0  # the goodbye, well before the 6 s silence limit
        assert len(rec.of("device_removed")) == 3 and rec.events[-1].event == "host_removed"
        assert client.hosts == [] and client.list_devices() == []


async def test_filters_and_sessions(tmp_path: Path) -> None:
    s1, s2 = unique_session("a"), unique_session("b")
    big = FakeBackend(make_snapshot(2, hostname="big", name="NVIDIA H100 80GB HBM3"))
    async with running_daemon(tmp_path, s1, "big", backend=big), \
            running_daemon(tmp_path, s1, "small", n=1), running_daemon(tmp_path, s2, "other", n=3):
        async with client_for(s1) as (c, rec):
            await c.wait_settled(5)
            assert sorted(h.hostname for h in c.hosts) == ["big", "small"]
        async with client_for(s1, model="h100") as (c, rec):
            await c.wait_settled(5)
            assert {d.hostname for d in c.list_devices()} == {"big"}
        async with client_for(s1, hostname="sm*") as (c, rec):
            await c.wait_settled(5)
            assert [h.hostname for h in c.hosts] == ["small"]
        async with client_for(None, all_sessions=True) as (c, rec):
            await c.wait_settled(5)
            names = {h.hostname for h in c.hosts}
            assert {"big", "small", "other"} <= names
        async with client_for(s1, min_free_memory="60GiB", hostname="big") as (c, rec):
            await rec.wait("device_added", n=2)
            big.snap.gpus[0].memory_used = 30 * GiB  # 50 GiB free: no longer qualifies
            big.snap.gpus[0].memory_free = 50 * GiB
            [ev] = await rec.wait("device_removed")
            assert ev.device is not None and ev.device.index == 0
            big.snap.gpus[0].memory_used, big.snap.gpus[0].memory_free = 0, 80 * GiB
            await rec.wait("device_added", n=3)


async def test_same_hostname_both_appear(tmp_path: Path) -> None:
    session = unique_session()
    async with running_daemon(tmp_path / "a", session, "twin") as d1, \
            running_daemon(tmp_path / "b", session, "twin") as d2, client_for(session) as (c, rec):
        await rec.wait("host_added", n=2)
        assert sorted(h.node_id for h in c.hosts) == sorted([d1.node_id, d2.node_id])
        assert len(c.list_devices()) == 4


async def test_txt_updates_reach_the_client(tmp_path: Path) -> None:
    session = unique_session()
    backend = FakeBackend(make_snapshot(2, hostname="busy"))
    async with running_daemon(tmp_path, session, "busy", backend=backend, txt_min_interval=0.2), \
            client_for(session) as (c, rec):
        await rec.wait("host_added")
        assert c.hosts[0].txt.free == 2
        backend.snap.gpus[0].utilization_gpu = 99.0
        await wait_until(lambda: c.hosts[0].txt.free == 1, timeout=5)


# -- fake peers: announced with python-zeroconf, served by a hand-made aiohttp app ---------------------
@asynccontextmanager
async def announce(name: str, txt: bytes | dict[str, str], port: int, type_: str = SERVICE_TYPE) -> AsyncIterator[None]:
    from zeroconf import ServiceInfo
    from zeroconf.asyncio import AsyncZeroconf

    zc = AsyncZeroconf(interfaces=["127.0.0.1"])
    info = ServiceInfo(type_, f"{name}.{type_}", port=port, properties=txt, server=f"{name}.local.",
                       parsed_addresses=["127.0.0.1"])
    await (await zc.async_register_service(info))
    try:
        yield
    finally:
        await (await zc.async_unregister_service(info))
        await zc.async_close()


@asynccontextmanager
async def http_peer(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> AsyncIterator[int]:
    app = web.Application()
    app.router.add_get("/api/v1/events", handler)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield port
    finally:
        await runner.cleanup()


def txt_bytes(items: list[bytes]) -> bytes:
    return b"".join(bytes([len(i)]) + i for i in items)


def good_txt(node: str, host: str, session: str, n: int = 1) -> dict[str, str]:
    return encode_txt(node_id=node, hostname=host, session=session, inventory=[("A100", 81920)] * n, free=n)


def snapshot_json(node: str, host: str) -> str:
    s = make_snapshot(1, hostname=host, node_id=node)
    return s.to_json()


async def sse(request: web.Request, *chunks: bytes, hold: float = 30.0) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for c in chunks:
        await resp.write(c)
    await asyncio.sleep(hold)
    return resp


async def test_liveness_of_a_silent_host(tmp_path: Path) -> None:
    """A host that stops talking (power loss, cable pulled) is removed within the liveness bound,
    although its mDNS records stay cached."""
    session = unique_session()
    calls = 0

    async def frozen(request: web.Request) -> web.StreamResponse:
        nonlocal calls
        calls += 1
        if calls == 1:  # first connection: a snapshot, then silence
            return await sse(request, format_event("snapshot", snapshot_json("aaaa0001", "frozen")))
        return await sse(request)  # reconnections: accepted, never answered

    async with http_peer(frozen) as port, announce("frozen-aaaa0001", good_txt("aaaa0001", "frozen", session), port), \
            client_for(session, liveness_timeout=2.0) as (c, rec):
        [added] = await rec.wait("host_added")
        t = time.monotonic()
        await rec.wait("host_removed", timeout=8)
        took = time.monotonic() - t
        assert 1.0 < took < 6.0, took  # after the silence limit (1.2 s here), not at once
        assert calls == 2  # one reconnection attempt


async def test_hostile_peers_are_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    session = unique_session("hostile")

    async def not_sse(request: web.Request) -> web.StreamResponse:
        return web.Response(text="<html>hello</html>", content_type="text/html")

    async def garbage(request: web.Request) -> web.StreamResponse:
        return await sse(request, b"event: snapshot\ndata: {not json\n\n", hold=1)

    async def liar(request: web.Request) -> web.StreamResponse:  # the snapshot names another node
        return await sse(request, format_event("snapshot", snapshot_json("ffffffff", "liar")), hold=1)

    async def endless(request: web.Request) -> web.StreamResponse:  # one line that never ends
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(80):
            await resp.write(b"data: " + b"x" * 65536)
        await asyncio.sleep(2)
        return resp

    async def future(request: web.Request) -> web.StreamResponse:
        d = json.loads(snapshot_json("cccc0001", "future"))
        d["schema"] = 2
        return await sse(request, format_event("snapshot", d), hold=1)

    txts: list[tuple[str, bytes | dict[str, str], Any]] = [
        ("v2-x1", {**good_txt("dddd0001", "v2", session), "v": "2"}, not_sse),
        ("lying-count-x1", {**good_txt("dddd0002", "lying", session), "n": "5"}, not_sse),
        ("binary-x1", b"\x05v=1\x00\xff\x20" + b"\x07\xfe\xfd\xfc=\x01\x02", not_sse),
        ("badutf8-x1", txt_bytes([b"v=1", b"id=dddd0003", b"n=0", b"session=" + session.encode(),
                                  b"host=\xff\xfe"]), not_sse),
        ("missing-x1", {"v": "1", "id": "dddd0004", "n": "0", "session": session}, not_sse),
        ("nothttp-x1", good_txt("bbbb0001", "nothttp", session), not_sse),
        ("garbage-x1", good_txt("bbbb0002", "garbage", session), garbage),
        ("liar-x1", good_txt("bbbb0003", "liar", session), liar),
        ("endless-x1", good_txt("bbbb0004", "endless", session), endless),
        ("future-x1", good_txt("cccc0001", "future", session), future),
    ]
    async with running_daemon(tmp_path, session, "honest"):
        from contextlib import AsyncExitStack

        async with AsyncExitStack() as stack:
            for name, txt, handler in txts:
                port = await stack.enter_async_context(http_peer(handler))
                await stack.enter_async_context(announce(name, txt, port))
            async with client_for(session) as (c, rec):
                await c.wait_settled(8)
                await asyncio.sleep(1.0)
                assert [h.hostname for h in c.hosts] == ["honest"]
                assert [e.hostname for e in rec.of("host_added")] == ["honest"]
                assert c.listening
    text = caplog.text
    for needle in ("version", "n=5", "UTF-8", "missing", "past the end", "text/html", "not JSON", "names node",
                   "longer than", "unsupported snapshot schema"):
        assert needle in text, needle


async def test_hwsd_hosts_are_listed_and_compat_records_not_doubled(tmp_path: Path) -> None:
    session = unique_session("hw")
    hw = {"Session": session, "NodeID": "hw-0001", "Hostname": "viz-1", "GPU Count": "2",
          "GPU0 Type": "GLX\x00", "GPU0 Port": "0", "GPU0 Device": "0",
          "GPU1 Type": "GLX\x00", "GPU1 Port": "0", "GPU1 Device": "1"}
    async with announce("viz-1", hw, 4242, type_=HWSD_TYPE), \
            running_daemon(tmp_path, session, "compat", gpusd_compat=True) as d:  # noqa: F841
        assert d.announcer is not None and d.announcer.hwsd_info is not None
        async with client_for(session) as (c, rec):
            await c.wait_settled(5)
            hosts = {h.hostname: h for h in c.hosts}
            assert set(hosts) == {"viz-1", "compat"}
            assert hosts["viz-1"].source == "hwsd" and hosts["compat"].source == "gpusd"
            devs = [dv for dv in c.list_devices() if dv.hostname == "viz-1"]
            assert [dv.name for dv in devs] == ["GLX :0.0", "GLX :0.1"] and not devs[0].live
        # what an hwsd client sees of us
        from zeroconf.asyncio import AsyncServiceInfo

        info = AsyncServiceInfo(HWSD_TYPE, d.announcer.hwsd_info.name)
        assert await info.async_request(d.zc.zeroconf, 3000)
        props = info.decoded_properties
        assert props["GPU Count"] == "2" and props["GPU1 Type"] == "GLX" and props["GPU1 Device"] == "1"
        assert props["Session"] == session and props["NodeID"] == d.node_id and info.port == 4242


def test_sync_client(tmp_path: Path) -> None:
    session = unique_session("sync")
    started = threading.Event()
    stop = threading.Event()
    box: dict[str, Any] = {}

    async def serve() -> None:
        async with running_daemon(tmp_path, session, "s1", n=3) as d:
            box["daemon"] = d
            started.set()
            while not stop.is_set():
                await asyncio.sleep(0.05)

    t = threading.Thread(target=lambda: asyncio.run(serve()))
    t.start()
    try:
        assert started.wait(20)
        import gpisd  # the seed name

        client = gpisd.Client(session=session, interfaces=["127.0.0.1"])
        seen: list[str] = []
        threads: set[str] = set()

        def on_added(ev: DiscoveryEvent) -> None:
            threads.add(threading.current_thread().name)
            seen.append(str(ev.device))

        client.register_event_handler("device_added", on_added)
        with pytest.raises(ValueError):
            client.register_event_handler("no_such_event", on_added)
        client.start_listening()
        try:
            assert client.wait_settled(5)
            wait_until_sync(lambda: len(seen) >= 3, 5)
            assert len(seen) == 3 and threads == {"gpusd-events"}
            assert [d.index for d in client.list_devices()] == [0, 1, 2]
            assert [h.hostname for h in client.hosts] == ["s1"]
            assert [h.hostname for h in client.scan(0.5)] == ["s1"]
        finally:
            client.stop_listening()
        assert not client.listening
        # list_devices on a client that is not listening starts, settles, and answers
        other = gpisd.Client(session=session, interfaces=["127.0.0.1"], daemon_thread=True)
        try:
            assert len(other.list_devices(timeout=5)) == 3
        finally:
            other.stop_listening()
    finally:
        stop.set()
        t.join(20)


def test_addresses_are_tried_best_first(monkeypatch: pytest.MonkeyPatch) -> None:
    import ipaddress

    from gpusd.wire import mdns as net

    monkeypatch.setattr(net, "_local_networks", lambda: [ipaddress.IPv4Network("10.1.0.0/16"),
                                                         ipaddress.IPv4Network("127.0.0.0/8")])
    ranked = net.rank_addresses(["127.0.0.1", "169.254.3.4", "172.17.0.1", "10.1.2.3"])
    assert ranked == ["10.1.2.3", "172.17.0.1", "127.0.0.1", "169.254.3.4"]
