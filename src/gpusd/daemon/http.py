"""The daemon's HTTP API (docs/wire-format.md): JSON for the host, its GPUs, history and the fleet,
and server-sent event streams.

``build_app(daemon)`` returns a plain ``aiohttp.web.Application``: other parts of gpusd add their route
tables to ``daemon.app`` with :func:`gpusd.daemon.routes.add_routes` before the daemon starts (never
``app.router.add_get``: a route outside the access rules stops the daemon from starting).  ``sse_stream`` serves
any :class:`~gpusd.daemon.events.EventHub` as a stream with heartbeats (the hub's: one timer and one
encoding per beat for all of its readers).
"""

# Imports inside functions: memory at rest (loaded on request).
from __future__ import annotations

import asyncio
import logging
import time
from functools import partial
from typing import TYPE_CHECKING, Awaitable, Callable, Iterable, Protocol, TypeVar

from aiohttp import web

from .._version import __version__
from ..model import redact
from ..sanitize import dumps
from ..wire.sse import check_pace
from .access import FLEET_ALL, FLEET_OWN, can_see_private, fleet_filter, fleet_level, is_signed, peer_of, stream_filter
from .events import EventHub, HubFull
from .routes import RouteDef, add_routes

if TYPE_CHECKING:  # pragma: no cover
    from ..model import HostSnapshot
    from .config import DaemonConfig
    from .fleet import Fleet
    from .recent import RecentSamples
    from .routes import RouteDef

log = logging.getLogger(__name__)
T = TypeVar("T")

class DaemonView(Protocol):
    """What the HTTP handlers read from the daemon (:class:`gpusd.daemon.service.Daemon` is one)."""

    @property
    def config(self) -> "DaemonConfig": ...
    @property
    def node_id(self) -> str: ...
    @property
    def hostname(self) -> str: ...
    @property
    def started_at(self) -> float: ...
    @property
    def snapshot(self) -> "HostSnapshot | None": ...
    @property
    def recent(self) -> "RecentSamples": ...
    @property
    def events(self) -> EventHub: ...
    @property
    def fleet(self) -> "Fleet | None": ...
    def snapshot_event(self) -> bytes: ...
    @property
    def tls_port(self) -> int | None: ...
    @property
    def cert_fp(self) -> str | None: ...


API = "/api/v1"
SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    # no buffering in nginx & co.
    "X-Accel-Buffering": "no",
}


class Answers:
    """The bytes of the answers built from one snapshot (``GET /api/v1/gpus``, ``/api/v1/host``), per
    redaction level: ``private`` (a local reader, or a verified fleet member: both see process owners
    and commands) and public (those fields nulled, :func:`gpusd.model.redact`).  Each is built
    at most once per sample, on its first request; a new snapshot object starts afresh.  A public
    body is always built from the redacted payload, never from a private body, and the two never
    share a key; the access rules check every public answer anyway (docs/security.md)."""

    __slots__ = ("_bodies", "_snap")

    def __init__(self) -> None:
        self._snap: object = None
        self._bodies: dict[tuple[str, bool], bytes] = {}

    def get(self, snap: object, kind: str, private: bool, build: "Callable[[], object]") -> bytes:
        # a new sample (a strong reference: its id cannot be reused meanwhile)
        if snap is not self._snap:
            self._snap, self._bodies = snap, {}
        key = (kind, private)
        body = self._bodies.get(key)
        # the first request of this sample and level
        if body is None:
            payload = build()
            body = dumps(payload if private else redact(payload), separators=(",", ":")).encode()
            self._bodies[key] = body
        return body


def build_app(daemon: DaemonView) -> web.Application:
    app = web.Application(client_max_size=64 * 1024)
    add_routes(app, routes(daemon))
    return app


def routes(daemon: DaemonView, answers: Answers | None = None) -> list[RouteDef]:
    """The core API's route table (docs/wire-format.md); each handler is given the daemon (through
    the :class:`Daemon` protocol, its one dependency) and, for the answers built once per sample,
    their :class:`Answers`."""
    answers = answers if answers is not None else Answers()
    return [RouteDef("GET", "/healthz", partial(healthz, daemon)),
            RouteDef("GET", f"{API}/host", partial(host, daemon, answers)),
            RouteDef("GET", f"{API}/gpus", partial(gpus, daemon, answers)),
            RouteDef("GET", f"{API}/history", partial(history, daemon)),
            RouteDef("GET", f"{API}/events", partial(events, daemon)),
            RouteDef("GET", f"{API}/fleet", partial(fleet, daemon)),
            RouteDef("GET", f"{API}/fleet/events", partial(fleet_events, daemon)),
            RouteDef("GET", f"{API}/prometheus/http_sd", partial(prometheus_http_sd, daemon))]


