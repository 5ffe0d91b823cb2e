"""The daemon's HTTP routes as tables with explicit dependencies (issue 19 point 8): the app serves
each part's table, and a table is built from its small dependencies value alone (a stand-in with
only the protocol's fields serves requests), not from the daemon object."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from daemon_helpers import daemon_config, unique_session


def _served(app: Any) -> set[tuple[str, str]]:
    out = set()
    for route in app.router.routes():
        info = route.resource.get_info() if route.resource is not None else {}
        out.add((route.method, info.get("path") or info.get("formatter") or ""))
    return out


def test_the_daemons_app_serves_every_parts_route_table(tmp_path: Path) -> None:
    from gpusd.daemon import http, monitoring, pool, recording
    from gpusd.daemon.service import Daemon

    d = Daemon(daemon_config(tmp_path, unique_session(), "r1"))
    monitor = d.app[monitoring._app_key()]
    tables = [*http.routes(), *pool.routes(d.pool), *monitoring.routes(monitor), *recording.routes(d.recording)]
    served = _served(d.app)
    assert {(r.method, r.path) for r in tables} <= served
    assert all(("HEAD", r.path) in served for r in tables if r.method == "GET")  # as add_get did
    paths = [r.path for r in tables]
    assert len(paths) == len(set((r.method, r.path) for r in tables))  # no route in two tables
    assert {"/api/v1/gpus", "/api/v1/leases", "/metrics", "/api/v1/history/usage"} <= set(paths)


async def test_the_pool_table_needs_only_the_pool_daemon_protocol() -> None:
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from gpusd.daemon.config import DaemonConfig
    from gpusd.daemon.pool import Pool, routes
    from gpusd.daemon.routes import add_routes

    published: list[Any] = []
    deps = SimpleNamespace(config=DaemonConfig(), hostname="stand-in", node_id="n0",
                           publish=lambda event, data: published.append(event))  # PoolDaemon's fields only
    p = Pool(deps)  # type: ignore[arg-type]
    app = web.Application()
    add_routes(app, routes(p))
    async with TestClient(TestServer(app)) as client:
        resp = await client.get("/api/v1/leases")
        assert resp.status == 200
        assert await resp.json() == {"host": "stand-in", "node_id": "n0", "leases": []}
        resp = await client.delete("/api/v1/leases/nope")
        assert resp.status == 404
    await p.close()
