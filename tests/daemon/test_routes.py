"""The daemon's HTTP routes as tables with explicit dependencies: the app serves
each part's table, and a table is built from its small dependencies value alone (a stand-in with
only the protocol's fields serves requests), not from the daemon object."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from daemon_helpers import (  # noqa: F401
    FakeBackend,
    daemon_config,
    fast_mdns,
    make_snapshot,
    running_daemon,
    unique_session,
)
from gpusd.wire.signing import FleetKey


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
    tables = [*http.routes(d), *pool.routes(d.pool), *monitoring.routes(monitor), *recording.routes(d.recording)]
    served = _served(d.app)
    assert {(r.method, r.path) for r in tables} <= served
    assert all(("HEAD", r.path) in served for r in tables if r.method == "GET")  # as add_get did
    paths = [r.path for r in tables]
    assert len(paths) == len(set((r.method, r.path) for r in tables))  # no route in two tables
    assert {"/api/v1/gpus", "/api/v1/leases", "/metrics", "/api/v1/history/usage"} <= set(paths)


async def test_the_pool_table_needs_only_the_pool_daemon_protocol() -> None:
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from gpusd.daemon.access import Access
    from gpusd.daemon.config import DaemonConfig
    from gpusd.daemon.pool import Pool, routes
    from gpusd.daemon.routes import add_routes, install_access

    published: list[Any] = []
    deps = SimpleNamespace(config=DaemonConfig(), hostname="stand-in", node_id="n0",
                           publish=lambda event, data: published.append(event))  # PoolDaemon's fields only
    p = Pool(deps)  # type: ignore[arg-type]
    app = web.Application()
    add_routes(app, routes(p))
    secret = "pool-table-fleet-secret-0123456789"
    install_access(app, Access(secret, node_id=lambda: "n0"))  # every route is behind the access rules
    async with TestClient(TestServer(app)) as client:
        resp = await client.get("/api/v1/leases")
        assert resp.status == 200
        assert await resp.json() == {"host": "stand-in", "node_id": "n0", "leases": []}
        url = str(client.make_url("/api/v1/leases/nope"))
        headers, _ = FleetKey(secret).sign_request("DELETE", url, node_id="n0")  # a write: signed
        resp = await client.delete("/api/v1/leases/nope", headers=headers)
        assert resp.status == 404
    await p.close()


# -- every route is behind the access rules (issue 24: the rules run per route, not as a middleware) --
async def _nothing(request: Any) -> Any:
    from aiohttp import web

    return web.json_response([{"processes": [{"pid": 1, "user": "alice", "command": "secret"}]}])


async def test_a_route_added_outside_the_tables_stops_the_daemon_from_starting(tmp_path: Path, fast_mdns: Any
                                                                                ) -> None:
    """``daemon.app.router.add_get(...)`` (no access rules: private fields to anyone, no signature
    checked) is refused when the daemon starts: it does not serve at all."""
    from gpusd.daemon.routes import UngatedRoute
    from gpusd.daemon.service import Daemon

    d = Daemon(daemon_config(tmp_path, unique_session(), "escape"))
    d.backend = FakeBackend(make_snapshot(1, hostname="escape", node_id=d.node_id))
    d.app.router.add_get("/api/v1/escape", _nothing)
    try:
        with pytest.raises(UngatedRoute, match="/api/v1/escape"):
            await d.start()
    finally:
        await d.stop()


async def test_every_route_of_a_running_daemon_is_behind_the_access_rules(tmp_path: Path, fast_mdns: Any) -> None:
    """Every route of the daemon's app (every part's table, HEAD too, and the catch-all for requests no
    route takes) runs the access rules; a request matching no route gets them too: an
    ``Authorization`` header is 401, an unsigned write 405 on a daemon without a secret, before
    aiohttp's 404 or 405."""
    import aiohttp

    from gpusd.daemon.routes import _gate_key, is_gated

    async with running_daemon(tmp_path, unique_session(), "gated") as d:
        gate = d.app[_gate_key()]
        routes = list(d.app.router.routes())
        assert len(routes) > 20 and all(is_gated(gate, r.handler) for r in routes)
        assert list(d.app.router.resources())[-1] is gate.fallback
        base = f"http://127.0.0.1:{d.port}"
        async with aiohttp.ClientSession() as s:
            async with s.get(base + "/api/v1/nowhere", headers={"Authorization": "Bearer x"}) as r:
                assert r.status == 401
            async with s.get(base + "/api/v1/nowhere") as r:
                assert r.status == 404
            async with s.post(base + "/api/v1/gpus", data=b"{}") as r:  # a write, unsigned, no secret here
                assert r.status == 405 and r.headers["Allow"] == "GET, HEAD, OPTIONS"
            async with s.head(base + "/api/v1/gpus") as r:
                assert r.status == 200


