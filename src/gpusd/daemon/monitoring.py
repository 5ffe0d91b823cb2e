"""Wiring monitoring into a daemon's aiohttp application: one call, :func:`install`.

``install(app, daemon)`` — before the app starts — adds:

* ``GET /metrics``: Prometheus text format of the daemon's latest snapshot (see :mod:`.metrics`);
* ``GET /`` and ``GET /assets/{file}``: the web dashboard (``gpusd/web``: plain HTML, JS, CSS);
* ``GET /api/v1/alerts``: the threshold rules exceeded right now, and the rules configured;
* the access rules (:mod:`.access`, on every route: :func:`gpusd.daemon.routes.install_access`):
  writes need a signature; JSON answers are redacted for readers without it.  Streaming handlers
  call :func:`gpusd.daemon.access.can_see_private` and :func:`gpusd.model.redact` themselves;
* the threshold engine, run on every new snapshot — from ``daemon.on_sample`` callbacks where the
  daemon has that list, else from a task polling ``latest_snapshot()`` — calling
  ``daemon.publish("threshold", data)`` for each state change (and logging it).

The daemon only needs what :class:`MonitoredDaemon` lists; ``interval`` (seconds between samples),
``addresses`` (its own addresses: readers from there count as local) and ``on_sample`` are used when
present.  The daemon calls :func:`install` when it builds its app.
"""

# Imports inside functions: memory at rest (loaded on request).
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web

from ..alloc.policy import load
from ..model import HostSnapshot
from ..sanitize import dumps
from . import access as privacy
from .gpuseconds import UsageCounters
from .routes import RouteDef, add_routes, install_access

if TYPE_CHECKING:  # pragma: no cover
    from ..thresholds import Rule, ThresholdEngine, ThresholdEvent
    from .routes import RouteDef

log = logging.getLogger("gpusd.monitor")

WEB_DIR = Path(__file__).resolve().parent.parent / "web"
_ASSETS = {"app.js": "application/javascript", "style.css": "text/css", "history.js": "application/javascript",
           "uPlot.iife.min.js": "application/javascript", "uPlot.min.css": "text/css"}
# web/vendor/: uPlot, with its licence
_VENDORED = {"uPlot.iife.min.js", "uPlot.min.css"}
# connect-src: the dashboard also reads /api/v1/alerts of the other daemons of the fleet (on LAN addresses).
_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self' http: https:; "
        "object-src 'none'; base-uri 'none'; frame-ancestors 'none'")


class MonitoredDaemon(Protocol):
    """What :func:`install` needs from a daemon."""

    @property
    def token(self) -> str | None:
        """The fleet secret; None: no writes, private fields for loopback readers only."""
        ...

    @property
    def thresholds(self) -> Sequence[str | Rule]:
        """Rules from the command line and config file (already merged)."""
        ...

    def latest_snapshot(self) -> HostSnapshot | None:
        """The last sample of this host's GPUs (leases attached), or None before the first."""
        ...

    def publish(self, event: str, data: dict[str, Any]) -> None:
        """Send an event to every subscriber of ``/api/v1/events`` (the daemon relays it to the fleet
        stream as ``threshold_exceeded``/``threshold_cleared``)."""
        ...


