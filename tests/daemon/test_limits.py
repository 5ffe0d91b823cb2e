"""Issue 17, row 3: strangers cannot starve the fleet.  Event-stream readers and HTTP connections
without a signature get a share per peer address and cannot take the share kept for secret holders;
a secret holder's stream or connection always gets in while strangers hold places (docs/daemon.md,
"Limits against hostile peers").  On 127.0.0.1 only; other loopback addresses (127.0.0.x) stand for
other peers."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from daemon_helpers import LOOPBACK, fast_mdns, running_daemon, unique_session  # noqa: F401
from gpusd.daemon.events import EventHub, HubFull
from gpusd.wire.signing import FleetKey

SECRET = secrets.token_hex(32)


class Conn:
    """One raw HTTP connection from a chosen loopback address, drained in the background."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.status = 0
        self.closed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def request(self, port: int, path: str, signed: bool, timeout: float = 10.0) -> int:
        url = f"http://127.0.0.1:{port}{path}"
        headers = {"Host": f"127.0.0.1:{port}"}
        if signed:
            headers.update(FleetKey(SECRET).sign_request("GET", url)[0])
        head = f"GET {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
        self.writer.write(head.encode())
        try:
            line = await asyncio.wait_for(self.reader.readline(), timeout)
        except (ConnectionError, asyncio.TimeoutError):
            line = b""
        self.status = int(line.split()[1]) if line.startswith(b"HTTP/1.1 ") else 0
        self._task = asyncio.ensure_future(self._drain())
        return self.status

    async def _drain(self) -> None:
        try:
            while await self.reader.read(65536):
                pass
        except (ConnectionError, OSError):
            pass
        self.closed.set()

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.writer.close()


async def connect(port: int, source: str) -> Conn:
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0)), 10)
    return Conn(reader, writer)


async def stream(port: int, source: str, signed: bool = False, path: str = "/api/v1/events") -> Conn:
    c = await connect(port, source)
    await c.request(port, path, signed)
    return c


@asynccontextmanager
async def held(conns: list[Conn]) -> AsyncIterator[list[Conn]]:
    try:
        yield conns
    finally:
        for c in conns:
            c.close()


def test_event_hub_shares_per_peer_and_for_signed_readers() -> None:
    hub = EventHub(max_subscribers=6, per_peer=2, reserved=2)
    a1, _ = hub.subscribe("198.18.0.5"), hub.subscribe("198.18.0.5")
    with pytest.raises(HubFull, match="198.18.0.5"):
        hub.subscribe("198.18.0.5")  # one peer: its share
    hub.subscribe("198.18.0.6"), hub.subscribe("198.18.0.6")
    with pytest.raises(HubFull):
        hub.subscribe("198.18.0.7")  # unsigned readers hold 4 of 6: the rest is kept for signed ones
    s1, _ = hub.subscribe("198.18.0.9", signed=True), hub.subscribe("198.18.0.9", signed=True)
    assert len(hub) == 6
    s3 = hub.subscribe("198.18.0.9", signed=True)  # full: the oldest unsigned reader of the heaviest peer goes
    assert a1.evicted and a1.queue.get_nowait() is None and len(hub) == 6 and hub.evicted == 1
    for _ in range(3):
        hub.subscribe("198.18.0.9", signed=True)
    with pytest.raises(HubFull):
        hub.subscribe("198.18.0.9", signed=True)  # every place signed: only then is a signed reader refused
    assert not s1.evicted and not s3.evicted
    hub.unsubscribe(s1)
    assert not hub.subscribe("198.18.0.7").evicted  # a freed place: unsigned readers hold none of their share


async def test_300_unsigned_streams_do_not_hide_a_verified_host(tmp_path: Path, fast_mdns: Any) -> None:  # noqa: F811
    """The attack of row 3: a stranger holds 300 unsigned ``/api/v1/events`` streams (from ten
    addresses, 30 each, within each address's share); a secret holder still lists the host as
    verified and reserves a GPU on it."""
    from gpusd.discovery.client import AsyncClient
    from gpusd.pool.client import reserve

    session = unique_session("flood")
    key = FleetKey(SECRET)
    async with running_daemon(tmp_path, session, "victim", token=SECRET, simulate="2xA100-80GB",
                              interval=1.0) as d:
        conns = []
        for i in range(300):
            conns.append(await stream(d.port, f"127.0.0.{11 + i % 10}"))
        async with held(conns):
            accepted = sum(c.status == 200 for c in conns)
            assert accepted >= 150 and len(d.events) == accepted, (accepted, len(d.events))
            client = AsyncClient(session=session, interfaces=LOOPBACK, key=key)
            try:
                await client.wait_settled(8)
                hosts = {h.hostname: h for h in client.hosts}
                assert "victim" in hosts and hosts["victim"].verified is True, hosts
                assert hosts["victim"].snapshot is not None
            finally:
                await client.stop_listening()
            res = await asyncio.to_thread(reserve, 1, key=key, session=session, interfaces=LOOPBACK, ttl=10)
            try:
                assert res.host == "victim" and len(res.parts[0].devices) == 1
            finally:
                await asyncio.to_thread(res.release)
            # and none of the stranger's streams had to end for it (it took a place kept for signed readers)
            assert d.events.evicted == 0
            assert sum(c.status == 200 and not c.closed.is_set() for c in conns) >= accepted - 2  # 2: a slow one


