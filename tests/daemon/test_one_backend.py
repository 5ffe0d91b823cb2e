"""One inventory backend per daemon: the sampling loop (what ``GET /api/v1/gpus``
serves), the lease authority on its Unix socket and the pool's remote leases read the same backend,
so a lease is decided on the readings -- the utilisation window -- the API shows."""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
from pathlib import Path
from typing import Any

import pytest

from daemon_helpers import FakeBackend, daemon_config, make_snapshot, unique_session

TOKEN = secrets.token_hex(32)


class Numbered(FakeBackend):
    """A backend whose readings say which one it is: the n-th opened reads ``10 * n`` % utilisation
    (a window of its own, as each NVML backend keeps one)."""

    opened: list[Numbered] = []

    def __init__(self) -> None:
        super().__init__(make_snapshot(2, hostname="one"))
        Numbered.opened.append(self)
        self.n = len(Numbered.opened)
        self.reads = 0

    def snapshot(self, util_since: Any = None, detail: bool = True) -> Any:
        self.reads += 1
        snap = super().snapshot(util_since, detail)
        for g in snap.gpus:
            g.utilization_gpu, g.utilization_window = 10.0 * self.n, 5.0
        return snap


def _socket_request(request: dict[str, Any]) -> dict[str, Any]:
    from gpusd.alloc.authority import socket_path

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(str(socket_path()))
        s.sendall(json.dumps(request).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    return json.loads(data)  # type: ignore[no-any-return]


def _signed(method: str, url: str, body: Any) -> Any:
    from urllib.parse import urlsplit

    from gpusd.wire.http import fetch_json, request_json
    from gpusd.wire.signing import FleetKey

    parts = urlsplit(url)
    node = str(fetch_json(f"{parts.scheme}://{parts.netloc}/api/v1/host").data["node_id"])
    return request_json(method, url, body, key=FleetKey(TOKEN), node_id=node)


async def test_the_lease_socket_the_pool_and_the_api_read_the_one_backend_the_daemon_opened(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpusd import inventory
    from gpusd.daemon.service import Daemon
    from gpusd.wire.http import fetch_json

    Numbered.opened = []
    monkeypatch.setattr(inventory, "open_backend", lambda *a, **kw: Numbered())
    d = Daemon(daemon_config(tmp_path, unique_session(), "one", leases=True, token=TOKEN, tls=False))
    await d.start()
    try:
        assert d._lease_server is not None  # this test runs as root: the daemon is the lease authority
        api = f"http://127.0.0.1:{d.port}/api/v1"
        gpus = (await asyncio.to_thread(fetch_json, f"{api}/gpus")).data
        seen = await asyncio.to_thread(_socket_request, {"op": "snapshot", "v": 2})
        chosen = await asyncio.to_thread(_socket_request, {"op": "choose", "v": 2, "count": 1})
        remote = await asyncio.to_thread(_signed, "POST", f"{api}/leases", {"count": 1, "holder": "x", "ttl": 30})
        assert seen["ok"] and chosen["ok"] and remote.status == 201, (seen, chosen, remote.data)
        # one backend was opened, and every part read its window: the API, the socket's snapshot and its
        # choice, and the pool's grant all say the same utilisation
        assert len(Numbered.opened) == 1, [b.n for b in Numbered.opened]
        assert [g["utilization_gpu"] for g in gpus] == [10.0, 10.0]
        assert [g["utilization_gpu"] for g in seen["snapshot"]["gpus"]] == [10.0, 10.0]
        assert chosen["devices"][0]["util"] == 10.0
        assert remote.data["devices"][0]["utilization_gpu"] == 10.0
        assert Numbered.opened[0].reads >= 4  # sampling, the socket's two requests, the pool's grant
        assert d._lease_server.backend is d.inventory and d.pool.backend is d.inventory
    finally:
        await d.stop()
    assert Numbered.opened[0].closed  # closed once, by the daemon, after every part stopped
