"""The daemon object: sampling loop, history, event publishing, HTTP server, announcement.

Everything another part of gpusd needs is reachable from one :class:`Daemon`:

* ``daemon.snapshot`` — the latest :class:`~gpusd.model.HostSnapshot` (leases attached);
* ``daemon.recent`` — per-GPU ring buffers (:class:`~gpusd.daemon.recent.RecentSamples`);
* ``daemon.publish(event, data)`` — send an event to every ``/api/v1/events`` listener;
* ``daemon.on_sample`` — callbacks ``fn(snapshot)`` run on the event loop after every sample;
* ``daemon.app`` — the aiohttp application: add routes before :meth:`start`;
* ``daemon.config`` — the :class:`~gpusd.daemon.config.DaemonConfig`;
* ``daemon.recording`` — the usage history (:mod:`.recording`, docs/history.md), fed by an
  ``on_sample`` callback that only queues the snapshot for its writer thread.

Metrics, the dashboard, access control and threshold evaluation (:mod:`.monitoring`) are wired into
the app when the daemon is built; a failure there (a bad rule, say) stops the daemon from starting:
a daemon that cannot enforce access must not serve.

The blocking NVML snapshot runs in a one-thread executor: the event loop (HTTP, heartbeats, mDNS)
never waits on the driver.  The daemon opens one backend, ``daemon.inventory``
(:class:`~gpusd.daemon.backend.SharedBackend`), and hands it to the lease authority and the pool:
every lease is decided on the readings the API serves.  A failing NVML, a lost GPU or a changed
network is logged and lived with.
"""

# Imports inside functions: memory at rest (loaded on request).
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from aiohttp import web

from .. import inventory
from ..alloc.leases import LeaseStore
from ..errors import BackendUnavailable, GpusdError
from ..identity import HostIdentity
from ..identity import hostname as local_hostname
from ..identity import node_id as local_node_id
from ..identity import state_dir as default_state_dir
from ..jobs.containers import name_containers
from ..model import HostSnapshot, shape_of
from ..wire.mdns import local_ipv4_addresses, open_zeroconf, resolve_interfaces
from ..wire.sse import format_event
from .announce import Announcer
from .backend import SharedBackend
from .bookings import install as install_bookings
from .config import FD_RESERVE, DaemonConfig, open_file_limit
from .events import EventHub
from .fleet import Fleet
from .guard import ConnectionGuard, GuardedSite
from .http import build_app
from .leasesock import start_authority
from .logs import flush as flush_log_summaries
from .monitoring import install as install_monitoring
from .pool import install as install_pool
from .recent import RecentSamples
from .recording import install as install_recording

if TYPE_CHECKING:  # pragma: no cover
    from zeroconf.asyncio import AsyncZeroconf

    from ..inventory import Backend
    from .announce import Announcer
    from .fleet import Fleet
    from .guard import ConnectionGuard

log = logging.getLogger(__name__)

# seconds between attempts to reopen a failing inventory backend
REOPEN_AFTER = 5.0
# at most this long, at stop, for the event streams to write their bye
STREAM_FLUSH = 1.0