async def test_a_signed_connection_gets_in_while_strangers_hold_every_other_place(tmp_path: Path) -> None:
    """The HTTP connection cap: strangers' connections (event streams: busy, never idle) are held to
    a share per peer and to the cap less the signed share; a secret holder's connection beyond the
    cap is kept, and a stranger's connection of the heaviest peer is closed for it."""
    async with running_daemon(tmp_path, unique_session("conns"), "conns", token=SECRET, tls=False,
                              max_connections=8, reserved_connections=4, max_connections_per_peer=3,
                              max_subscribers=100, reserved_subscribers=0) as d:
        guard = d.guard
        assert guard is not None
        a = [await stream(d.port, "127.0.0.21") for _ in range(5)]
        async with held(a):
            # one peer: 3 connections; beyond, a connection is let in only for a signed request
            assert [c.status for c in a] == [200, 200, 200, 503, 503]
            b = [await stream(d.port, "127.0.0.22") for _ in range(2)]
            async with held(b):
                # strangers hold 4 places of 8 (the other 4 are kept for signed connections)
                assert [c.status for c in b] == [200, 503] and guard.unsigned == 4
                ours = [await stream(d.port, "127.0.0.1", signed=True) for _ in range(4)]
                async with held(ours):
                    assert [c.status for c in ours] == [200] * 4 and guard.count == 8
                    # every place is held; one more secret holder: the oldest stream of the heaviest
                    # stranger (127.0.0.21) is closed for it
                    one_more = await stream(d.port, "127.0.0.1", signed=True)
                    async with held([one_more]):
                        assert one_more.status == 200
                        await asyncio.wait_for(a[0].closed.wait(), 10)
                        assert not any(c.closed.is_set() for c in ours)
                        assert guard.count == 8 and guard.evicted_unsigned == 1
                        # a stranger's new connection is not served now
                        late = await stream(d.port, "127.0.0.23")
                        async with held([late]):
                            assert late.status == 503
                        # a signed plain request is, at once
                        q = await stream(d.port, "127.0.0.24", signed=True, path="/api/v1/gpus")
                        async with held([q]):
                            assert q.status == 200


async def test_connections_parked_on_probation_do_not_keep_a_secret_holder_out(tmp_path: Path) -> None:
    """A stranger whose extra connections are on probation keeps them alive with requests the access
    layer refuses before the guard hears of them (an ``Authorization`` header: 401); a secret holder
    still gets in, the oldest parked connection being closed for it."""
    async with running_daemon(tmp_path, unique_session("park"), "park", token=SECRET, tls=False,
                              max_connections=8, reserved_connections=4, max_connections_per_peer=8,
                              max_subscribers=100, reserved_subscribers=0) as d:
        streams = [await stream(d.port, "127.0.0.31") for _ in range(4)]
        async with held(streams):
            assert [c.status for c in streams] == [200] * 4  # the unsigned share (8 less 4) is full
            parked = []
            for _ in range(4):
                c = await connect(d.port, "127.0.0.32")
                c.writer.write(f"GET /api/v1/gpus HTTP/1.1\r\nHost: 127.0.0.1:{d.port}\r\n"
                               "Authorization: Bearer x\r\n\r\n".encode())
                line = await asyncio.wait_for(c.reader.readline(), 10)
                assert line.startswith(b"HTTP/1.1 401"), line
                parked.append(c)
            async with held(parked):
                assert d.guard is not None and d.guard.on_probation == 4
                ours = await stream(d.port, "127.0.0.1", signed=True)
                async with held([ours]):
                    assert ours.status == 200
                    assert not any(c.closed.is_set() for c in streams)


async def test_a_strangers_new_connections_do_not_close_a_secret_holders_on_probation(tmp_path: Path) -> None:
    """Strangers hold every unsigned place (busy streams): a secret holder's new connection is let in
    on probation, and until its signed request arrives it looks like any other.  A stranger that
    then opens connections of its own (silent, each on probation too) fills the probation places:
    the place made for each is the oldest of the peer holding the most of them -- the stranger's
    own -- never the secret holder's, which is served once its request comes."""
    async with running_daemon(tmp_path, unique_session("churn"), "churn", token=SECRET, tls=False,
                              max_connections=8, reserved_connections=4, max_connections_per_peer=8,
                              max_subscribers=100, reserved_subscribers=0) as d:
        streams = [await stream(d.port, "127.0.0.41") for _ in range(4)]
        async with held(streams):
            assert [c.status for c in streams] == [200] * 4  # the unsigned share (8 less 4) is full
            ours = await connect(d.port, "127.0.0.1")
            async with held([ours]):
                await asyncio.sleep(0.2)
                assert d.guard is not None and d.guard.on_probation == 1
                churn = [await connect(d.port, "127.0.0.42") for _ in range(8)]
                async with held(churn):
                    await asyncio.sleep(0.3)
                    assert d.guard.on_probation <= 4
                    assert await ours.request(d.port, "/api/v1/events", signed=True) == 200