class Monitor:
    """What :func:`install` set up; kept in the app as ``app[MONITOR_KEY]``."""

    def __init__(self, daemon: MonitoredDaemon, rules: Sequence[Rule], access: privacy.Access,
                 interval: float, dcgm: bool = False, user_metrics: bool = False) -> None:
        self.daemon = daemon
        # also serve the DCGM exporter's metric names
        self.dcgm = dcgm
        self.rules = list(rules)
        # with rules only: without, thresholds.py stays unloaded
        self.engine: ThresholdEngine | None = None
        if self.rules:
            from ..thresholds import ThresholdEngine

            self.engine = ThresholdEngine(self.rules)
        self.access = access
        self.interval = interval
        self._last_ts: float | None = None
        self._registry: Any = None
        # the registry without per-user series
        self._public: Any = None
        # per-user usage series for readers who may see private data
        self.user_metrics = user_metrics

        self.usage = UsageCounters(max_gap=max(30.0, 10 * interval))
        self._usage_ts: float | None = None
        # per reader level (private or not): (the snapshot, its clocks, the bytes built from it)
        self._built: dict[bool, tuple[HostSnapshot | None, tuple[float | None, ...], bytes]] = {}
        # how many times the per-sample part of /metrics was built
        self.builds = 0
        # the registry of the daemon's own process_* series (read at every scrape)
        self._process: Any = None

    # thresholds ---------------------------------------------------------------------------------
    def evaluate(self, snap: HostSnapshot | None = None, now: float | None = None) -> list[ThresholdEvent]:
        """Run the rules on ``snap`` (default: the daemon's latest, if new) and publish the changes."""
        snap = snap if snap is not None else self.daemon.latest_snapshot()
        if snap is None or self.engine is None or snap.timestamp == self._last_ts:
            return []
        self._last_ts = snap.timestamp
        events = self.engine.update(snap, now)
        for ev in events:
            level = logging.WARNING if ev.state == "exceeded" else logging.INFO
            log.log(level, "threshold %s: %s", ev.state, ev.message)
            try:
                self.daemon.publish("threshold", ev.to_dict())
            except Exception:
                log.exception("publishing a threshold event failed")
        return events

    async def _watch(self) -> None:
        while True:
            try:
                self.evaluate()
            except Exception:
                log.exception("threshold evaluation failed")
            await asyncio.sleep(self.interval)

    # metrics -------------------------------------------------------------------------------------
    def count_usage(self, snap: HostSnapshot | None = None) -> None:
        """Feed the usage counters a new sample (``on_sample``, else the watch task)."""
        snap = snap if snap is not None else self.daemon.latest_snapshot()
        if snap is None or snap.timestamp == self._usage_ts:
            return
        self._usage_ts = snap.timestamp
        self.usage.add(snap)

    def metrics(self, private: bool = False) -> bytes:
        """/metrics; ``private``: the reader may see private data (per-user series where turned on).

        Built once per sample: what the GPU, usage, lease and alert series say changes only with a new
        snapshot (a new sample, its usage counted, its thresholds evaluated), so every scrape until the
        next sample gets the same bytes; only the daemon's own process_* series are read at each scrape."""
        from .metrics import LeaseCollector, UsageCollector, make_registry, process_registry, render

        per_user = private and self.user_metrics
        if (self._registry if per_user else self._public) is None:
            latest = lambda: [self.daemon.latest_snapshot()]
            registry = make_registry(latest, self.engine.active if self.engine is not None else None, dcgm=self.dcgm,
                                     process_metrics=False,
                                     extra=[UsageCollector(self.usage, lambda: per_user),
                                            LeaseCollector(latest, lambda: per_user, _policy)])
            if per_user:
                self._registry = registry
            else:
                self._public = registry
        if not isinstance(getattr(self.daemon, "on_sample", None), list):
            # no per-sample callbacks: count what each scrape finds new
            self.count_usage()
        snap = self.daemon.latest_snapshot()
        key = (snap.timestamp if snap is not None else None, self._usage_ts, self._last_ts)
        built = self._built.get(per_user)
        if built is None or built[0] is not snap or built[1] != key:
            # the snapshot itself is held (so its identity is not reused) with the clocks of what was fed
            built = self._built[per_user] = (snap, key, render(self._registry if per_user else self._public))
            self.builds += 1
        if self._process is None:
            self._process = process_registry()
        return built[2] + render(self._process)

    def alerts(self) -> dict[str, Any]:
        active = self.engine.active() if self.engine is not None else []
        return {"rules": [r.to_dict() for r in self.rules], "alerts": [e.to_dict() for e in active]}


MONITOR_KEY: Any = "gpusd.monitor"


def _app_key() -> Any:
    global MONITOR_KEY
    if isinstance(MONITOR_KEY, str) and hasattr(web, "AppKey"):
        MONITOR_KEY = web.AppKey("gpusd.monitor", Monitor)
    return MONITOR_KEY


