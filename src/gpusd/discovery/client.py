"""``AsyncClient``: every GPU on the LAN, live, as events.

How it works (docs/wire-format.md, docs/daemon.md):

1. Host sources (:mod:`.source`) find service instances: mDNS browsing of ``_gpusd._tcp.local.`` and
   hwsd's ``_gpu-sd._tcp.local.`` (:mod:`.mdns`), static peers (:mod:`.peers`), wide-area DNS-SD
   (:mod:`.widearea`), and any source given as ``sources=``.  Each resolves an instance into a host
   record whose TXT record is validated; records of other sessions, other versions, malformed or
   lying records are logged once and skipped.
2. For each gpusd host a :class:`~.follower.Follower` opens the daemon's event stream (``GET
   /api/v1/events``) and checks what the daemon proves.  The first event is the full snapshot
   (``host_added`` + ``device_added`` per GPU); later snapshots are diffed here (``device_updated``
   only when a value changed, ``device_added``/``device_removed``).
3. Liveness: the daemon sends a heartbeat every 2 s.  A stream that closes, or stays silent for 6 s,
   gets one reconnection attempt; when that fails the host is reported removed, at most
   ``liveness_timeout`` (10 s) after its last sign of life.  A ``bye`` event or an mDNS goodbye removes
   it at once.  mDNS caches alone would keep a dead host for 1125-4500 s.
4. hwsd hosts are listed from their announcement alone (no live load; removed on mDNS goodbye/expiry).

What the client is asked (filters, the fleet key, hosts beyond the link) is one
:class:`~.options.DiscoveryOptions` value; the events go through an :class:`~.bus.EventBus`.
Handlers run on the event loop: keep them short (or make them coroutine functions, which are
scheduled as tasks).  Nothing from the network raises out of the client: errors are logged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import fields
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Iterable, Sequence

from ..model import GpuInfo, HostSnapshot
from ..wire.aio import load
from ..wire.txt import DEFAULT_SESSION, SERVICE_TYPE
from .bus import EventBus, Handler
from .follower import HEARTBEAT, RECONNECT_BUDGET, RESOLVE_TIMEOUT, Follower
from .mdns import MdnsSource
from .options import MAX_HOSTS, DiscoveryOptions, options_of
from .peers import StaticPeers
from .types import (
    DEVICE_ADDED,
    DEVICE_REMOVED,
    DEVICE_UPDATED,
    HOST_ADDED,
    HOST_REMOVED,
    Device,
    DiscoveryEvent,
    RemoteHost,
)
from .widearea import WideAreaDnsSd

if TYPE_CHECKING:  # pragma: no cover
    import aiohttp
    from zeroconf.asyncio import AsyncZeroconf

    from ..wire.signing import FleetKey
    from .mdns import MdnsSource
    from .source import HostSource

log = logging.getLogger(__name__)

# While deferring (AsyncClient.defer_snapshots), a host's snapshot is parsed on arrival at most this often;
# a reader that does not catch up sees it at most this much older than the newest received.  5 s: what a
# daemon's utilisation figure averages over anyway (its sample window).
REPARSE = 5.0
# wait_settled's give-up clocks: a longer stretch without the loop running counts as this long
STALL = 0.1
# ... and a host beyond the link (peers, wide-area DNS-SD: round trips of a WAN) gets 3x
BEYOND_GIVE_UP = 3.0
_GPU_FIELDS = [f.name for f in fields(GpuInfo)]


class AsyncClient:
    """Discover gpusd hosts and their GPUs on the LAN (asyncio).

    >>> async with AsyncClient() as client:          # doctest: +SKIP
    ...     client.register_event_handler("device_added", print)
    ...     await client.wait_settled()
    ...     for dev in client.list_devices(): print(dev)

    ``session``: only hosts of this session (``None`` or ``all_sessions=True``: all).
    ``hostname``, ``model`` (substring or glob), ``min_free_memory`` (bytes or ``"20GiB"``) filter
    what is reported.  ``interfaces``: IPv4 addresses or interface names for mDNS (default all, or
    ``$GPUSD_INTERFACES``).  ``liveness_timeout``: a host silent this long is reported removed.
    ``max_hosts``: services followed at most; announcements beyond are dropped (counted in
    ``dropped_hosts``, logged once) until a followed one goes away.
    ``token`` (the fleet secret, kept in this process) or ``key`` (a
    :class:`~gpusd.wire.signing.FleetKey`): requests are signed, TLS is used where announced, and each
    host is ``verified`` when it proves it holds the secret; private fields are kept from verified
    hosts only (docs/security.md).  ``allow_loopback``: follow hosts announcing loopback or link-local
    addresses (default: only when the client itself is bound to loopback).

    Beyond the mDNS link (:mod:`gpusd.discovery.beyond`, docs/daemon.md): ``peers`` (``host[:port]``
    strings; default ``$GPUSD_PEERS``), ``peers_file`` (one per line, re-read when it changes),
    ``dns_sd_domain`` (browse ``_gpusd._tcp.<domain>`` in unicast DNS; default
    ``$GPUSD_DNS_SD_DOMAIN``) and ``dns_server`` (an IP address; default: the system resolver).
    Such hosts are followed and verified exactly like announced ones; ``RemoteHost.via`` says how
    each host was found.

    ``options``: all of the above as one :class:`~gpusd.discovery.options.DiscoveryOptions` (instead
    of the keyword arguments).  ``zeroconf``: an ``AsyncZeroconf`` to browse with (not closed here).
    ``sources``: more :class:`~gpusd.discovery.source.HostSource` s, followed like the built-in ones.
    """

    def __init__(
        self,
        session: str | None = DEFAULT_SESSION,
        *,
        interfaces: Sequence[str] | None = None,
        hostname: str | None = None,
        model: str | None = None,
        min_free_memory: int | str | None = None,
        all_sessions: bool = False,
        liveness_timeout: float = 10.0,
        include_hwsd: bool = True,
        zeroconf: "AsyncZeroconf | None" = None,
        token: str | None = None,
        max_hosts: int = MAX_HOSTS,
        key: "FleetKey | None" = None,
        allow_loopback: bool | None = None,
        peers: Sequence[str] | None = None,
        peers_file: str | None = None,
        dns_sd_domain: str | None = None,
        dns_server: str | None = None,
        options: DiscoveryOptions | None = None,
        sources: Sequence[HostSource] = (),
        pace: float | None = None,
    ) -> None:
        # the keyword arguments above are the options' fields (tests/discovery/test_sources.py checks it)
        self.options = opts = options_of(options, locals())
        self.filters = opts.filters()
        self.key = opts.key
        # Announced loopback/link-local addresses are followed only by a client itself bound to
        # loopback (tests, the demo); None: decided from the interfaces when listening starts.
        self.allow_loopback = opts.allow_loopback
        self.liveness_timeout = opts.liveness_timeout
        self.silence_timeout = min(3 * HEARTBEAT, self.liveness_timeout * 0.6)
        # the pace asked of every host's event stream (None: every change)
        self.pace = opts.pace
        if opts.pace is not None:
            # a paced stream may be silent for its pace and a heartbeat period (daemon.events)
            self.silence_timeout = opts.pace + 3 * HEARTBEAT
            self.liveness_timeout = max(self.liveness_timeout, self.silence_timeout + 2 * RECONNECT_BUDGET)
        self.max_hosts = opts.max_hosts
        self.bus = EventBus()
        self.http: aiohttp.ClientSession | None = None
        self.mdns = _mdns_source(opts, zeroconf)
        self.sources: list[HostSource] = [self.mdns, *_beyond_sources(opts), *sources]
        self._peers: dict[str, Follower] = {}
        # services of the wanted session(s) left out only by the host-name filter (for "none matched")
        self.unmatched_hosts: set[str] = set()
        self._listening = False
        self._started_at = 0.0
        self._last_peer_at = 0.0
        # monotonic time the first service was found
        self._first_peer_at: float | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        # announcements ignored because max_hosts services were followed
        self.dropped_hosts = 0
        # While this returns True, a host's later snapshots are parsed at most every REPARSE s on
        # arrival; the newest of the others is kept as received and parsed when the client's hosts or
        # devices are read (catch_up), its device events emitted then: for a reader that does not need
        # every event as it happens (a daemon's fleet view nobody streams).  None (the default): every
        # snapshot is parsed on arrival.  The first snapshot of a host is always parsed at once (it
        # proves the node, and reports the host).
        self.defer_snapshots: Callable[[], bool] | None = None
        self._deferred: set[Follower] = set()
        # Called with a reported host each time it has a new snapshot, checked (a daemon's fleet view
        # encodes it then, so that its answers are assembled from bytes kept per host).
        self.on_snapshot: Callable[[RemoteHost], None] | None = None

    # what tests and callers read of the options, as before
    @property
    def peer_specs(self) -> list[Any]:
        return list(self.options.peer_specs)

    @property
    def peers_file(self) -> str | None:
        return self.options.peers_file

    @property
    def dns_sd_domain(self) -> str | None:
        return self.options.dns_sd_domain

    @property
    def dns_server(self) -> str | None:
        return self.options.dns_server

    @property
    def include_hwsd(self) -> bool:
        return self.options.include_hwsd

    # -- handlers -----------------------------------------------------------------------------
    def register_event_handler(self, event: str, fn: Handler) -> None:
        """Call ``fn(event)`` (a :class:`DiscoveryEvent`) for ``event``: ``host_added``,
        ``host_removed``, ``device_added``, ``device_removed``, ``device_updated``,
        ``threshold_exceeded``, ``threshold_cleared``, ``job``, or ``*`` for all of them."""
        self.bus.register(event, fn)

    def unregister_event_handler(self, event: str, fn: Handler) -> None:
        self.bus.unregister(event, fn)

    def emit(self, event: DiscoveryEvent) -> None:
        self.bus.emit(event)

    def events(self, maxsize: int = 10000) -> AsyncIterator[DiscoveryEvent]:
        """Every event from now on, as an async iterator (ends when the client stops)."""
        return self.bus.events(maxsize)

    # -- life cycle ---------------------------------------------------------------------------
    async def __aenter__(self) -> AsyncClient:
        await self.start_listening()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop_listening()

    @property
    def listening(self) -> bool:
        return self._listening

    @property
    def service_types(self) -> list[str]:
        """The mDNS service types this client browses."""
        return self.mdns.service_types

    async def start_listening(self) -> None:
        """Start browsing and following hosts (returns at once; events arrive as hosts are found)."""
        if self._listening:
            return
        self.loop = asyncio.get_running_loop()
        if self.allow_loopback is None:
            self.allow_loopback = self.mdns.bound_to_loopback()
        for source in self.sources:
            await source.open(self)
        self._listening = True
        self._started_at = self._last_peer_at = time.monotonic()
        self._first_peer_at = None
        try:
            self.mdns.start(self)
        except BaseException:
            # close the HTTP session and our zeroconf: nothing leaks
            await self.stop_listening()
            raise
        # The browser's first query (after 20-120 ms) counts down while aiohttp is imported; nothing
        # runs on the loop before this returns, so no host is followed before the session exists.

        # without the CA store in a gpusd process (gpusd.wire.aio)
        aiohttp = load()

        self.http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=True),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=RESOLVE_TIMEOUT),
            auto_decompress=False,
        )
        for source in self.sources:
            if source is not self.mdns:
                source.start(self)

    async def stop_listening(self) -> None:
        """Stop browsing, close every stream (no events are emitted for the shutdown)."""
        if not self._listening:
            return
        # sources hear nothing from now on
        self._listening = False
        pending = {p.task for p in self._peers.values() if p.task is not None} | set(self._tasks)
        pending |= set(self.bus.pending())
        for _ in range(50):  # 5 s at most
            if not pending:
                break
            # again and again: asyncio.wait_for (Python < 3.12) can lose a cancellation
            for t in pending:
                t.cancel()
            _, pending = await asyncio.wait(pending, timeout=0.1)
        self._peers.clear()
        if self.http is not None:
            await self.http.close()
            self.http = None
        for source in self.sources:
            # the browser, and the zeroconf the client opened
            await source.stop()
        self.bus.close()

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        """A task of the client's (a source's loop): cancelled when it stops."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- the table of followed instances (what sources add and drop) ----------------------------
    def follower(self, name: str) -> Follower | None:
        return self._peers.get(name)

    def followers(self) -> list[Follower]:
        return list(self._peers.values())

    def add(self, name: str, source: HostSource, *, service_type: str = SERVICE_TYPE, spec: Any = None,
            from_file: bool = False, hold: float = 0.0, answer: bool = False, capped: bool = True) -> Follower | None:
        """Follow the instance ``name`` that ``source`` found (None: ``max_hosts`` are followed already,
        with ``capped``).  ``answer``: it answered the browse (``answered``); ``hold``: follow it only after
        this many seconds."""
        if capped and len(self._peers) >= self.max_hosts:
            self._drop_announcement(name)
            return None
        peer = self._peers[name] = Follower(self, source, name, type=service_type, spec=spec, from_file=from_file)
        self._last_peer_at = time.monotonic()
        if answer and self._first_peer_at is None:
            self._first_peer_at = self._last_peer_at
        peer.start(hold)
        return peer

    def drop(self, peer: Follower, reason: str) -> None:
        """Stop following ``peer`` (gone from its source) and report it removed."""
        self._peers.pop(peer.name, None)
        if peer.task is not None:
            peer.task.cancel()
        self.report_removed(peer, reason)

    def _drop_announcement(self, name: str) -> None:
        """A service beyond ``max_hosts``: not followed (a flood of fake announcements must not cost a
        task, a resolve and a connection each).  Counted; logged once per client."""
        self.dropped_hosts += 1
        if self.dropped_hosts == 1:
            log.warning("more than %d services announced: ignoring the rest (first: %s); a host among them "
                        "is picked up when it announces again after one of the followed hosts has gone",
                        self.max_hosts, name[:100])
        else:
            log.debug("ignoring service %s: %d followed already", name[:100], self.max_hosts)

    @property
    def followed(self) -> int:
        """Service instances followed now (reported or not)."""
        return len(self._peers)

    # -- deferred snapshots (defer_snapshots) ---------------------------------------------------
    def deferring(self) -> bool:
        return self.defer_snapshots is not None and self.defer_snapshots()

    def defer(self, peer: Follower, text: str) -> None:
        """A later snapshot of ``peer`` while deferring: parsed and reported now when the last one parsed
        is ``REPARSE`` s old, else kept as received (the one kept before it, if any, is dropped: only
        the newest is ever shown)."""
        if time.monotonic() - peer.parsed_at >= REPARSE:
            self.undefer(peer)
            self._parse_and_report(peer, text)
            return
        peer.pending = text
        self._deferred.add(peer)

    def _parse_and_report(self, peer: Follower, text: str) -> None:
        host = peer.host
        if host is None or not peer.reported or self._peers.get(peer.name) is not peer:
            return
        snap = peer.parse_snapshot(host, text)
        if snap is not None:
            self.report(peer, host, snap.gpus, snap)

    def undefer(self, peer: Follower) -> None:
        """Forget ``peer``'s unparsed snapshot (a newer one is parsed, or the host is gone)."""
        if peer.pending is not None:
            peer.pending = None
            self._deferred.discard(peer)

    def catch_up(self, older_than: float = 0.0) -> None:
        """Parse and report the snapshots kept unparsed (each host's newest), as on arrival: checked
        the same way, the same events.  Reading ``hosts`` or ``list_devices()`` does it first.
        ``older_than``: only those of hosts whose last parse is at least this many seconds old."""
        if not self._deferred:
            return
        due = time.monotonic() - older_than
        for peer in [p for p in self._deferred if p.parsed_at <= due]:
            text = peer.pending
            self.undefer(peer)
            if text is not None:
                self._parse_and_report(peer, text)

    # -- views --------------------------------------------------------------------------------
    @property
    def hosts(self) -> list[RemoteHost]:
        """The hosts reported (``host_added`` and not yet removed), by host name."""
        return self.host_list()

    def host_list(self, catch_up: bool | None = True) -> list[RemoteHost]:
        """:attr:`hosts`; with ``catch_up`` False, each as last parsed, at most ``REPARSE`` s older than
        the newest received (a snapshot kept unparsed longer, its host sending no newer one, is parsed
        now); None: each as last parsed, nothing parsed now (the caller calls ``catch_up(REPARSE)`` on a
        timer of its own)."""
        if catch_up is not None:
            self.catch_up(0.0 if catch_up else REPARSE)
        out = [p.host for p in self._peers.values() if p.reported and p.host is not None]
        return sorted(out, key=lambda h: (h.hostname, h.node_id))

    def list_devices(self) -> list[Device]:
        """Every reported GPU, by host name then index."""
        self.catch_up()
        out: list[Device] = []
        for p in self._peers.values():
            if p.reported:
                out.extend(p.devices.values())
        return sorted(out, key=lambda d: (d.hostname, d.node_id, d.index))

    def announced(self) -> list[RemoteHost]:
        """Every announcement seen that passes the host filters, reachable or not."""
        out = [p.host for p in self._peers.values() if p.host is not None and self.filters.host_ok(p.host.txt)
               and not (p.host.txt.source == "hwsd" and p.host.txt.gpusd_marker)]
        return sorted(out, key=lambda h: (h.hostname, h.node_id))

    async def scan(self, timeout: float = 2.0) -> list[RemoteHost]:
        """Browse for ``timeout`` seconds (starting to listen if needed) and return the announcements."""
        await self.start_listening()
        remaining = self._started_at + timeout - time.monotonic()
        if remaining > 0:
            await asyncio.sleep(remaining)
        return self.announced()

    @property
    def answered(self) -> bool:
        """Whether any service (of any session or type) has answered the browse."""
        return self._first_peer_at is not None

    async def wait_settled(self, timeout: float = 3.0, quiet: float = 0.3, minimum: float = 1.5,
                           early: tuple[float, float] | None = None, give_up: float | None = None) -> bool:
        """Wait until discovery has settled: at least ``minimum`` s of browsing, no new service for
        ``quiet`` s, and every service resolved and connected (or given up on).  False on timeout.

        ``minimum`` covers mDNS answer delays: 20-120 ms normally, but a responder that multicast its
        answer less than a second ago (to another client) waits a second before repeating it.

        ``early=(q, s)``: once a service has answered, the answers have settled when no new one came
        for ``q`` s and the first came ``s`` s ago, before ``minimum``.  Only for answers that all come
        at once (legacy unicast one-shot queries, :mod:`.oneshot`).  Hosts that answer later are still
        followed and reported while the client listens.

        ``give_up=g``: once the browse has settled, a service that has not answered ``g`` s after it was
        found (resolved, connected, its first snapshot read; ``BEYOND_GIVE_UP`` times that for a host
        beyond the link, a WAN's round trips away) is given up on, each on its own clock (a
        one-shot list: a tar pit, a service that accepts the connection and never answers, or whose
        responder takes seconds to resolve it, must not hold the list until ``timeout``, nor delay the
        hosts that answered; True is returned when every service answered or was given up on), and
        while hosts keep answering (a one-shot list of a thousand hosts takes this process a while to
        read) none is given up on.  A real host on a LAN answers in milliseconds.  The clocks count
        only time this process could work: a stretch in which this loop did not run (a process busy
        with a flood of services, or a machine too loaded to run it) counts as at most ``STALL`` s."""
        await self.start_listening()
        deadline = time.monotonic() + timeout
        # seconds this loop ran (stalls counted as STALL at most)
        clock, last = 0.0, time.monotonic()
        # service -> the clock when it was first seen here
        found: dict[str, float] = {}
        # services settled so far, and the clock when that number last grew
        answered, progress = -1, 0.0
        while True:
            now = time.monotonic()
            clock += min(now - last, STALL)
            last = now
            first = self._first_peer_at
            browsed = all(s.browsed for s in self.sources) and (
                (now - self._started_at >= minimum and now - self._last_peer_at >= quiet)
                or (early is not None and first is not None and now - first >= early[1]
                    and now - self._last_peer_at >= early[0]))
            waiting = [p for p in self._peers.values() if not p.settled]
            if browsed and not waiting:
                return True
            for p in waiting:
                found.setdefault(p.name, clock)
            if len(self._peers) - len(waiting) != answered:
                answered, progress = len(self._peers) - len(waiting), clock
            if browsed and give_up is not None and clock - progress >= give_up and all(
                    clock - found[p.name] >= (give_up if p.via == "mdns" else give_up * BEYOND_GIVE_UP)
                    for p in waiting):
                log.debug("%d of %d services have not answered within %.1f s of being found: given up on",
                          len(waiting), len(self._peers), give_up)
                return True
            if now >= deadline:
                return False
            await asyncio.sleep(0.02)

    # -- reporting (what the followers learnt) --------------------------------------------------
    def report(self, peer: Follower, host: RemoteHost, gpus: list[GpuInfo], snap: HostSnapshot | None = None) -> None:
        """Report what changed between the devices reported so far and ``gpus``."""
        if not peer.reported and snap is not None:
            other = self.shadowing(peer, host)
            # one host found two ways (mDNS and --peer, say) is reported once
            if other is not None:
                log.debug("%s: %s is followed already (found via %s)", peer.name, host.hostname, other.via)
                peer.shadowed = peer.settled = True
                return
        if snap is not None:
            host.snapshot = snap
            if self.on_snapshot is not None:
                try:
                    self.on_snapshot(host)
                except Exception:
                    # a reader's trouble must not stop following the host
                    log.exception("on_snapshot failed")
        peer.settled = True
        if not peer.reported:
            peer.reported = True
            self.emit(DiscoveryEvent(HOST_ADDED, host))
        wanted: dict[str, GpuInfo] = {}
        for g in gpus:
            if self.filters.device_ok(g) and g.uuid not in wanted:
                wanted[g.uuid] = g
        for uuid in [u for u in peer.devices if u not in wanted]:
            gone = peer.devices.pop(uuid)
            self.emit(DiscoveryEvent(DEVICE_REMOVED, host, device=gone))
        simulated = bool(snap.simulated) if snap is not None else host.txt.simulated
        for uuid, g in wanted.items():
            dev = Device(hostname=host.hostname, node_id=host.node_id, session=host.txt.session, gpu=g, url=host.url,
                         source=host.source, live=host.live, simulated=simulated, host_key=host.key,
                         verified=host.verified, via=host.via, copy_of=host.copy_of)
            old = peer.devices.get(uuid)
            peer.devices[uuid] = dev
            if old is None:
                self.emit(DiscoveryEvent(DEVICE_ADDED, host, device=dev))
                continue
            changed = _changed(old.gpu, g)
            if changed:
                self.emit(DiscoveryEvent(DEVICE_UPDATED, host, device=dev, previous=old, changed=changed))

    def shadowing(self, peer: Follower, host: RemoteHost) -> Follower | None:
        """The reported host of the same node found another way (a static peer, wide-area DNS-SD), or
        under another mDNS service name with the same signed identity, if any: the first found is
        followed, the other waits (retried with back-off) -- unless this one is verified and that one
        is not (a stranger claiming a node id never hides the real host).  Two mDNS services of one
        node that are not both verified are both reported (the unverified one marked): which of them
        is the real one only a proof can tell."""
        for other in self._peers.values():
            if other is peer or not other.reported or other.host is None or other.host.node_id != host.node_id:
                continue
            both_proved = host.verified is True and other.host.verified is True
            if (peer.via == other.via == "mdns" and not both_proved) or (
                    host.verified is True and other.host.verified is False):
                continue
            return other
        return None

    def report_removed(self, peer: Follower, reason: str) -> None:
        self.undefer(peer)
        host = peer.host
        if host is not None:
            host.alive = False
        if not peer.reported or host is None:
            return
        log.info("host %s (%s) removed: %s", host.hostname, host.node_id, reason)
        peer.reported = False
        for dev in list(peer.devices.values()):
            self.emit(DiscoveryEvent(DEVICE_REMOVED, host, device=dev))
        peer.devices.clear()
        self.emit(DiscoveryEvent(HOST_REMOVED, host, data={"reason": reason}))


def _mdns_source(opts: DiscoveryOptions, zeroconf: AsyncZeroconf | None) -> MdnsSource:
    return MdnsSource(opts.interfaces, opts.include_hwsd, zeroconf)


def _beyond_sources(opts: DiscoveryOptions) -> Iterable[HostSource]:
    """Hosts beyond the mDNS link: static peers, wide-area DNS-SD (where asked for)."""
    if opts.peer_specs or opts.peers_file is not None:
        yield StaticPeers(opts.peer_specs, opts.peers_file)
    if opts.dns_sd_domain is not None:
        yield WideAreaDnsSd(opts.dns_sd_domain, opts.dns_server)


def _changed(old: GpuInfo, new: GpuInfo) -> tuple[str, ...]:
    if old == new:
        return ()
    return tuple(f for f in _GPU_FIELDS if getattr(old, f) != getattr(new, f))
