"""The lease authority's stop never blocks the daemon's event loop: handing the
leases' descriptors to clients whose sockets are full is awaited, not a blocking ``sendmsg``, so the
loop keeps serving (HTTP, heartbeats, mDNS goodbyes) meanwhile.  A loop-lag probe runs on the
server's loop while it stops; before, each such client held the loop for a second."""

from __future__ import annotations

import asyncio
import json
import socket
import time

from authority_helpers import ServerThread
from fakenvml import make_gpus


def _full_client(n: int) -> socket.socket:
    """A protocol-2 lease holder that stops reading: its receive buffer fills with the answers to
    its own bad requests, so the daemon's next send to it waits (it is not yet known to be deaf)."""
    from gpusd.alloc.authority import socket_path

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(str(socket_path()))
    s.settimeout(30)
    s.sendall(json.dumps({"op": "lease", "v": 2, "count": 1, "command": f"full{n}"}).encode() + b"\n")
    assert json.loads(s.recv(65536).split(b"\n")[0])["ok"]
    s.setblocking(False)
    bad = b'{"op": "nope", "' + b"x" * 200 + b'": 1}\n'
    refused = 0
    while refused < 20:  # until the daemon stops reading us (it waits to send an answer)
        try:
            s.send(bad)
        except BlockingIOError:
            refused += 1
            time.sleep(0.02)
    return s


async def _probe(lags: list[float], stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    last = loop.time()
    while not stop.is_set():
        await asyncio.sleep(0.01)
        now = loop.time()
        lags.append(now - last)
        last = now


def test_stopping_with_clients_that_do_not_read_does_not_block_the_loop(fake_nvml_inprocess) -> None:
    fake_nvml_inprocess.write(make_gpus(4))
    server = ServerThread()
    clients = []
    try:
        clients = [_full_client(i) for i in range(2)]
        assert all(not c.deaf for c in server.server.held)  # their sends wait (SEND_TIMEOUT is 10 s)
        lags: list[float] = []
        done = asyncio.Event()
        probe = asyncio.run_coroutine_threadsafe(_probe(lags, done), server.loop)
        time.sleep(0.2)
        asyncio.run_coroutine_threadsafe(server.server.stop(), server.loop).result(30)
        server.loop.call_soon_threadsafe(done.set)
        probe.result(10)
        # the loop ran all along: no gap near the second a blocking hand-over would take per client
        assert lags and max(lags) < 0.9, max(lags)
        # and no lease outlives its connection: not handed over (the sockets were full), they ended
        from gpusd.alloc.leases import LeaseStore

        assert LeaseStore().leases() == []  # (each store reads the authority's too)
    finally:
        for c in clients:
            c.close()
        server.loop.call_soon_threadsafe(server.loop.stop)
        server.thread.join(10)


async def test_the_daemons_stop_awaits_each_stream_writing_its_bye() -> None:
    """The streams' ``bye`` is awaited (EventHub.drained), not given a fixed 50 ms: a stream still
    writing is waited for (boundedly), a subscription no stream serves is not."""
    from gpusd.daemon.events import EventHub

    hub = EventHub()
    served = hub.subscribe()
    hub.streaming(served)  # what sse_stream does
    hub.subscribe()  # read in process (no stream): nothing to wait for
    hub.close(b"event: bye\n\n")
    assert await hub.drained(0.05) is False  # the stream has not written its bye yet: bounded wait
    got: list[bytes | None] = []

    async def stream() -> None:
        while True:
            msg = await served.get()
            got.append(msg)
            if msg is None:
                break
        hub.unsubscribe(served)  # the stream's end (sse_stream's finally)

    task = asyncio.ensure_future(stream())
    assert await hub.drained(5) is True
    assert got == [b"event: bye\n\n", None] and task.done()
