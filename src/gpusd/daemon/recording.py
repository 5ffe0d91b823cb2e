"""Wiring the usage history (:mod:`gpusd.usage`) into a daemon: one call, :func:`install`.

``install(app, daemon)`` — when the daemon builds its app — adds:

* a :class:`~gpusd.usage.recorder.Recorder` on ``history.sqlite`` in the state directory, fed from
  ``daemon.on_sample`` (the sampling loop hands the snapshot over and goes on: the writes happen on
  the recorder's thread), opened when the app starts and drained when it stops;
* the idle watch (:mod:`gpusd.usage.idle`): ``lease_idle`` & co. events through ``daemon.publish``;
* ``GET /api/v1/history/series?gpu=UUID|INDEX&range=1h|6h|24h|7d|30d``: one GPU over time (public);
* ``GET /api/v1/history/usage?since=7d`` (or ``from=&to=``, epoch seconds): usage per GPU for
  everyone, per user and job owners only for readers who may see private fields;
* ``GET /api/v1/history/idle``: the leases idle right now (owners private).

A database that cannot be opened (a read-only disk, a damaged file) is logged and the daemon serves
without history: history is a record, never a reason to stop sampling.
"""

# Imports inside functions: optional or heavy packages.
from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..alloc.policy import load, shares_from_usage, write_shares
from ..model import HostSnapshot, redact
from ..sanitize import dumps
from ..units import parse_duration
from ..usage import query
from ..usage.db import Retention, connect
from ..usage.idle import IdlePolicy, IdleWatch, Releaser
from ..usage.query import RANGES
from ..usage.query import series as q_series
from ..usage.query import usage as q_usage
from ..usage.recorder import Recorder
from .access import can_see_private
from .routes import RouteDef, add_routes

if TYPE_CHECKING:  # pragma: no cover
    from aiohttp import web

    from ..usage.recorder import Recorder
    from .config import DaemonConfig
    from .routes import RouteDef

log = logging.getLogger("gpusd.history")

# seconds between looks at the fair-use policy file (cached while unchanged)
POLICY_EVERY = 5.0
# seconds between fair-share summaries written to the state directory
SHARES_EVERY = 60.0


class RecordedDaemon(Protocol):
    @property
    def config(self) -> "DaemonConfig": ...
    @property
    def state_dir(self) -> Path: ...
    @property
    def hostname(self) -> str: ...
    @property
    def node_id(self) -> str: ...
    @property
    def on_sample(self) -> list[Callable[[HostSnapshot], Any]]: ...
    def publish(self, event: str, data: Any) -> None: ...


