"""The shape of discovery (issue 19, point 5): one options value both clients take, host sources
behind one protocol that all yield the one host record, and a source of one's own plugging in.
Everything on 127.0.0.1, in a session of its own."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from test_discovery import Recorder, announce, good_txt, http_peer, snapshot_json, sse

from daemon_helpers import GiB, fast_mdns, make_snapshot, unique_session  # noqa: F401
from gpusd.discovery.beyond import DnsSdInstance, PeerSpec
from gpusd.discovery.client import AsyncClient
from gpusd.discovery.fleetview import LocalFleetView
from gpusd.discovery.follower import Follower
from gpusd.discovery.mdns import MdnsSource
from gpusd.discovery.options import OPTION_NAMES, DiscoveryOptions
from gpusd.discovery.peers import StaticPeers
from gpusd.discovery.sync import Client
from gpusd.discovery.types import Filters, RemoteHost
from gpusd.discovery.widearea import WideAreaDnsSd
from gpusd.errors import ConfigError
from gpusd.wire.fleet import RECORD_FIELDS, HostRecord
from gpusd.wire.sse import format_event
from gpusd.wire.txt import SERVICE_TYPE, decode_txt

pytestmark = pytest.mark.usefixtures("fast_mdns")

BEYOND_ENV = ("GPUSD_PEERS", "GPUSD_PEERS_FILE", "GPUSD_DNS_SD_DOMAIN")


def keyword_defaults(fn: Any, leave_out: set[str]) -> dict[str, Any]:
    params = inspect.signature(fn).parameters
    return {n: p.default for n, p in params.items() if n not in {"self", *leave_out}}


# -- one options value --------------------------------------------------------------------------------
def test_both_clients_take_every_option_with_the_same_defaults() -> None:
    """The sync Client accepts every option the async one does (and the options value has), with the
    same defaults: a new option cannot be added to one and forgotten in the other."""
    options = {f.name: f.default for f in dataclasses.fields(DiscoveryOptions) if f.init}
    assert set(options) == set(OPTION_NAMES)
    # what belongs to one client only: an event loop's zeroconf and extra sources, a thread's daemon flag
    async_kw = keyword_defaults(AsyncClient.__init__, {"options", "zeroconf", "sources"})
    sync_kw = keyword_defaults(Client.__init__, {"options", "daemon_thread"})
    assert async_kw == options
    assert sync_kw == options
    assert "options" in inspect.signature(Client.__init__).parameters


def test_one_options_value_drives_both_clients(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in BEYOND_ENV:
        monkeypatch.delenv(var, raising=False)
    kw: dict[str, Any] = dict(session="lab", hostname="gpu-*", min_free_memory="20GiB", interfaces=["127.0.0.1"],
                              peers=["198.18.2.1:4781"], dns_sd_domain="lab.example", max_hosts=7)
    opts = DiscoveryOptions(**kw)
    assert opts.min_free_memory == 20 * GiB and opts.dns_sd_domain == "lab.example."
    assert opts.peer_specs == (PeerSpec("198.18.2.1", 4781),)
    # the keyword arguments build that value, in either client; a given value is taken as it is
    assert AsyncClient(**kw).options == opts
    assert Client(**kw).options == opts
    assert AsyncClient(options=opts).options is opts
    sync = Client(options=opts, daemon_thread=True)
    assert sync.options is opts and sync._async.options is opts  # the asyncio client it drives shares it
    assert AsyncClient(options=opts).filters == Filters(session="lab", hostname="gpu-*", min_free_memory=20 * GiB)
    with pytest.raises(TypeError, match="hostname"):
        AsyncClient(options=opts, hostname="other")
    with pytest.raises(TypeError):
        Client(options=opts, max_hosts=3)


def test_the_options_check_in_the_callers_thread_and_keep_no_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in BEYOND_ENV:
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ConfigError):
        Client(dns_sd_domain="local")  # the mDNS domain is no wide-area domain
    with pytest.raises(ConfigError):
        Client(peers=["[::1]:4780"])
    secret = "a-fleet-secret-of-32-characters!"
    opts = DiscoveryOptions(token=secret)
    assert opts.key is not None and opts.token is None
    assert secret not in repr(opts)
    assert Client(token=secret).options.key is not None


# -- the sources --------------------------------------------------------------------------------------
def check_record(host: Any, via: str) -> None:
    """The one host record: a RemoteHost is a HostRecord, and its wire form is the fleet view's."""
    assert type(host) is RemoteHost and isinstance(host, HostRecord)
    assert host.via == via
    assert set(host.record().to_dict()) == set(RECORD_FIELDS)
    assert type(host.record()) is HostRecord


