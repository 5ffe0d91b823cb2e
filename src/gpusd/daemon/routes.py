"""The daemon's HTTP routes as tables (issue 19): each part that serves HTTP has a
``routes(deps) -> list[RouteDef]`` whose handlers use only the dependencies it is given (the part's
own object and the small protocol it reads the daemon through), never the whole daemon; the
daemon's app adds the tables with :func:`add_routes`.  Core API: :func:`gpusd.daemon.http.routes`;
remote leases: :func:`gpusd.daemon.pool.routes`; metrics, dashboard and alerts:
:func:`gpusd.daemon.monitoring.routes`; usage history: :func:`gpusd.daemon.recording.routes`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Awaitable, Callable, Iterable

if TYPE_CHECKING:  # pragma: no cover
    from aiohttp import web

    Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class RouteDef:
    """One route: ``GET`` routes also answer ``HEAD`` (as aiohttp's ``add_get`` does)."""

    method: str
    path: str
    handler: Handler


def add_routes(app: web.Application, routes: Iterable[RouteDef]) -> None:
    """Add ``routes`` to ``app``'s router, in their order (before the app starts)."""
    for r in routes:
        if r.method == "GET":
            app.router.add_get(r.path, r.handler)
        else:
            app.router.add_route(r.method, r.path, r.handler)
