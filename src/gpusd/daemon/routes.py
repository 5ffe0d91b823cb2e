"""The daemon's HTTP routes as tables, and the one place every route is registered, so that
every request passes the access rules.

Each part that serves HTTP has a ``routes(deps) -> list[RouteDef]`` whose handlers use only the
dependencies it is given (the part's own object and the small protocol it reads the daemon through),
never the whole daemon; the daemon's app adds the tables with :func:`add_routes`.  Core API:
:func:`gpusd.daemon.http.routes`; remote leases: :func:`gpusd.daemon.pool.routes`; metrics, dashboard
and alerts: :func:`gpusd.daemon.monitoring.routes`; usage history: :func:`gpusd.daemon.recording.routes`.

**Access is checked per route, and no route can escape it.**  The access rules
(:func:`gpusd.daemon.access.serve`) run inside each route's handler rather than as an aiohttp
middleware (whose machinery cost a sixth of an unsigned read).  So:

* :func:`add_routes` registers every handler behind the app's :class:`Gate` (the rules it applies
  are installed with :func:`install_access`, which may come before or after the routes);
* a request that matches no route is answered by a catch-all route behind the same gate, added
  when the app starts (:func:`seal`): the access rules run first (a bad signature is still 401, an
  ``Authorization`` header 401, an unsigned write 401/405), then 404 or 405 as aiohttp answers;
* :func:`check_routes` fails closed: when the app starts (and again in
  :class:`gpusd.daemon.guard.GuardedSite`, once the router is frozen), any route whose handler is
  not behind this app's gate -- one added with ``app.router.add_get(...)``, a static route, a
  sub-app's -- or a route behind the catch-all, or an app without access rules, stops the daemon
  from serving (:class:`UngatedRoute`).
"""

# Imports inside functions: optional or heavy packages.
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterable

from .access import install_proofs, serve

if TYPE_CHECKING:  # pragma: no cover
    from aiohttp import web

    from .access import Access

    Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class RouteDef:
    """One route: ``GET`` routes also answer ``HEAD`` (as aiohttp's ``add_get`` does)."""

    method: str
    path: str
    handler: Handler


class UngatedRoute(RuntimeError):
    """A route of the daemon's app would be served without the access rules."""


class Gate:
    """What every route of one app passes through: ``access`` (None until :func:`install_access`:
    then every request is refused, never served unchecked)."""

    __slots__ = ("access", "fallback", "sealed")

    def __init__(self) -> None:
        self.access: Access | None = None
        # the catch-all route's resource, once sealed
        self.fallback: Any = None
        self.sealed = False


_GATE_KEY: Any = None


def _gate_key() -> Any:
    global _GATE_KEY
    if _GATE_KEY is None:
        from aiohttp import web

        _GATE_KEY = web.AppKey("gpusd.gate", Gate)
    return _GATE_KEY


def gate_of(app: web.Application) -> Gate:
    """The app's gate (made on first use, before the app starts)."""
    key = _gate_key()
    gate: Gate | None = app.get(key)
    if gate is None:
        gate = app[key] = Gate()
        app.on_startup.append(seal)
    return gate


def gated(gate: Gate, handler: Handler) -> Handler:
    """``handler`` behind ``gate``: the access rules run, then (if they let the request in) the handler."""
    return functools.partial(serve, gate, handler)


def is_gated(gate: Gate, handler: object) -> bool:
    return (type(handler) is functools.partial and handler.func is serve
            and len(handler.args) == 2 and handler.args[0] is gate and not handler.keywords)


def add_routes(app: web.Application, routes: Iterable[RouteDef]) -> None:
    """Add ``routes`` to ``app``'s router, in their order (before the app starts), each behind the
    app's gate: the only way a route is added to the daemon's app."""
    gate = gate_of(app)
    for r in routes:
        if r.method == "GET":
            app.router.add_get(r.path, gated(gate, r.handler))
        else:
            app.router.add_route(r.method, r.path, gated(gate, r.handler))


def install_access(app: web.Application, access: Access) -> None:
    """The access rules every route of ``app`` applies (and the proofs on verified requests' answers)."""
    gate = gate_of(app)
    if gate.access is not None:
        raise UngatedRoute("the app's access rules are installed once")
    gate.access = access
    install_proofs(app, access)


async def _unrouted(request: web.Request) -> web.StreamResponse:
    """What aiohttp answers a request no route takes (404, or 405 with ``Allow``), after the access rules."""
    from aiohttp import web

    gate = request.app[_gate_key()]
    allowed: set[str] = set()
    for resource in request.app.router.resources():
        if resource is gate.fallback:
            continue
        match, methods = await resource.resolve(request)
        allowed |= methods
    if allowed:
        raise web.HTTPMethodNotAllowed(request.method, allowed)
    raise web.HTTPNotFound()


async def seal(app: web.Application) -> None:
    """On the app's start: the catch-all route (behind the gate) goes last, then every route is checked."""
    gate = gate_of(app)
    if not gate.sealed:
        gate.sealed = True
        route = app.router.add_route("*", "/{gpusd_unrouted:.*}", gated(gate, _unrouted))
        gate.fallback = route.resource
        _resolve_the_rest_to(app, route)
    check_routes(app)


def _resolve_the_rest_to(app: web.Application, route: Any) -> None:
    """Send to the catch-all ``route`` also the requests aiohttp's router matches to no resource at all:
    a request target that is not a path (``OPTIONS *``, ``CONNECT host:port``), which no path pattern,
    the catch-all's included, can match; aiohttp would answer them 404 without any route's handler, so
    without the access rules and the connection guard.  (The router of the app, not a middleware: a
    middleware would cost every request its wrapping.)"""
    from aiohttp.web_urldispatcher import UrlMappingMatchInfo

    router = app.router
    plain = router.resolve

    async def resolve(request: web.Request) -> Any:
        match = await plain(request)
        # aiohttp's MatchInfoError: no resource took the target
        if match.http_exception is not None:
            return UrlMappingMatchInfo({"gpusd_unrouted": ""}, route)
        return match

    resolve.gpusd_gate = _gate_key()  # type: ignore[attr-defined]  # what check_routes looks for
    router.resolve = resolve  # type: ignore[method-assign]


def check_routes(app: web.Application) -> None:
    """Raise :class:`UngatedRoute` unless every route of ``app`` is behind its gate, with access
    rules installed, and the catch-all (behind the gate too) is the last route."""
    gate = app.get(_gate_key())
    if gate is None or gate.access is None:
        raise UngatedRoute("the daemon's app has no access rules (routes.install_access)")
    if gate.fallback is None or getattr(app.router.resolve, "gpusd_gate", None) is not _gate_key():
        raise UngatedRoute("the daemon's app is not sealed: requests no route takes would skip the access rules")
    bad: list[str] = []
    seen_fallback = False
    for resource in app.router.resources():
        if seen_fallback:
            bad.append(f"{resource.canonical} (behind the catch-all)")
        if resource is gate.fallback:
            seen_fallback = True
        routes = list(resource)
        # a resource without routes of its own (a sub-app, say) is not ours
        if not routes:
            bad.append(f"{resource.canonical} (no gated route)")
        for route in routes:
            if not is_gated(gate, route.handler):
                bad.append(f"{route.method} {resource.canonical}")
    if not seen_fallback:
        bad.append("the catch-all route is missing")
    if bad:
        raise UngatedRoute("routes outside the access rules (add them with gpusd.daemon.routes.add_routes): "
                           + ", ".join(sorted(set(bad))))