def _json(data: object, status: int = 200) -> web.Response:
    # strict JSON (no NaN/Infinity): browsers' JSON.parse refuses them

    return web.Response(text=dumps(data, separators=(",", ":")), status=status,
                        content_type="application/json")


def _bytes(body: bytes) -> web.Response:
    return web.Response(body=body, content_type="application/json", charset="utf-8")


_HEALTH: dict[tuple[str, int | None, str | None], tuple[bytes, bytes]] = {}


async def healthz(d: DaemonView, request: web.Request) -> web.Response:
    # everything but the uptime is fixed: its bytes are built once, the uptime placed in them per request
    # (where private fields travel, docs/security.md: pinned, and proven by signature)
    ident = (d.node_id, d.tls_port, d.cert_fp)
    parts = _HEALTH.get(ident)
    if parts is None:
        out: dict[str, object] = {"ok": True, "node_id": d.node_id, "uptime": 0}
        if d.tls_port and d.cert_fp:
            out.update(tls_port=d.tls_port, cert_fp=d.cert_fp)
        head, _, tail = dumps(out, separators=(",", ":")).encode().partition(b'"uptime":0')
        parts = _HEALTH[ident] = (head + b'"uptime":', tail)
        # a daemon has one identity; tests build many
        if len(_HEALTH) > 8:
            del _HEALTH[next(iter(_HEALTH))]
    return _bytes(b"%s%r%s" % (parts[0], round(time.time() - d.started_at, 3), parts[1]))


async def host(d: DaemonView, answers: Answers, request: web.Request) -> web.Response:
    snap = d.snapshot

    def build() -> object:
        return {
            "api": 1,
            "gpusd_version": __version__,
            "session": d.config.session,
            "interval": d.config.interval,
            "node_id": d.node_id,
            "hostname": d.hostname,
            "snapshot": snap.to_dict() if snap is not None else None,
            # where slurmctld runs, for a daemon started with --slurmctld (docs/slurm.md); added in 0.3
            "slurmctld": _slurmctld(d),
            # whether this daemon is its host's lease authority, and why not (added in 0.4)
            "lease_authority": dict(getattr(d, "authority", None) or {}) or None,
        }

    return _bytes(answers.get(snap, "host", can_see_private(request), build))


def _slurmctld(d: DaemonView) -> object:
    part = getattr(d, "slurm", None)
    return part.host_info() if part is not None else None


async def gpus(d: DaemonView, answers: Answers, request: web.Request) -> web.Response:
    snap = d.snapshot
    return _bytes(answers.get(
        snap, "gpus", can_see_private(request), lambda: [g.to_dict() for g in snap.gpus] if snap is not None else []))


async def history(d: DaemonView, request: web.Request) -> web.Response:
    seconds: float | None = None
    if "seconds" in request.query:
        try:
            seconds = float(request.query["seconds"])
            if not seconds >= 0:
                raise ValueError
        except ValueError:
            return _json({"error": "seconds must be a non-negative number"}, status=400)
    return _json({"interval": d.config.interval, "seconds": d.config.history, "gpus": d.recent.to_dict(seconds)})


async def events(d: DaemonView, request: web.Request) -> web.StreamResponse:
    pace = None
    if "pace" in request.query:
        try:
            pace = check_pace(request.query["pace"][:32])
        except ValueError as why:
            return _json({"error": str(why)}, status=400)
    first = [d.snapshot_event()] if d.snapshot is not None else []
    return await sse_stream(request, d.events, first, d.config.heartbeat, write_timeout=d.config.write_timeout,
                            pace=pace)


async def fleet(d: DaemonView, request: web.Request) -> web.Response:
    if d.fleet is None or d.config.fleet == "off":
        return _json({"error": "the fleet view is off in this daemon (--fleet-view off)"}, status=404)
    await d.fleet.ensure_started()
    # its bytes built by the fleet view (each snapshot encoded once), at the reader's level
    level = fleet_level(request)
    if level == FLEET_ALL:
        return _bytes(d.fleet.answer())
    return _bytes(d.fleet.answer(only_own=d.node_id if level == FLEET_OWN else None, redact=True))


async def prometheus_http_sd(d: DaemonView, request: web.Request) -> web.Response:
    """Prometheus HTTP service discovery (``http_sd_configs``): the fleet's metric targets, public
    fields only.  Hosts that failed to prove they hold the fleet secret are left out; the others carry
    ``__meta_gpusd_verified`` (true, or unknown for a daemon without a secret) and ``__meta_gpusd_via``."""
    from ..wire.promsd import daemons_from_hosts, file_sd

    if d.fleet is None or d.config.fleet == "off":
        return _json({"error": "the fleet view is off in this daemon (--fleet-view off)"}, status=404)
    await d.fleet.ensure_started()
    # the document export prometheus-sd writes
    return _json(file_sd(daemons_from_hosts(d.fleet.view().hosts)))