class Daemon:
    def __init__(self, config: DaemonConfig, backend: "Backend | None" = None) -> None:
        config.validate()
        self.config = config
        self.state_dir = config.state_dir or default_state_dir()
        self.hostname = config.hostname or local_hostname()
        self.node_id = config.node_id or _node_id(config)
        self.interfaces: list[str] | None = None  # resolved at start
        # the one inventory backend: sampling, the lease authority, the pool and rebalancing (daemon/backend.py)
        self.inventory = SharedBackend(lambda: self._open_backend(), backend)
        self.snapshot: HostSnapshot | None = None
        # not the usage history (usage/)
        self.recent = RecentSamples(config.history, config.interval)
        self.events = EventHub(max_subscribers=config.max_subscribers, per_peer=config.max_subscribers_per_peer,
                               reserved=config.reserved_subscribers if config.token else 0)
        self.on_sample: list[Callable[[HostSnapshot], Any]] = []
        self.app: web.Application = build_app(self)
        self.zc: AsyncZeroconf | None = None
        self.announcer: Announcer | None = None
        self.fleet: Fleet | None = None
        self.port = config.port
        # HTTPS port once serving TLS
        self.tls_port: int | None = None
        # the TLS certificate's fingerprint (announced, pinned by clients)
        self.cert_fp: str | None = None
        # gpusd.daemon.tls.Identity
        self._tls: Any = None
        self.addresses: list[str] = []
        self.started_at = time.time()
        self.samples = 0
        self.sample_errors = 0
        self._runner: web.AppRunner | None = None
        # the HTTP connection limits, set at start
        self.guard: ConnectionGuard | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="gpusd-sample")
        self._tasks: list[asyncio.Task[Any]] = []
        self._stopping = False
        self._last_event_key: Any = None
        self._last_shape: Any = None
        # the snapshot _event_bytes was built from
        self._event_of: HostSnapshot | None = None
        self._event_bytes = b""
        self._backend_failed_at = 0.0
        self._leases: Any = None
        # daemon/slurmnode.py: --slurm, --slurmctld
        self.slurm: Any = None
        # daemon/leasesock.py: the lease authority, where we can be it
        self._lease_server: Any = None
        # whether this daemon is the lease authority, and why not (start line, status, /api/v1/host)
        self.authority: dict[str, Any] = {"serving": False, "why": "leases are not read by this daemon",
                                          "socket": None}
        # its lock directory's authority lock (daemon/process.py)
        self.authority_claim: int | None = None

        install_monitoring(self.app, self)
        # leases for remote holders (docs/pool.md)
        self.pool = install_pool(self.app, self)
        # GPUs booked ahead (docs/pool.md, "Time")
        self.bookings = install_bookings(self.app, self, self.pool)
        # usage history (docs/history.md)
        # the idle policy may release idle remote reservations (flock leases of local jobs it cannot)
        self.recording = install_recording(self.app, self, releaser=self.pool)
        self.rebalancing: Any = None
        if config.rebalance or config.rebalance_policy is not None:
            from .rebalancing import install as install_rebalancing  # docs/jobs.md

            self.rebalancing = install_rebalancing(self)

    # -- extension points ---------------------------------------------------------------------
    @property
    def history(self) -> RecentSamples:
        """The recent samples by their older name (:attr:`recent`; the usage history is ``usage/``)."""
        return self.recent

    @property
    def backend(self) -> "Backend | None":
        """The inventory backend read now (``self.inventory`` is the shared one every part holds)."""
        return self.inventory.current

    @backend.setter
    def backend(self, backend: "Backend | None") -> None:
        self.inventory.current = backend

    @property
    def token(self) -> str | None:
        return self.config.token

    @property
    def thresholds(self) -> list[str]:
        return self.config.thresholds

    @property
    def interval(self) -> float:
        return self.config.interval

    @property
    def dcgm_metrics(self) -> bool:
        return self.config.dcgm_metrics

    @property
    def user_metrics(self) -> bool:
        return self.config.user_metrics

    def latest_snapshot(self) -> HostSnapshot | None:
        return self.snapshot

    def publish(self, event: str, data: Any) -> None:
        """Send ``event`` with JSON ``data`` to every listener of ``/api/v1/events``."""
        self.events.publish(event, data)

    def snapshot_event(self) -> bytes:
        """The ``snapshot`` event of the current snapshot: built once per sample (it is what every
        new event-stream reader gets first, and what is published when the snapshot changed)."""
        snap = self.snapshot
        assert snap is not None
        if self._event_of is not snap:
            # strict JSON: no NaN/Infinity
            self._event_bytes = format_event("snapshot", snap.to_dict())
            self._event_of = snap
        return self._event_bytes

    @property
    def urls(self) -> list[str]:
        return [f"http://{a}:{self.port}/api/v1" for a in self.addresses]

    @property
    def tls_urls(self) -> list[str]:
        """The HTTPS URLs (trust on), beside :attr:`urls`: every port the daemon serves."""
        return [f"https://{a}:{self.tls_port}/api/v1" for a in self.addresses] if self.tls_port else []

    # -- start/stop ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Open the inventory, take a first sample, serve HTTP, announce.  Raises GpusdError."""
        loop = asyncio.get_running_loop()
        self.started_at = time.time()
        self.interfaces = resolve_interfaces(self.config.interfaces)
        # mDNS first: the host name is probed (about a second, RFC 6762 §8.1) while the GPUs are read
        # and HTTP starts; the announcer is the daemon's once the first sample is in (docs/wire-format.md)
        self.addresses = list(self.interfaces) if self.interfaces else local_ipv4_addresses()
        self.zc = await open_zeroconf(self.interfaces)
        identity = HostIdentity(hostname=self.hostname, node_id=self.node_id)
        announcer = Announcer(self.config, identity, self.zc, self.addresses, self.port,
                              pinned=self.interfaces is not None)
        announcer.probe_host()
        try:
            await self._start_serving(loop, announcer)
        except BaseException:
            # stop() will not see it: end its probe and listener here
            if self.announcer is None:
                await announcer.stop()
            raise

    async def _start_serving(self, loop: asyncio.AbstractEventLoop, announcer: "Announcer") -> None:
        await loop.run_in_executor(self._executor, self.inventory.open)
        snap = await loop.run_in_executor(self._executor, self._read)
        self._accept(snap)
        if self.config.tls or (self.config.tls is None and self.config.token):
            from .tls import load_or_create

            self._tls = await loop.run_in_executor(
                self._executor, load_or_create, self.state_dir, f"gpusd {self.hostname} {self.node_id}")
        await self._start_http()
        if self.config.leases:
            # the lease server's from here
            claim, self.authority_claim = self.authority_claim, None
            self._lease_server, why = await start_authority(self.config.simulate, self.config.slurm,
                                                          backend=self.inventory, claim=claim)
            self.authority = {"serving": self._lease_server is not None, "why": why,
                              "socket": str(self._lease_server.path) if self._lease_server is not None else None}
            # its leases' records begin and end with them (docs/history.md)
            if self._lease_server is not None:
                self._lease_server.history = self.recording
                self._lease_server.bookings = self.bookings
        if self.config.slurm or self.config.slurmctld is not None:  # docs/slurm.md
            from .slurmnode import SlurmPart

            self.slurm = SlurmPart(self)
            await self.slurm.start()

        pinned_to_loopback = bool(self.interfaces) and all(a.startswith("127.") for a in self.interfaces or ())
        self.fleet = (Fleet(self.config, self.zc, allow_loopback=pinned_to_loopback)
                      if self.config.fleet != "off" else None)
        announcer.port, announcer.tls_port, announcer.cert_fp = self.port, self.tls_port, self.cert_fp
        self.announcer = announcer
        try:
            await self.announcer.start(snap)
        except Exception as exc:
            raise GpusdError(f"cannot announce on mDNS: {exc}") from None
        self._tasks.append(asyncio.ensure_future(self._sample_loop()))
        self._tasks.append(asyncio.ensure_future(self.announcer.watch_network(self.config.netwatch)))
        if self.fleet is not None and self.config.fleet == "on":
            self._tasks.append(asyncio.ensure_future(self.fleet.ensure_started()))
        # what start-up freed goes back to the system (daemon memory at rest)
        trim_heap()

    def _open_backend(self) -> "Backend":
        if self.config.slurmctld is not None and not self.config.slurm and not self.config.simulate:
            # a Slurm controller's host: it needs no GPU nor GPU library
            from .slurmnode import NoGpus

            return NoGpus(self.hostname, self.node_id)
        # for /metrics (DCGM's counters); looked up on the package, which tests replace
        return inventory.open_backend(self.config.simulate, telemetry=True)

    async def _start_http(self) -> None:
        cfg = self.config
        self.guard = ConnectionGuard(connection_cap(cfg.max_connections), cfg.header_timeout,
                                     per_peer=cfg.max_connections_per_peer,
                                     # no secret: nobody can sign, nothing to keep
                                     reserved=cfg.reserved_connections if cfg.token else 0)
        self._runner = web.AppRunner(self.app, handle_signals=False, access_log=None, shutdown_timeout=1.0,
                                     keepalive_timeout=cfg.keepalive_timeout)
        await self._runner.setup()
        hosts: list[str | None] = list(self.interfaces) if self.interfaces else [None]
        # what the error names: the port that failed
        trying = f"HTTP on {{where}} port {self.port}"
        try:
            # one site per pinned address (all of them bind one port)
            for host in hosts:
                site = GuardedSite(self._runner, self.guard, host=host, port=self.port, reuse_address=True)
                await site.start()
                if self.port == 0 and site.bound_port:
                    self.port = site.bound_port
            if self._tls is not None:
                ctx = self._tls.server_context()
                tls_port = self.config.tls_port if self.config.tls_port is not None else (
                    self.port + 1 if self.config.port else 0)
                trying = f"HTTPS on {{where}} port {tls_port} (HTTP on port {self.port})"
                for host in hosts:
                    site = GuardedSite(self._runner, self.guard, host=host, port=tls_port, reuse_address=True,
                                       ssl_context=ctx)
                    await site.start()
                    if tls_port == 0 and site.bound_port:
                        tls_port = site.bound_port
                self.tls_port, self.cert_fp = tls_port, self._tls.fingerprint
        except OSError as exc:
            await self._runner.cleanup()
            self._runner = None
            where = ",".join(h for h in hosts if h) or "all addresses"
            raise GpusdError(f"cannot serve {trying.format(where=where)}: {exc.strerror or exc}") from None
        log.info("HTTP API on %s port %d%s (at most %d connections, %g s to send a request head)",
                 ",".join(h for h in hosts if h) or "all addresses", self.port,
                 f", HTTPS port {self.tls_port} (certificate {self.cert_fp})" if self.tls_port else "",
                 self.guard.max_connections, self.guard.header_timeout)

    async def stop(self) -> None:
        """Say goodbye (``bye`` on every stream, mDNS goodbye packets) and shut down."""
        if self._stopping:
            return
        self._stopping = True
        for t in self._tasks:
            t.cancel()
        self.events.close(format_event("bye", {}))
        if self.fleet is not None:
            await self.fleet.stop()
        if self.announcer is not None:
            await self.announcer.stop()
        # the node leaves Slurm before its leases' authority goes
        if self.slurm is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.slurm.stop(), 40)
        if self._lease_server is not None:
            await self._lease_server.stop()
        # every stream wrote its bye and ended (a deaf one: bounded)
        await self.events.drained(STREAM_FLUSH)
        if self._runner is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._runner.cleanup(), 5)
        if self.zc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.zc.async_close(), 5)
        with contextlib.suppress(Exception):
            await asyncio.get_running_loop().run_in_executor(self._executor, self.inventory.close)
        self._executor.shutdown(wait=False)
        log.info("stopped")

    # -- sampling -----------------------------------------------------------------------------
    def _read(self) -> HostSnapshot:
        """One sample (in the executor thread): the backend's snapshot plus this machine's leases."""
        snap = self.inventory.snapshot()
        if self.config.leases:
            try:
                # Where this daemon is the lease authority, the leases it honours: its own, and the
                # confirmed ones of the shared directory, never a lock held there without a lease (it
                # blocks nothing here, so it must not make a GPU look taken to the fleet).
                self._leases = LeaseStore.for_daemon()
                self._leases.attach(snap)

                # who started each GPU process's container, where a gpusd job did
                name_containers(snap)
            except Exception as exc:
                # leases are a detail; never lose a sample over them
                log.debug("cannot read leases: %r", exc)
        snap.hostname = self.hostname
        snap.node_id = self.node_id
        booked = getattr(self, "bookings", None)
        if booked is not None:
            snap.bookings = booked.infos()
        return snap

    async def _sample_loop(self) -> None:
        loop = asyncio.get_running_loop()
        interval = self.config.interval
        next_at = loop.time() + interval
        while True:
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            now = loop.time()
            next_at += interval
            # a slow sample: skip the ticks it missed
            if next_at < now:
                next_at = now + interval
            try:
                snap = await loop.run_in_executor(self._executor, self._read)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                await self._sample_failed(exc)
                continue
            self._accept(snap)
            # a rate-limited log's summary lines, due or not (cheap)
            flush_log_summaries()

    def _accept(self, snap: HostSnapshot) -> None:
        self.samples += 1
        if self.sample_errors:
            log.info("sampling works again")
            self.sample_errors = 0
        self.recent.add(snap)
        self._publish_snapshot(snap)

    def _publish_snapshot(self, snap: HostSnapshot) -> None:
        """Make ``snap`` the current snapshot: event stream (when visibly changed), TXT record,
        ``on_sample`` callbacks (threshold rules)."""
        self.snapshot = snap
        # once per sample: the change test and the event share it
        data = snap.to_dict()
        # what a client shows of it
        key = {k: v for k, v in data.items() if k != "timestamp"}
        if key != self._last_event_key:
            self._last_event_key = key
            # readings alone changed: a paced reader need not hear it at once (events.EventHub)
            shape = shape_of(data)
            minor, self._last_shape = shape == self._last_shape, shape
            self._event_bytes, self._event_of = format_event("snapshot", data), snap
            self.events.publish_raw(self._event_bytes, minor=minor)
        if self.announcer is not None:
            self.announcer.on_sample(snap)
        for fn in list(self.on_sample):
            try:
                fn(snap)
            except Exception:
                log.exception("on_sample callback %r failed", fn)

    async def _sample_failed(self, exc: BaseException) -> None:
        """NVML failed as a whole: report the GPUs unhealthy, keep serving, try to reopen."""
        self.sample_errors += 1
        msg = str(exc) if isinstance(exc, GpusdError) else f"{exc.__class__.__name__}: {exc}"
        level = logging.WARNING if self.sample_errors == 1 else logging.DEBUG
        log.log(level, "sampling failed: %s", msg)
        if self.snapshot is not None:
            snap = HostSnapshot.from_dict(self.snapshot.to_dict())
            snap.timestamp = time.time()
            for g in snap.gpus:
                g.healthy, g.error = False, f"sampling failed: {msg}"[:300]
            # also to the TXT record (no GPU is free) and the on_sample callbacks: a "lost" rule fires
            self._publish_snapshot(snap)
        now = time.monotonic()
        if isinstance(exc, BackendUnavailable) and now - self._backend_failed_at > REOPEN_AFTER:
            self._backend_failed_at = now
            await self._reopen_backend()

    async def _reopen_backend(self) -> None:
        try:
            await asyncio.get_running_loop().run_in_executor(self._executor, self.inventory.reopen)
            log.info("inventory backend reopened")
        except Exception as exc:
            log.debug("cannot reopen the backend yet: %r", exc)


def trim_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc ``malloc_trim``): about 2 MiB of RSS
    that start-up (imports, the first sample, TLS) allocated and freed.  Nothing elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def connection_cap(configured: int) -> int:
    """``configured``, lowered where the process's open-file limit would run out first."""
    soft = open_file_limit()
    return configured if soft is None else min(configured, max(16, soft - FD_RESERVE))  # never above it


def _node_id(config: DaemonConfig) -> str:
    """The node id kept in the daemon's state directory (see :func:`gpusd.identity.node_id`)."""
    return local_node_id(Path(config.state_dir) if config.state_dir is not None else None)
