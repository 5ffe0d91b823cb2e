"""A stand-in daemon for the monitoring tests: the fleet endpoints of docs/wire-format.md over a set
of snapshots the test controls, with :func:`gpusd.daemon.monitoring.install` applied."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from gpusd.daemon.access import stream_filter
from gpusd.daemon.monitoring import install
from gpusd.daemon.routes import RouteDef, add_routes
from gpusd.inventory.simulated import SimulatedBackend
from gpusd.model import HostSnapshot, LeaseInfo, ProcessInfo


def sim_host(hostname: str, spec: str = "2xA100-80GB", node: str | None = None) -> HostSnapshot:
    """A simulated host with one process and one lease on GPU 0 (private fields set)."""
    node = node or hashlib.sha1(hostname.encode()).hexdigest()[:16]
    snap = SimulatedBackend(spec, host=hostname, node=node).snapshot()
    g = snap.gpus[0]
    g.processes = [ProcessInfo(pid=4242, used_memory=3 * 2**30, user="alice", command="python train.py --secret")]
    g.leases = [LeaseInfo(lease_id="l1", pid=4242, user="alice", command="python train.py --secret", device=g.uuid)]
    return snap


class FakeDaemon:
    """Implements :class:`gpusd.daemon.monitoring.MonitoredDaemon` over in-memory snapshots; the
    first host is "this" host, the others are hosts it discovered."""

    def __init__(self, hosts: Sequence[HostSnapshot], token: str | None = None,
                 thresholds: Sequence[str] = (), interval: float = 0.2) -> None:
        self.hosts = {h.node_id: h for h in hosts}
        self.local = hosts[0].node_id
        self.node_id = self.local
        self.gone: set[str] = set()
        self.token = token
        self.thresholds = list(thresholds)
        self.interval = interval
        self.published: list[tuple[str, dict[str, Any]]] = []
        self.subscribers: list[asyncio.Queue[tuple[str, dict[str, Any]]]] = []
        self.extra: list[Any] = []  # raw entries appended to the fleet answer (hostile hosts)

    # the MonitoredDaemon protocol
    def latest_snapshot(self) -> HostSnapshot | None:
        return self.hosts[self.local]

    def publish(self, event: str, data: dict[str, Any]) -> None:
        self.published.append((event, data))
        if event == "threshold":
            snap = self.hosts[self.local]
            gpu = next((g for g in snap.gpus if g.uuid == data["gpu"]), None)
            self.broadcast(f"threshold_{data['state']}", {
                "node_id": snap.node_id, "hostname": snap.hostname, "ts": data["ts"],
                "gpu": gpu.to_dict() if gpu else None, "data": data})

    # test controls
    def broadcast(self, event: str, data: dict[str, Any]) -> None:
        for q in self.subscribers:
            q.put_nowait((event, data))

    def set_gpu(self, node_id: str, index: int, **fields: Any) -> None:
        snap = self.hosts[node_id]
        g = snap.gpu(index)
        for k, v in fields.items():
            setattr(g, k, v)
        snap.timestamp = time.time()
        self.broadcast("device_updated", {"node_id": node_id, "hostname": snap.hostname, "ts": snap.timestamp,
                                          "gpu": g.to_dict()})

    def remove_host(self, node_id: str) -> None:
        self.gone.add(node_id)
        snap = self.hosts[node_id]
        self.broadcast("host_removed", {"node_id": node_id, "hostname": snap.hostname, "gpu": None})

    def fleet(self) -> dict[str, Any]:
        return {"hosts": [{"node_id": s.node_id, "hostname": s.hostname, "url": f"http://{s.hostname}:4780",
                           "alive": s.node_id not in self.gone, "snapshot": s.to_dict()}
                          for s in self.hosts.values()] + self.extra}


def make_app(daemon: FakeDaemon, trust_loopback: bool = True) -> web.Application:
    app = web.Application()

    async def fleet(request: web.Request) -> web.Response:
        return web.json_response(daemon.fleet())

    async def gpus(request: web.Request) -> web.Response:
        return web.json_response([g.to_dict() for g in daemon.hosts[daemon.local].gpus])

    async def events(request: web.Request) -> web.StreamResponse:
        out = stream_filter(request)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        q: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue()
        daemon.subscribers.append(q)
        try:
            while True:
                try:
                    event, data = await asyncio.wait_for(q.get(), 2.0)
                except asyncio.TimeoutError:
                    event, data = "heartbeat", {"ts": time.time()}
                await resp.write(out(f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()))
        except ConnectionResetError:
            pass
        finally:
            daemon.subscribers.remove(q)
        return resp

    async def echo(request: web.Request) -> web.Response:
        return web.json_response({"written": True})

    # as the daemon's parts do: every route behind the access rules (gpusd.daemon.routes)
    add_routes(app, [RouteDef("GET", "/api/v1/fleet", fleet), RouteDef("GET", "/api/v1/gpus", gpus),
                     RouteDef("GET", "/api/v1/fleet/events", events), RouteDef("POST", "/api/v1/echo", echo)])
    install(app, daemon, trust_loopback=trust_loopback)
    return app