async def fleet_events(d: DaemonView, request: web.Request) -> web.StreamResponse:
    if d.fleet is None or d.config.fleet == "off":
        return _json({"error": "the fleet view is off in this daemon (--fleet-view off)"}, status=404)
    await d.fleet.ensure_started()
    return await sse_stream(request, d.fleet.hub, d.fleet.replay(), d.config.heartbeat, touch=d.fleet.touch,
                            write_timeout=d.config.write_timeout, out=fleet_filter(request, d.node_id))


async def sse_stream(request: web.Request, hub: EventHub, first: Iterable[bytes], heartbeat: float,
                     touch: "object | None" = None, write_timeout: float = 10.0,
                     out: "Callable[[bytes], bytes] | None" = None,
                     pace: float | None = None) -> web.StreamResponse:
    """Serve ``hub`` as server-sent events: ``first`` messages, then every published event, and the
    hub's ``heartbeat`` event after ``heartbeat`` seconds without one (:meth:`EventHub.keep_alive`;
    ``touch`` is called at each).  Ends on ``None`` (daemon stopping,
    or a subscriber too slow to keep up) or when the client goes away.

    A reader that does not take a message within ``write_timeout`` seconds, or falls so far behind
    that the hub drops it, is disconnected at once (its connection aborted: nothing more is queued
    for it).  Beyond the hub's limits (:mod:`gpusd.daemon.events`: in all, for unsigned readers, per
    peer address), a new reader gets ``503`` with ``Retry-After``; a signed reader (a secret holder)
    is refused only when signed readers hold every place.  ``out``: what each message goes through
    before it is written (default :func:`gpusd.daemon.access.stream_filter`).  ``pace``: the reader's
    (:mod:`gpusd.daemon.events`)."""
    if out is None:
        # private fields only for readers allowed to see them
        out = stream_filter(request)
    try:
        # before the first messages: nothing published meanwhile is lost
        sub = hub.subscribe(peer_of(request.remote), is_signed(request), pace)
    except HubFull as why:
        log.debug("event stream refused to %s: %s", request.remote, why)
        refusal = _json({"error": f"too many event-stream readers ({why}); try again later"}, status=503)
        refusal.headers["Retry-After"] = "5"
        return refusal
    # from here on, the finally below ends it: the daemon's stop awaits that (drained)
    hub.streaming(sub)
    hub.keep_alive(heartbeat, touch if callable(touch) else None)
    resp = web.StreamResponse(headers=SSE_HEADERS)
    slow = False
    try:
        await _bounded(resp.prepare(request), write_timeout)
        for first_msg in first:
            await _bounded(resp.write(out(first_msg)), write_timeout)
        while True:
            # no timer per reader: the hub's heartbeat wakes it
            msg = await sub.queue.get()
            if msg is None:
                slow = sub.dropped
                break
            data = out(msg)
            transport = request.transport
            if transport is not None and len(data) <= CALM_WRITE and not transport.get_write_buffer_size():
                # cannot wait (CALM_WRITE): no timer to arm and cancel per event
                await resp.write(data)
            else:
                await _bounded(resp.write(data), write_timeout)
        if not slow:
            await _bounded(resp.write_eof(), write_timeout)
    except asyncio.TimeoutError:
        slow = True
    except (ConnectionError, RuntimeError, OSError) as exc:  # the client went away
        log.debug("event stream to %s ended: %r", request.remote, exc)
    finally:
        hub.unsubscribe(sub)
    if slow:
        log.debug("event stream to %s: reader too slow, disconnected", request.remote)
        transport = request.transport
        if transport is not None:
            # drop what is queued for it: no wait on a reader that does not read
            transport.abort()
    return resp


# aiohttp's write waits only to drain a transport paused above its high-water mark (64 KiB by
# default): one with nothing left to send that takes at most this many bytes more cannot be paused,
# so such a write returns without waiting and needs no write_timeout of its own.
CALM_WRITE = 16 * 1024


async def _bounded(aw: Awaitable[T], seconds: float) -> T:
    """``await aw``, or ``asyncio.TimeoutError`` after ``seconds`` (no extra task where the Python has
    ``asyncio.timeout``: one write per event per reader)."""
    timeout = getattr(asyncio, "timeout", None)
    if timeout is None:  # Python 3.10
        return await asyncio.wait_for(aw, seconds)
    async with timeout(seconds):
        return await aw