async def _raw(port: int, request_line: str, headers: str = "") -> str:
    """The status line of the answer to ``request_line`` sent as is (a target aiohttp's client would not send)."""
    import asyncio

    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"{request_line}\r\nHost: 127.0.0.1:{port}\r\n{headers}Connection: close\r\n\r\n".encode())
        await writer.drain()
        return (await asyncio.wait_for(reader.readline(), 10)).decode().strip()
    finally:
        writer.close()


@pytest.mark.parametrize("request_line", ["OPTIONS * HTTP/1.1", "CONNECT 127.0.0.1:22 HTTP/1.1"])
async def test_a_request_target_that_is_not_a_path_meets_the_access_rules(tmp_path: Path, fast_mdns: Any,
                                                                           request_line: str) -> None:
    """``OPTIONS *`` and ``CONNECT host:port`` match no path pattern, not even the catch-all's: aiohttp's
    router answered them 404 without any route, so without the access rules or the connection guard.
    They go to the catch-all too: an ``Authorization`` header is 401, as on any path."""
    async with running_daemon(tmp_path, unique_session(), "targets") as d:
        assert (await _raw(d.port, request_line, "Authorization: Bearer x\r\n")).split()[1] == "401"
        assert (await _raw(d.port, request_line)).split()[1] in ("404", "405")


async def test_a_signed_request_no_route_takes_gets_aiohttps_answer_after_the_rules(tmp_path: Path,
                                                                                    fast_mdns: Any) -> None:
    """Past the access rules, the catch-all answers as aiohttp would: 405 with the path's methods in
    ``Allow``, or 404; a bad signature on an unknown path is still 401."""
    import aiohttp

    secret = "catch-all-fleet-secret-0123456789"
    key = FleetKey(secret)
    async with running_daemon(tmp_path, unique_session(), "catch", token=secret, tls=False) as d:
        base = f"http://127.0.0.1:{d.port}"
        async with aiohttp.ClientSession() as s:
            url = base + "/api/v1/gpus"
            headers, _ = key.sign_request("POST", url, body=b"{}", node_id=d.node_id)
            async with s.post(url, data=b"{}", headers=headers) as r:
                assert r.status == 405 and set(r.headers["Allow"].split(",")) == {"GET", "HEAD"}
            url = base + "/api/v1/nowhere"
            headers, _ = key.sign_request("GET", url, node_id=d.node_id)
            async with s.get(url, headers=headers) as r:
                assert r.status == 404
            headers, _ = FleetKey("another-fleets-secret-0123456789").sign_request("GET", url)
            async with s.get(url, headers=headers) as r:
                assert r.status == 401


async def test_routes_without_access_rules_are_never_served() -> None:
    """A route table added to an app whose access rules were never installed: the app does not start
    (and, were it served anyway, each request is refused, never answered unchecked)."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from gpusd.daemon.routes import RouteDef, UngatedRoute, add_routes, gate_of, gated

    app = web.Application()
    add_routes(app, [RouteDef("GET", "/api/v1/private", _nothing)])
    with pytest.raises(UngatedRoute, match="no access rules"):
        await TestServer(app).start_server()
    resp = await gated(gate_of(web.Application()), _nothing)(None)  # type: ignore[arg-type]
    assert resp.status == 503 and b"alice" not in resp.body


@pytest.mark.parametrize("how", ["add_get", "static", "subapp", "after the catch-all"])
async def test_a_route_that_escapes_the_gate_fails_closed(tmp_path: Path, how: str) -> None:
    from aiohttp import web

    from gpusd.daemon.access import Access
    from gpusd.daemon.routes import RouteDef, UngatedRoute, add_routes, check_routes, install_access, seal

    app = web.Application()
    install_access(app, Access(None))
    add_routes(app, [RouteDef("GET", "/api/v1/gpus", _nothing)])
    if how == "add_get":
        app.router.add_get("/api/v1/raw", _nothing)
    elif how == "static":
        app.router.add_static("/files", tmp_path)
    elif how == "subapp":
        sub = web.Application()
        sub.router.add_get("/x", _nothing)
        app.add_subapp("/sub", sub)
    with pytest.raises(UngatedRoute) if how != "after the catch-all" else _no_error():
        await seal(app)
    if how == "after the catch-all":  # shadowed by it: unreachable, and refused too
        add_routes(app, [RouteDef("GET", "/api/v1/late", _nothing)])
        with pytest.raises(UngatedRoute, match="behind the catch-all"):
            check_routes(app)


async def test_a_guarded_site_serves_only_a_gated_app() -> None:
    """The daemon's sites check the app once its router is frozen (nothing can be added after)."""
    from aiohttp import web

    from gpusd.daemon.guard import ConnectionGuard, GuardedSite
    from gpusd.daemon.routes import UngatedRoute

    app = web.Application()
    app.router.add_get("/api/v1/gpus", _nothing)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        with pytest.raises(UngatedRoute):
            await GuardedSite(runner, ConnectionGuard(8, 5.0), host="127.0.0.1", port=0).start()
    finally:
        await runner.cleanup()


class _no_error:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return False