class Recording:
    """What :func:`install` set up (``daemon.recording``)."""

    def __init__(self, daemon: RecordedDaemon, releaser: Releaser | None = None) -> None:
        cfg = daemon.config
        self.daemon = daemon
        self.keep = Retention(retention=cfg.retention, max_bytes=cfg.history_size)
        self.policy = IdlePolicy(idle_after=cfg.idle_after, release=cfg.idle_release, grace=cfg.idle_grace)
        self.path = cfg.history_db or (Path(daemon.state_dir) / "history.sqlite")
        self.recorder: Recorder | None = None
        self.watch = IdleWatch(self.policy, self._notify, releaser)
        # monotonic: when the fair-use policy file was last looked at
        self._policy_checked = 0.0
        self._shares_written = 0.0
        self._shares_busy = False
        self._apply_policy()

    def open(self) -> None:
        if not self.daemon.config.record:
            return
        try:
            self.recorder = Recorder(self.path, self.daemon.config.interval, self.keep, self.daemon.hostname)
            log.info("recording usage history in %s", self.path)
        except Exception as exc:  # noqa: BLE001 - the daemon serves without history
            log.warning("cannot open the history database %s: %s; serving without history", self.path, exc)

    def close(self) -> None:
        if self.recorder is not None:
            self.recorder.close()
            self.recorder = None

    def on_sample(self, snap: HostSnapshot) -> None:
        if self.recorder is not None:
            self.recorder.submit(snap)
        now = time.monotonic()
        if now - self._policy_checked >= POLICY_EVERY:
            self._policy_checked = now
            self._apply_policy()
        self.watch.update(snap)

    # -- leases the daemon grants (its lease socket, daemon/leasesock.py) -------------------------
    def lease_started(self, lease_id: str, user: str | None, uid: int | None, command: str | None,
                      gpus: list[str]) -> None:
        """Write the lease's job record before the client hears of its lease (bounded wait): a lease
        the daemon granted is in the history even if the daemon is killed a moment later."""
        self._record("lease", lease_id, lambda r: r.lease_started(lease_id, user, uid, command, gpus, time.time()))

    def lease_ended(self, lease_id: str) -> None:
        """The lease's holder is gone (its connection ended): its record ends now."""
        self._record("the end of lease", lease_id, lambda r: r.lease_ended(lease_id, time.time()))

    def lease_timed_out(self, lease_id: str) -> None:
        """The lease's job ran out of its ``--time``: its record says so (it ends when its connection does)."""
        self._record("the time-out of lease", lease_id, lambda r: r.mark_timed_out(lease_id, time.time()))

    def _record(self, what: str, lease_id: str, write: Callable[[Recorder], object]) -> None:
        """``write`` to the history, when there is one; a failure is logged, never raised."""
        recorder = self.recorder
        if recorder is not None:
            try:
                write(recorder)
            except Exception as exc:  # noqa: BLE001 - history is a record, never a reason to refuse a lease
                log.warning("history: cannot record %s %s: %r", what, lease_id, exc)

    # -- the fair-use policy file (alloc/policy.py): idle release and the fair-share summary ------
    def _apply_policy(self) -> None:
        """The policy file's idle terms override the configuration's (warn after N minutes idle, release
        M minutes later); with ``fair_share_days``, the users' GPU-hours go to the state directory."""
        pol = load()
        cfg = self.daemon.config
        if pol.idle_warn_minutes is not None:
            self.policy.idle_after = pol.idle_warn_minutes * 60.0
            self.policy.release = pol.idle_release_minutes is not None
            self.policy.grace = (pol.idle_release_minutes or 0.0) * 60.0
        else:
            self.policy.idle_after, self.policy.release, self.policy.grace = (cfg.idle_after, cfg.idle_release,
                                                                              cfg.idle_grace)
        if (pol.fair_share_days is not None and self.recorder is not None and not self._shares_busy
                and time.monotonic() - self._shares_written >= SHARES_EVERY):
            self._shares_written = time.monotonic()
            self._shares_busy = True

            threading.Thread(target=self._write_shares, args=(pol.fair_share_days,), name="gpusd-shares",
                             daemon=True).start()

    def _write_shares(self, days: float) -> None:
        try:
            now = time.time()
            answer = self._read(lambda conn: query.usage(conn, now - days * 86400, now, now, self.keep, True))
            write_shares(self.daemon.state_dir, shares_from_usage(answer), days)
        except Exception as exc:  # noqa: BLE001 - the order falls back to first come, first served
            log.warning("cannot write the fair-share summary: %s", exc)
        finally:
            self._shares_busy = False

    def _notify(self, event: str, data: dict[str, Any]) -> None:
        level = logging.WARNING if event in ("lease_release_notice", "lease_released") else logging.INFO
        log.log(level, "%s: lease %s on %s", event, data.get("lease_id"), ",".join(data.get("gpus") or []))
        if self.recorder is not None and event in ("lease_idle", "lease_released"):
            self.recorder.mark_idle(str(data.get("lease_id")), time.time(), released=event == "lease_released")
        self.daemon.publish(event, {"host": self.daemon.hostname, "node_id": self.daemon.node_id, **data})

    # -- reading (in a worker thread, on a read-only connection of its own) ---------------------
    def _read(self, fn: Callable[[Any], Any]) -> Any:
        conn = connect(self.path, readonly=True)
        try:
            return fn(conn)
        finally:
            conn.close()


def install(app: "web.Application", daemon: RecordedDaemon, releaser: Releaser | None = None) -> Recording:
    rec = Recording(daemon, releaser)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        await asyncio.get_running_loop().run_in_executor(None, rec.open)
        yield
        await asyncio.get_running_loop().run_in_executor(None, rec.close)

    app.cleanup_ctx.append(lifecycle)
    daemon.on_sample.append(rec.on_sample)
    add_routes(app, routes(rec))
    return rec