def install(app: web.Application, daemon: MonitoredDaemon, *, trust_loopback: bool = True,
            interval: float | None = None) -> Monitor:
    """Add metrics, dashboard, alerts, access control and threshold evaluation to ``app``.

    Call before the app starts.  ``interval``: how often to look for a new snapshot (default: half
    the daemon's ``interval`` attribute, else 0.5 s).  Raises :class:`~gpusd.errors.ConfigError` for
    a bad rule."""

    rules: list[Rule] = []
    # the rules' parser only where there are rules
    if getattr(daemon, "thresholds", None):
        from ..thresholds import load_rules

        rules = load_rules(daemon.thresholds)
    access = privacy.Access(getattr(daemon, "token", None), trust_loopback=trust_loopback,
                            own_addresses=lambda: getattr(daemon, "addresses", None) or (),
                            own_names=lambda: _own_names(daemon),
                            own_ports=lambda: _own_ports(daemon),
                            node_id=lambda: getattr(daemon, "node_id", None),
                            cert_fp=lambda: getattr(daemon, "cert_fp", None),
                            host_name=lambda: getattr(daemon, "hostname", None))
    if interval is None:
        interval = max(0.1, float(getattr(daemon, "interval", 1.0) or 1.0) / 2)
    monitor = Monitor(daemon, rules, access, interval, dcgm=bool(getattr(daemon, "dcgm_metrics", True)),
                      user_metrics=bool(getattr(daemon, "user_metrics", False)))
    app[_app_key()] = monitor

    # every route of the app applies these rules (daemon/routes.py)
    install_access(app, access)
    add_routes(app, routes(monitor))
    on_sample = getattr(daemon, "on_sample", None)
    if isinstance(on_sample, list):
        # every sample, for the usage counters
        on_sample.append(monitor.count_usage)
    if rules and isinstance(on_sample, list):
        on_sample.append(lambda snap: monitor.evaluate(snap))
    elif rules:
        async def thresholds_ctx(app: web.Application) -> AsyncIterator[None]:
            task = asyncio.create_task(monitor._watch(), name="gpusd-thresholds")
            yield
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

        app.cleanup_ctx.append(thresholds_ctx)
    log.debug("monitoring installed: %d threshold rule(s), fleet secret %s", len(rules),
              "set" if access.token else "not set")
    return monitor


def routes(monitor: Monitor) -> list[RouteDef]:
    """Metrics, the dashboard and alerts as a route table; the handlers use ``monitor`` only."""


    async def metrics(request: web.Request) -> web.Response:
        # About a millisecond of CPU per scrape (BENCHMARKS.md): no thread needed.
        return web.Response(body=monitor.metrics(private=privacy.can_see_private(request)),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def index(request: web.Request) -> web.StreamResponse:
        return web.FileResponse(WEB_DIR / "index.html", headers={
            "Content-Type": "text/html; charset=utf-8", "Cache-Control": "no-cache",
            "Content-Security-Policy": _CSP, "X-Content-Type-Options": "nosniff"})

    async def asset(request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        kind = _ASSETS.get(name)
        if kind is None:
            raise web.HTTPNotFound()
        return web.FileResponse(WEB_DIR / ("vendor/" + name if name in _VENDORED else name), headers={
            "Content-Type": f"{kind}; charset=utf-8", "Cache-Control": "no-cache",
            "X-Content-Type-Options": "nosniff"})

    async def alerts(request: web.Request) -> web.Response:
        # Public (no private fields): any daemon's dashboard may read it, hence the CORS header.
        # strict JSON: a NaN reading must not break every dashboard
        return web.json_response(monitor.alerts(), headers={"Access-Control-Allow-Origin": "*"}, dumps=dumps)

    return [RouteDef("GET", "/metrics", metrics),
            RouteDef("GET", "/", index),
            RouteDef("GET", "/assets/{name}", asset),
            RouteDef("GET", "/api/v1/alerts", alerts)]


def _own_names(daemon: Any) -> list[str]:
    """The names a browser or client may use for this daemon: its host name, its mDNS names."""
    announcer = getattr(daemon, "announcer", None)
    out = [n for n in (getattr(daemon, "hostname", None), getattr(announcer, "instance", None))
           if isinstance(n, str) and n]
    return out


def _own_ports(daemon: Any) -> list[int]:
    """The daemon's HTTP (and HTTPS) ports; empty when it does not say (any port is accepted)."""
    return [p for p in (getattr(daemon, "port", None), getattr(daemon, "tls_port", None))
            if isinstance(p, int) and not isinstance(p, bool) and p > 0]


def _policy() -> Any:
    """The host's fair-use policy (its caps go to /metrics); None where it cannot be read."""
    try:
        return load()
    except Exception:
        # a broken policy file is the lease path's to report, not the scrape's
        return None