async def test_each_source_yields_the_one_host_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in BEYOND_ENV:
        monkeypatch.delenv(var, raising=False)
    session = unique_session()
    node, name = "abcd000011112222", "srcs"
    snap = make_snapshot(1, hostname=name, node_id=node)

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "node_id": node})

    async def host(request: web.Request) -> web.Response:
        return web.json_response({"node_id": node, "hostname": name, "session": session, "gpusd_version": "0.3.0",
                                  "snapshot": snap.to_dict()})

    async def fleet(request: web.Request) -> web.Response:
        return web.json_response({"session": session, "hosts": [
            {"node_id": node, "hostname": name, "session": session, "source": "gpusd", "alive": True,
             "url": "http://127.0.0.1:9/api/v1", "snapshot": snap.to_dict()}]})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/api/v1/host", host)
    app.router.add_get("/api/v1/fleet", fleet)
    runner = web.AppRunner(app, shutdown_timeout=0.2)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    client = AsyncClient(session, interfaces=["127.0.0.1"])
    client.http = aiohttp.ClientSession()
    try:
        # static peers: what the daemon's public API says
        peers = StaticPeers([PeerSpec("127.0.0.1", port)])
        got = await peers.resolve(Follower(client, peers, f"peer:127.0.0.1:{port}", spec=PeerSpec("127.0.0.1", port)))
        check_record(got, "peer")
        assert (got.hostname, got.node_id, got.session, got.port) == (name, node, session, port)
        # wide-area DNS-SD: what the zone says
        txt = decode_txt(good_txt(node, name, session))
        inst = DnsSdInstance(f"{name}._gpusd._tcp.lab.example.", f"{name}.lab.example.", port, txt, ["127.0.0.1"], 60)
        wide = WideAreaDnsSd("lab.example.")
        got = await wide.resolve(Follower(client, wide, inst.name, spec=inst))
        check_record(got, "dns-sd")
        assert (got.hostname, got.addresses, got.port) == (name, ["127.0.0.1"], port)
        # mDNS: what the announcement says
        mdns = MdnsSource(["127.0.0.1"])
        await mdns.open(client)
        mdns.start(client)
        try:
            async with announce("srcs-abcd0000", good_txt(node, name, session), port):
                got = await mdns.resolve(Follower(client, mdns, f"srcs-abcd0000.{SERVICE_TYPE}"))
        finally:
            await mdns.stop()
        check_record(got, "mdns")
        assert (got.hostname, got.node_id, got.port) == (name, node, port)
        # a local daemon's fleet view: read once, the same records (and the devices)
        view = LocalFleetView(lambda: ([f"http://127.0.0.1:{port}/api/v1"], node), Filters(session=session))
        listing = await asyncio.to_thread(view.read)
        assert listing is not None
        [got] = listing.hosts
        check_record(got, "mdns")  # the daemon's own record says how it found the host
        assert [d.hostname for d in listing.devices] == [name] and listing.unmatched == 0
    finally:
        await client.http.close()
        await runner.cleanup()


class FakeSource:
    """A host source of a test's own: one instance, at a loopback event stream, gone on request."""

    via = "fake"

    def __init__(self, port: int, txt: dict[str, str]) -> None:
        self.port, self.txt = port, txt
        self.browsed = False
        self.client: AsyncClient | None = None
        self.stopped = False

    async def open(self, client: AsyncClient) -> None:
        pass

    def start(self, client: AsyncClient) -> None:
        self.client = client
        client.add("fake:one", self)
        self.browsed = True

    async def resolve(self, follower: Follower) -> RemoteHost | None:
        return follower.keep(RemoteHost(key=follower.name, txt=decode_txt(self.txt), addresses=["127.0.0.1"],
                                        port=self.port, via=self.via))

    def forget(self) -> None:
        assert self.client is not None
        follower = self.client.follower("fake:one")
        assert follower is not None
        self.client.drop(follower, "gone from the fake source")

    async def stop(self) -> None:
        self.stopped = True


async def test_a_source_of_ones_own_plugs_in(tmp_path: Path) -> None:
    """A source given to the client is followed like the built-in ones: its host's event stream, its
    devices, the events, and its removal when the source drops it."""
    session = unique_session()
    node, name = "feed000011112222", "faked"
    streams = 0

    async def events(request: web.Request) -> web.StreamResponse:
        nonlocal streams
        streams += 1
        return await sse(request, format_event("snapshot", snapshot_json(node, name)), hold=10)

    async with http_peer(events) as port:
        fake = FakeSource(port, good_txt(node, name, session))
        client = AsyncClient(session, interfaces=["127.0.0.1"], sources=[fake])
        rec = Recorder(client)
        await client.start_listening()
        try:
            assert await client.wait_settled(5)
            [added] = await rec.wait("host_added", name)
            assert added.host.via == "fake" and streams == 1
            assert [(h.hostname, h.via, h.alive) for h in client.hosts] == [(name, "fake", True)]
            assert [(d.hostname, d.via) for d in client.list_devices()] == [(name, "fake")]
            assert added.host.record().last_seen is not None  # heard from, as the fleet view would serve it
            fake.forget()
            [removed] = await rec.wait("host_removed", name)
            assert removed.data == {"reason": "gone from the fake source"} and client.hosts == []
        finally:
            await client.stop_listening()
        assert fake.stopped
    assert json.loads(json.dumps(added.to_dict()))["via"] == "fake"