def routes(rec: Recording) -> "list[RouteDef]":
    """The usage history's route table; the handlers use ``rec`` (and the :class:`RecordedDaemon`
    it holds), nothing else of the daemon."""
    from aiohttp import web

    daemon = rec.daemon
    # history queries run on worker threads: at most two at a time, so a burst of report requests
    # queues instead of taking every thread (and core) from the daemon
    busy = asyncio.Semaphore(2)

    async def read(fn: Callable[[Any], Any]) -> Any:
        async with busy:
            try:
                return await asyncio.get_running_loop().run_in_executor(None, rec._read, fn)
            except (sqlite3.Error, OSError) as exc:
                log.warning("cannot read the history database %s: %s", rec.path, exc)
                raise web.HTTPServiceUnavailable(
                    text='{"error": "the history database cannot be read: see the daemon\'s log"}',
                    content_type="application/json") from None

    def _json(data: object, status: int = 200, cors: bool = False) -> web.Response:
        headers = {"Cache-Control": "no-store"}
        # public data: the dashboard served by another daemon of the fleet may read it
        if cors:
            headers["Access-Control-Allow-Origin"] = "*"
        return web.Response(text=dumps(data, separators=(",", ":")), status=status,
                            content_type="application/json", headers=headers)

    def _unavailable() -> web.Response | None:
        if rec.recorder is None and not rec.path.exists():
            return _json({"error": "this daemon records no history (--no-record, or its database could "
                                   "not be opened: see its log)"}, status=404)
        return None

    async def series(request: web.Request) -> web.Response:
        gone = _unavailable()
        if gone is not None:
            return gone
        gpu = request.query.get("gpu", "0")[:128]
        text = request.query.get("range", "1h")
        try:
            seconds = RANGES.get(text) or parse_duration(text)
            if seconds > 400 * 86400:
                raise ValueError("range: at most 400 days")
            now = _now(request)
        except ValueError as exc:
            return _json({"error": str(exc)}, status=400)
        try:
            out = await read(lambda c: q_series(c, gpu, seconds, now, rec.keep))
        except KeyError:
            return _json({"error": f"no history of GPU {gpu!r}"}, status=404, cors=True)
        return _json(out, cors=True)

    async def usage(request: web.Request) -> web.Response:
        gone = _unavailable()
        if gone is not None:
            return gone
        try:
            now = _now(request)
            end = float(request.query["to"]) if "to" in request.query else now
            if "from" in request.query:
                start = float(request.query["from"])
            else:
                start = end - parse_duration(request.query.get("since", "7d"))
            if not (0 <= start < end < 1e11):
                raise ValueError("from must be before to (seconds since the epoch)")
        except ValueError as exc:
            return _json({"error": str(exc)}, status=400)
        private = can_see_private(request)
        out = await read(lambda c: q_usage(c, start, end, max(now, end), rec.keep, private,
                                           rec.policy.idle_after, daemon.hostname, daemon.node_id))
        return _json(out)

    async def idle(request: web.Request) -> web.Response:
        data = {"idle_after": rec.policy.idle_after, "release": rec.policy.release, "grace": rec.policy.grace,
                "idle": rec.watch.idle()}
        # A cross-origin reader (a page of another origin, which the browser marks with Origin) gets
        # the public part only, whoever runs the browser: CORS must not hand owners to any web page.
        cross = "Origin" in request.headers
        return _json(data if can_see_private(request) and not cross else redact(data), cors=cross)

    return [RouteDef("GET", "/api/v1/history/series", series),
            RouteDef("GET", "/api/v1/history/usage", usage),
            RouteDef("GET", "/api/v1/history/idle", idle)]


def _now(request: "web.Request") -> float:
    """Now, or the ``now=`` a test or a report of simulated time asks for (epoch seconds)."""
    if "now" in request.query:
        value = float(request.query["now"])
        if not 0 < value < 1e11:
            raise ValueError("now: seconds since the epoch")
        return value
    return time.time()
