"""``AsyncClient``: every GPU on the LAN, live, as events.

How it works (docs/wire-format.md, docs/daemon.md):

1. A python-zeroconf ``AsyncServiceBrowser`` watches ``_gpusd._tcp.local.`` (and hwsd's
   ``_gpu-sd._tcp.local.``).  Each service found is resolved and its TXT record validated; records of
   other sessions, other versions, malformed or lying records are logged once and skipped.
2. For each gpusd host the client opens the daemon's event stream (``GET /api/v1/events``).  The first
   event is the full snapshot (``host_added`` + ``device_added`` per GPU); later snapshots are diffed
   (``device_updated`` only when a value changed, ``device_added``/``device_removed``).
3. Liveness: the daemon sends a heartbeat every 2 s.  A stream that closes, or stays silent for 6 s,
   gets one reconnection attempt; when that fails the host is reported removed, at most
   ``liveness_timeout`` (10 s) after its last sign of life.  A ``bye`` event or an mDNS goodbye removes
   it at once.  mDNS caches alone would keep a dead host for 1125-4500 s.
4. hwsd hosts are listed from their announcement alone (no live load; removed on mDNS goodbye/expiry).

Handlers run on the event loop: keep them short (or make them coroutine functions, which are
scheduled as tasks).  Nothing from the network raises out of the client: errors are logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Sequence

from ..model import GpuInfo, HostSnapshot
from ..units import parse_memory
from ..wire.mdns import open_zeroconf, rank_addresses, resolve_interfaces
from ..wire.signing import fingerprint_bytes
from ..wire.sse import SSEError, SSEParser
from ..wire.txt import (
    API_PREFIX,
    DEFAULT_SESSION,
    HWSD_TYPE,
    SERVICE_TYPE,
    TxtError,
    announced_host,
    decode_hwsd,
    decode_txt,
)
from .types import (
    DEVICE_ADDED,
    DEVICE_REMOVED,
    DEVICE_UPDATED,
    EVENTS,
    HOST_ADDED,
    HOST_REMOVED,
    JOB,
    THRESHOLD_CLEARED,
    THRESHOLD_EXCEEDED,
    Device,
    DiscoveryEvent,
    Filters,
    RemoteHost,
    SignedIdentity,
    event_names,
)

if TYPE_CHECKING:  # pragma: no cover
    import aiohttp
    from zeroconf.asyncio import AsyncServiceBrowser, AsyncZeroconf

    from ..wire.signing import FleetKey, Proof

log = logging.getLogger(__name__)

Handler = Callable[[DiscoveryEvent], Any]

HEARTBEAT = 2.0  # seconds between daemon heartbeats (the daemon's default)
RESOLVE_TIMEOUT = 3.0
RECONNECT_BUDGET = 2.0  # seconds a reconnection may take before the host counts as gone
RETRY_MIN, RETRY_MAX = 1.0, 15.0  # retrying an announced host that does not answer (doubling)
MAX_HOSTS = 1024  # services followed at most (a flood of fake announcements beyond is dropped)
# A service that said goodbye and is announced again within this long is followed only then: a
# stopping responder may still multicast an answer it had queued (python-zeroconf delays an answer
# by a second when it multicast the record less than a second before), and the stopping daemon may
# still accept a connection; a restarted daemon (probing alone takes ~0.75 s) is merely seen later.
REAPPEAR_HOLD = 2.0
STALL = 0.1  # wait_settled's give-up clocks: a longer stretch without the loop running counts as this long
BEYOND_GIVE_UP = 3.0  # ... and a host beyond the link (peers, wide-area DNS-SD: round trips of a WAN) gets 3x
FOLLOWED_ALREADY = "followed already"  # a stream's outcome: its node is reported, found another way
_GPU_FIELDS = [f.name for f in fields(GpuInfo)]


@dataclass(eq=False)
class _Peer:
    """One DNS-SD service instance the browser reported."""

    name: str
    type: str
    task: asyncio.Task[None] | None = None
    host: RemoteHost | None = None  # set once resolved and valid
    reported: bool = False  # host_added was emitted
    devices: dict[str, Device] = field(default_factory=dict)  # reported devices by UUID
    updated: asyncio.Event = field(default_factory=asyncio.Event)
    streaming: bool = False
    settled: bool = False  # resolved and either reported or given up on (for wait_settled)
    problems: set[str] = field(default_factory=set)  # logged once each
    via: str = "mdns"  # how it was found: "mdns", "peer" (static) or "dns-sd" (wide area; .beyond)
    spec: Any = None  # a static peer's PeerSpec, a wide-area instance's DnsSdInstance
    from_file: bool = False  # a static peer listed in the peers file (dropped when the file drops it)
    shadowed: bool = False  # its node is reported already, found another way (_shadowing)


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
    ) -> None:
        if isinstance(min_free_memory, str):  # "20GiB"; a bare "20" is refused (did you mean 20GiB?)
            min_free_memory = int(parse_memory(min_free_memory, ratio=False))
        self.filters = Filters(
            session=None if all_sessions else session,
            hostname=hostname,
            model=model,
            min_free_memory=min_free_memory,
        )
        self._interface_specs = list(interfaces) if interfaces is not None else None
        # The fleet secret never leaves this process: requests are signed with keys derived from it,
        # and only daemons that sign their answers back are trusted with private fields (verified).
        if key is None and token:
            from ..wire.signing import FleetKey, check_secret

            check_secret(token)
            key = FleetKey(token)
        self.key = key
        # Announced loopback/link-local addresses are followed only by a client itself bound to
        # loopback (tests, the demo); None: decided from the interfaces when listening starts.
        self.allow_loopback = allow_loopback
        self.liveness_timeout = float(liveness_timeout)
        self.silence_timeout = min(3 * HEARTBEAT, self.liveness_timeout * 0.6)
        self.include_hwsd = include_hwsd
        self._zc: AsyncZeroconf | None = zeroconf
        self._own_zc = zeroconf is None
        self._browser: AsyncServiceBrowser | None = None
        self._http: aiohttp.ClientSession | None = None
        self._handlers: dict[str, list[Handler]] = {e: [] for e in EVENTS}
        self._subscribers: list[asyncio.Queue[DiscoveryEvent | None]] = []
        self._peers: dict[str, _Peer] = {}
        # services of the wanted session(s) left out only by the host-name filter (for "none matched")
        self.unmatched_hosts: set[str] = set()
        self._listening = False
        self._started_at = 0.0
        self._last_peer_at = 0.0
        self._first_peer_at: float | None = None  # monotonic time the first service was found
        self._goodbyes: dict[str, float] = {}  # service name -> monotonic time of its goodbye
        self._question: Any = None  # the DNSQuestionType of our queries (set when listening starts)
        self._tasks: set[asyncio.Task[Any]] = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.max_hosts = max(1, int(max_hosts))
        self.dropped_hosts = 0  # announcements ignored because max_hosts services were followed
        self._init_beyond(peers, peers_file, dns_sd_domain, dns_server)

    def _init_beyond(self, peers: Sequence[str] | None, peers_file: str | None, dns_sd_domain: str | None,
                     dns_server: str | None) -> None:
        """Hosts beyond the mDNS link (validated here: bad values raise ConfigError in the caller)."""
        import os

        from . import beyond

        self.peer_specs = beyond.parse_peers(list(peers) if peers is not None else beyond.peers_from_env())
        self.peers_file = peers_file or os.environ.get("GPUSD_PEERS_FILE") or None
        domain = dns_sd_domain if dns_sd_domain is not None else os.environ.get("GPUSD_DNS_SD_DOMAIN", "")
        self.dns_sd_domain = beyond.valid_domain(domain) if domain else None
        self.dns_server = beyond.valid_dns_server(dns_server) if dns_server else None
        self._dns_sd_browsed = self.dns_sd_domain is None  # the first wide-area browse is done (wait_settled)

    # -- handlers -----------------------------------------------------------------------------
    def register_event_handler(self, event: str, fn: Handler) -> None:
        """Call ``fn(event)`` (a :class:`DiscoveryEvent`) for ``event``: ``host_added``,
        ``host_removed``, ``device_added``, ``device_removed``, ``device_updated``,
        ``threshold_exceeded``, ``threshold_cleared``, or ``*`` for all of them."""
        for name in event_names(event):
            self._handlers[name].append(fn)

    def unregister_event_handler(self, event: str, fn: Handler) -> None:
        for name in event_names(event):
            with contextlib.suppress(KeyError, ValueError):
                self._handlers[name].remove(fn)

    def _emit(self, event: DiscoveryEvent) -> None:
        for fn in list(self._handlers.get(event.event, ())):
            try:
                result = fn(event)
                if inspect.isawaitable(result):
                    self._spawn(self._await_handler(result))
            except Exception:  # a handler's bug must not stop discovery
                log.exception("event handler %r failed on %s", fn, event.event)
        for q in list(self._subscribers):
            try:
                q.put_nowait(event)
            except asyncio.QueueFull:  # a consumer that stopped reading: drop it
                self._subscribers.remove(q)
                log.warning("dropping a slow event subscriber")

    async def _await_handler(self, result: Awaitable[Any]) -> None:
        try:
            await result
        except Exception:
            log.exception("async event handler failed")

    async def events(self, maxsize: int = 10000) -> AsyncIterator[DiscoveryEvent]:
        """Every event from now on, as an async iterator (ends when the client stops)."""
        q: asyncio.Queue[DiscoveryEvent | None] = asyncio.Queue(maxsize)
        self._subscribers.append(q)
        try:
            while True:
                ev = await q.get()
                if ev is None:
                    return
                yield ev
        finally:
            with contextlib.suppress(ValueError):
                self._subscribers.remove(q)

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
        return [SERVICE_TYPE] + ([HWSD_TYPE] if self.include_hwsd else [])

    async def start_listening(self) -> None:
        """Start browsing and following hosts (returns at once; events arrive as hosts are found)."""
        if self._listening:
            return
        from zeroconf import DNSQuestionType
        from zeroconf.asyncio import AsyncServiceBrowser

        self.loop = asyncio.get_running_loop()
        if self.allow_loopback is None:
            ifaces = resolve_interfaces(self._interface_specs)
            self.allow_loopback = bool(ifaces) and all(_is_loopback(a) for a in ifaces or ())
        if self._zc is None:
            self._zc = await open_zeroconf(resolve_interfaces(self._interface_specs))
            self._own_zc = True
        self._listening = True
        self._started_at = self._last_peer_at = time.monotonic()
        self._first_peer_at = None
        types = self.service_types
        # QM questions (multicast answers) only: with QU the answers come by unicast to port 5353,
        # which the kernel hands to just one of the sockets bound there -- often another gpusd
        # process on this machine (its daemon) rather than us.  A one-shot zeroconf (.oneshot: its
        # own port, answered by unicast there) asks QU: responders drop a query identical to one
        # they got in the last second (another client's), unless it is QU.
        self._question = DNSQuestionType.QU if getattr(self._zc.zeroconf, "unicast", False) else DNSQuestionType.QM
        try:
            self._browser = AsyncServiceBrowser(self._zc.zeroconf, types, handlers=[self._on_service_change],
                                                question_type=self._question)
        except BaseException:
            await self.stop_listening()  # close the HTTP session and our zeroconf: nothing leaks
            raise
        # The browser's first query (after 20-120 ms) counts down while aiohttp is imported; nothing
        # runs on the loop before this returns, so no host is followed before the session exists.
        import aiohttp

        self._http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=True),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=RESOLVE_TIMEOUT),
            auto_decompress=False,
        )
        self._start_beyond()

    async def stop_listening(self) -> None:
        """Stop browsing, close every stream (no events are emitted for the shutdown)."""
        if not self._listening:
            return
        self._listening = False
        if self._browser is not None:
            with contextlib.suppress(Exception):
                await self._browser.async_cancel()
            self._browser = None
        pending = {p.task for p in self._peers.values() if p.task is not None} | set(self._tasks)
        for _ in range(50):  # 5 s at most
            if not pending:
                break
            for t in pending:  # again and again: asyncio.wait_for (Python < 3.12) can lose a cancellation
                t.cancel()
            _, pending = await asyncio.wait(pending, timeout=0.1)
        self._peers.clear()
        if self._http is not None:
            await self._http.close()
            self._http = None
        if self._zc is not None and self._own_zc:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._zc.async_close(), 5)
            self._zc = None
        for q in list(self._subscribers):
            with contextlib.suppress(asyncio.QueueFull):
                q.put_nowait(None)

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- views --------------------------------------------------------------------------------
    @property
    def hosts(self) -> list[RemoteHost]:
        """The hosts reported (``host_added`` and not yet removed), by host name."""
        out = [p.host for p in self._peers.values() if p.reported and p.host is not None]
        return sorted(out, key=lambda h: (h.hostname, h.node_id))

    def list_devices(self) -> list[Device]:
        """Every reported GPU, by host name then index."""
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
        clock, last = 0.0, time.monotonic()  # seconds this loop ran (stalls counted as STALL at most)
        found: dict[str, float] = {}  # service -> the clock when it was first seen here
        answered, progress = -1, 0.0  # services settled so far, and the clock when that number last grew
        while True:
            now = time.monotonic()
            clock += min(now - last, STALL)
            last = now
            first = self._first_peer_at
            browsed = self._dns_sd_browsed and (
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

    # -- browsing -----------------------------------------------------------------------------
    def _on_service_change(self, zeroconf: Any, service_type: str, name: str, state_change: Any) -> None:
        from zeroconf import ServiceStateChange

        if not self._listening:
            return
        log.debug("browser: %s %s", state_change.name, name)
        peer = self._peers.get(name)
        if state_change is ServiceStateChange.Removed:
            if peer is not None:
                self._drop_peer(peer, "goodbye")
                now = time.monotonic()
                self._goodbyes = {k: t for k, t in self._goodbyes.items() if now - t < REAPPEAR_HOLD}
                self._goodbyes[name] = now
            return
        if peer is None:
            if len(self._peers) >= self.max_hosts:
                self._drop_announcement(name)
                return
            peer = self._peers[name] = _Peer(name=name, type=service_type)
            self._last_peer_at = time.monotonic()
            if self._first_peer_at is None:
                self._first_peer_at = self._last_peer_at
            gone = self._goodbyes.pop(name, None)
            hold = gone + REAPPEAR_HOLD - self._last_peer_at if gone is not None else 0.0
            peer.task = asyncio.ensure_future(self._follow(peer, hold))
            return
        # Updated: a new TXT (free count, inventory), new address, or a restarted daemon.
        peer.updated.set()
        if peer.streaming and peer.host is not None:
            self._refresh_txt(peer)
        elif peer.task is None or peer.task.done():
            peer.task = asyncio.ensure_future(self._follow(peer))

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

    def _refresh_txt(self, peer: _Peer) -> None:
        """Re-read a followed host's TXT from the cache; restart following when it changed identity."""
        from zeroconf.asyncio import AsyncServiceInfo

        assert self._zc is not None and peer.host is not None
        info = AsyncServiceInfo(peer.type, peer.name)
        if not info.load_from_cache(self._zc.zeroconf):
            return
        try:
            txt = decode_txt(info.text or b"")
        except TxtError as exc:
            self._problem(peer, f"invalid TXT update: {exc}")
            return
        if txt.node_id == peer.host.node_id and self.filters.host_ok(txt) and txt.hostname == peer.host.txt.hostname:
            peer.host.txt = txt
            return
        # Another node, session or host name now: forget what was reported and start over (a new
        # name is checked against the daemon's signed one again).
        self._restart_peer(peer)

    def _restart_peer(self, peer: _Peer) -> None:
        if peer.task is not None:
            peer.task.cancel()
        self._report_removed(peer, "identity changed")
        peer.task = asyncio.ensure_future(self._follow(peer))

    def _drop_peer(self, peer: _Peer, reason: str) -> None:
        self._peers.pop(peer.name, None)
        if peer.task is not None:
            peer.task.cancel()
        self._report_removed(peer, reason)

    def _problem(self, peer: _Peer, message: str, level: int = logging.WARNING) -> None:
        """Log a problem with a peer once (repeats at debug level)."""
        level = logging.DEBUG if message in peer.problems else level
        peer.problems.add(message)
        log.log(level, "skipping %s: %s", peer.name, message)

    # -- beyond the link (static peers, wide-area DNS-SD: .beyond) ------------------------------
    def _start_beyond(self) -> None:
        for spec in self.peer_specs:
            self._add_static(spec)
        if self.peers_file is not None:
            self._spawn(self._watch_peers_file(self.peers_file))
        if self.dns_sd_domain is not None:
            self._spawn(self._browse_dns_sd(self.dns_sd_domain))

    def _add_static(self, spec: Any, from_file: bool = False) -> None:
        name = f"peer:{spec}"
        if name in self._peers:
            return
        peer = self._peers[name] = _Peer(name=name, type=SERVICE_TYPE, via="peer", spec=spec, from_file=from_file)
        self._last_peer_at = time.monotonic()
        peer.task = asyncio.ensure_future(self._follow(peer))

    async def _watch_peers_file(self, path: str) -> None:
        """Follow the peers in ``path``; re-read it when it changes (checked every few seconds).  A
        file that turns bad keeps the peers it had (the error is logged)."""
        from ..errors import ConfigError
        from . import beyond

        stamp: object = ()
        while self._listening:
            now = beyond.file_stamp(path)
            if now != stamp:
                stamp = now
                try:
                    specs = beyond.parse_peers(beyond.read_peers_file(path))
                except ConfigError as exc:
                    log.warning("peers file: %s (keeping the peers it listed before)", exc)
                else:
                    names = {f"peer:{spec}" for spec in specs}
                    for peer in [p for p in self._peers.values() if p.from_file and p.name not in names]:
                        self._drop_peer(peer, "no longer in the peers file")
                    for spec in specs:
                        self._add_static(spec, from_file=True)
            await asyncio.sleep(beyond.PEERS_FILE_CHECK)

    async def _browse_dns_sd(self, domain: str) -> None:
        """Browse ``_gpusd._tcp.<domain>`` in unicast DNS now and again (every DNS_SD_INTERVAL s, or
        sooner when a record's TTL is shorter, never more often than DNS_SD_MIN_INTERVAL s)."""
        from . import beyond

        logged: set[str] = set()
        while self._listening:
            try:
                browse = await beyond.browse_dns_sd(domain, self.dns_server)
            except Exception:  # never let a resolver's bug stop discovery
                log.exception("wide-area DNS-SD browse of %s failed", domain)
                browse = beyond.Browse([], beyond.DNS_SD_INTERVAL, [], set(), complete=False)
            for problem in browse.problems:
                log.log(logging.DEBUG if problem in logged else logging.WARNING, "DNS-SD: %s", problem)
                logged.add(problem)
            # a host leaves when the zone no longer lists it; a server that does not answer drops nothing
            names = {inst.name for inst in browse.found} | browse.unknown
            gone = [p for p in self._peers.values() if p.via == "dns-sd" and p.name not in names]
            for peer in gone if browse.complete else []:
                self._drop_peer(peer, "removed from DNS-SD")
            for inst in browse.found:
                known = self._peers.get(inst.name)
                if known is None:
                    if len(self._peers) >= self.max_hosts:
                        self._drop_announcement(inst.name)
                        continue
                    new = self._peers[inst.name] = _Peer(name=inst.name, type=SERVICE_TYPE, via="dns-sd", spec=inst)
                    self._last_peer_at = time.monotonic()
                    new.task = asyncio.ensure_future(self._follow(new))
                    continue
                peer = known
                old, peer.spec = peer.spec, inst
                if (old.txt.node_id, old.port, old.addresses) != (inst.txt.node_id, inst.port, inst.addresses):
                    self._restart_peer(peer)
                elif peer.host is not None:
                    peer.host.txt = inst.txt
            self._dns_sd_browsed = True
            await asyncio.sleep(browse.ttl)

    async def _resolve_beyond(self, peer: _Peer) -> RemoteHost | None:
        """A static peer's or a wide-area instance's host record (None: not now; retried)."""
        from . import beyond

        if peer.via == "dns-sd":
            inst = peer.spec
            txt, addresses, port = inst.txt, list(inst.addresses), inst.port
        else:
            import aiohttp

            assert self._http is not None
            spec = peer.spec
            try:
                addresses = await beyond.addresses_of(spec.host)
            except (OSError, asyncio.TimeoutError) as exc:
                self._problem(peer, f"cannot resolve {spec.host}: {exc}")
                return None
            txt, port = None, spec.port
            for address in addresses:
                try:
                    txt = await beyond.peer_txt(self._http, address, port)
                    addresses = [address]
                    break
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
                    self._problem(peer, f"no gpusd daemon at {address}:{port} ({str(exc)[:200] or type(exc).__name__})")
            if txt is None:
                return None
        if not self.filters.host_ok(txt):
            log.debug("ignoring %s: session %r / host %r filtered out", peer.name, txt.session, txt.hostname)
            return None
        host = RemoteHost(key=peer.name, txt=txt, addresses=addresses, port=port, via=peer.via)
        if peer.host is not None and peer.reported:
            _carry(peer.host, host)
        peer.host = host
        return host

    # -- following one host -------------------------------------------------------------------
    async def _follow(self, peer: _Peer, hold: float = 0.0) -> None:
        retry = RETRY_MIN
        try:
            if hold > 0:  # back right after its goodbye (REAPPEAR_HOLD)
                await asyncio.sleep(hold)
            while self._listening:
                peer.updated.clear()
                host = await self._resolve(peer)
                if host is None:
                    self._report_removed(peer, "announcement no longer valid")
                    peer.settled = True
                    await self._wait_update(peer, retry)
                    retry = min(retry * 2, RETRY_MAX)
                    continue
                if host.txt.source == "hwsd":
                    peer.settled = True
                    self._report_static(peer, host)
                    await peer.updated.wait()
                    continue
                connected = await self._stream(peer, host)
                peer.settled = True
                if connected:
                    retry = RETRY_MIN
                await self._wait_update(peer, retry)
                retry = min(retry * 2, RETRY_MAX)
        except asyncio.CancelledError:
            raise
        except Exception:  # never let one host's trouble escape
            log.exception("following %s failed", peer.name)
            peer.settled = True

    async def _wait_update(self, peer: _Peer, seconds: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(peer.updated.wait(), seconds)

    async def _resolve(self, peer: _Peer) -> RemoteHost | None:
        from zeroconf import IPVersion
        from zeroconf.asyncio import AsyncServiceInfo

        if peer.via != "mdns":
            return await self._resolve_beyond(peer)
        assert self._zc is not None
        info = AsyncServiceInfo(peer.type, peer.name)
        try:
            ok = await info.async_request(self._zc.zeroconf, int(RESOLVE_TIMEOUT * 1000),
                                          question_type=self._question)
        except Exception as exc:  # malformed names and the like
            self._problem(peer, f"cannot resolve: {exc}")
            return None
        if not ok:
            self._problem(peer, "no answer to the resolve query")
            return None
        raw = info.text or b""
        try:
            txt = decode_hwsd(raw) if peer.type == HWSD_TYPE else decode_txt(raw)
        except TxtError as exc:
            self._problem(peer, f"invalid TXT record: {exc}")
            return None
        if txt.source == "hwsd" and txt.gpusd_marker:
            return None  # a gpusd daemon's compatibility record: the host is listed via _gpusd._tcp
        if not self.filters.host_ok(txt):
            if self.filters.hostname and self.filters.session in (None, txt.session):
                self.unmatched_hosts.add(peer.name)
            log.debug("ignoring %s: session %r / host %r filtered out", peer.name, txt.session, txt.hostname)
            return None
        addresses = info.parsed_addresses(IPVersion.V4Only)
        if not addresses and txt.source == "gpusd":
            self._problem(peer, "no IPv4 address")
            return None
        port = int(info.port or 0)
        if txt.source == "gpusd" and not 0 < port < 65536:
            self._problem(peer, f"bad port {port}")
            return None
        if txt.source == "hwsd" and not txt.node_id:
            txt.node_id = peer.name.split(".")[0][:64]
        if txt.source == "hwsd" and not txt.hostname:
            txt.hostname = (info.server or peer.name).rstrip(".").removesuffix(".local")
        host = RemoteHost(key=peer.name, txt=txt, addresses=addresses, port=port)
        if peer.host is not None and peer.reported:
            _carry(peer.host, host)  # keep what was reported (snapshot, alive) while following again
        peer.host = host
        return host

    def _report_static(self, peer: _Peer, host: RemoteHost) -> None:
        """An hwsd host: its GPUs come from the announcement."""
        host.alive = True
        host.last_seen = time.monotonic()
        self._apply(peer, host, host.gpus())

    async def _stream(self, peer: _Peer, host: RemoteHost) -> bool:
        """Follow a gpusd host's event stream until it is gone; report its removal.  Returns whether
        a stream was ever established."""
        ever = False
        quick_losses = 0
        try:
            while self._listening:
                started = time.monotonic()
                if peer.reported:  # a reconnection: within what is left of the liveness bound
                    deadline = min(host.last_seen + self.liveness_timeout - 0.3, started + RECONNECT_BUDGET)
                else:
                    deadline = started + RESOLVE_TIMEOUT + 2.0
                outcome = await self._session(peer, host, deadline)
                if outcome == "bye":
                    self._report_removed(peer, "bye")
                    return True
                if outcome == "lost":
                    ever = True
                    quick_losses = quick_losses + 1 if time.monotonic() - started < 2.0 else 0
                    if quick_losses < 3:
                        continue  # one more connection within the liveness budget
                    reason = "stream keeps closing"
                else:
                    reason = outcome
                self._report_removed(peer, reason)
                return ever
        finally:
            peer.streaming = False
        return ever

    async def _session(self, peer: _Peer, host: RemoteHost, deadline: float) -> str:
        """One connection: ``bye``, ``lost`` (streamed, then lost), or a failure reason."""
        import aiohttp

        assert self._http is not None
        failure = "unreachable"
        # a static peer's address is the user's own choice (--peer 127.0.0.1 is fine); announced ones
        # (mDNS, wide-area DNS-SD) are followed only where they point at another machine
        addresses = [a for a in rank_addresses(host.addresses)
                     if self.allow_loopback or peer.via == "peer" or not _local_only(a)]
        if not addresses:
            self._problem(peer, f"announces only loopback/link-local addresses {host.addresses[:4]}: not followed")
            return "no usable address"
        # With the fleet secret, over TLS where the host announces it (its certificate pinned to the
        # announced fingerprint, which its signed proof must name too), else plain HTTP.
        tls = self.key is not None and host.txt.tls_port is not None and host.txt.cert_fp is not None
        pin = fingerprint_bytes(host.txt.cert_fp or "") if tls else None
        candidates = [(a, True) for a in addresses] if pin is not None else []
        candidates += [(a, False) for a in addresses]
        for address, secure in candidates:
            # The URL is ours: the announced address and port, and gpusd's fixed path (never a path
            # or a host name chosen by the announcer).
            if secure:
                url = f"https://{address}:{host.txt.tls_port}{API_PREFIX}"
            else:
                url = f"http://{address}:{host.port}{API_PREFIX}"
            ssl_arg: Any = aiohttp.Fingerprint(pin) if secure and pin is not None else True
            budget = deadline - time.monotonic()
            if budget <= 0:
                return "no answer within the liveness bound"
            headers = {"Accept": "text/event-stream"}
            nonce = None
            if self.key is not None:
                signed, nonce = self.key.sign_request("GET", url + "/events", node_id=host.node_id)
                headers.update(signed)
            try:
                resp = await asyncio.wait_for(self._http.get(url + "/events", headers=headers, ssl=ssl_arg),
                                              budget)
                if resp.status == 401 and nonce is not None:
                    # a daemon of another fleet (another secret): follow its public data, unverified
                    resp.release()
                    headers, nonce = {"Accept": "text/event-stream"}, None
                    host.verified = False
                    resp = await asyncio.wait_for(self._http.get(url + "/events", headers=headers, ssl=ssl_arg),
                                                  max(0.1, deadline - time.monotonic()))
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                failure = f"cannot connect to {url}: {exc.__class__.__name__}"
                log.debug("%s: %s", peer.name, failure)
                continue
            try:
                if resp.status != 200 or not resp.content_type.startswith("text/event-stream"):
                    self._problem(peer, f"{url}/events answered {resp.status} {resp.content_type}")
                    failure = "not a gpusd event stream"
                    continue
                host.identity = host.copy_of = None
                if self.key is None:
                    host.verified = None
                elif nonce is None:
                    host.verified = False  # refused our signature (another fleet)
                else:
                    host.verified = self._believe(peer, host, self._proved(
                        url + "/events", headers, resp, nonce, host, host.txt.cert_fp if secure else None))
                if host.verified is False and host.copy_of is None:
                    # INFO: the views mark such a host [unverified] and the pool commands say once how
                    # many they left out (a LAN of strangers would otherwise print a line per host)
                    self._problem(peer, "did not prove it holds the fleet secret: shown as unverified, "
                                        "without private fields", logging.INFO)
                # host.url stays the plain HTTP API base (public reads, Prometheus targets, the
                # dashboard's alert requests), also when the stream itself came over TLS
                outcome = await self._read_stream(peer, host, resp, f"http://{address}:{host.port}{API_PREFIX}",
                                                  deadline)
                if outcome in ("bye", "lost", FOLLOWED_ALREADY):
                    return outcome
                failure = outcome  # no valid stream at this address (another machine's?): try the next
            finally:
                resp.release()
        return failure

    async def _read_stream(self, peer: _Peer, host: RemoteHost, resp: Any, url: str, deadline: float) -> str:
        parser = SSEParser()
        got_snapshot = False
        while True:
            # before the first snapshot: the connection deadline; then: silence timeout
            timeout = (deadline - time.monotonic()) if not got_snapshot else self.silence_timeout
            if timeout <= 0:
                return "no snapshot within the liveness bound"
            try:
                chunk = await asyncio.wait_for(resp.content.readany(), timeout)
            except asyncio.TimeoutError:
                return "lost" if got_snapshot else "no snapshot in time"
            except Exception as exc:  # aiohttp.ClientPayloadError, ConnectionResetError, ...
                log.debug("%s: stream error %r", peer.name, exc)
                return "lost" if got_snapshot else "stream error"
            if not chunk:
                return "lost" if got_snapshot else "stream closed"
            try:
                events = list(parser.feed(chunk))
            except SSEError as exc:
                self._problem(peer, f"bad event stream: {exc}")
                return "lost" if got_snapshot else "bad event stream"
            for name, data in events:
                if name == "snapshot":
                    snap = self._parse_snapshot(peer, host, data)
                    if snap is None:
                        if not got_snapshot:
                            return "invalid snapshot"
                        continue
                    if not got_snapshot:
                        got_snapshot = True
                        host.url = url
                        peer.streaming = True
                        peer.problems.clear()
                    host.last_seen = time.monotonic()
                    host.alive = True
                    self._apply(peer, host, snap.gpus, snap)
                    if peer.shadowed:
                        peer.shadowed = False
                        return FOLLOWED_ALREADY
                elif not got_snapshot:
                    continue  # anything before the snapshot is ignored
                elif name == "heartbeat":
                    host.last_seen = time.monotonic()
                elif name == "bye":
                    return "bye"
                elif name == "threshold":
                    host.last_seen = time.monotonic()
                    self._threshold(peer, host, data)
                elif name == "job":
                    host.last_seen = time.monotonic()
                    self._job(peer, host, data)

    def _proved(self, url: str, sent: dict[str, str], resp: Any, nonce: str, host: RemoteHost,
                cert_fp: str | None = None) -> Proof | None:
        """The fleet's proof the answer carries for our request to ``host`` (its node id; over TLS,
        naming the pinned certificate ``cert_fp``), or None."""
        from ..wire.signing import Headers, Request, Response

        assert self.key is not None
        answer = Response(resp.status, Request("GET", url, Headers(sent)), Headers(resp.headers.items()))
        return self.key.response_proof(answer, nonce, node_id=host.node_id, cert_fp=cert_fp)

    def _believe(self, peer: _Peer, host: RemoteHost, proof: Proof | None) -> bool:
        """Whether ``host`` is verified: its daemon proved it holds the fleet secret *and* signed the
        host name its announcement gives (docs/security.md, "What a client believes, and from whom").
        Sets ``host.identity`` (the signed name and addresses) when it is; ``host.copy_of`` when the
        daemon proved it is another host (the announcement is a copy, under a name of its own)."""
        if proof is None:
            return False
        if proof.host is None:
            self._problem(peer, "proved it holds the fleet secret but signed no host name (a gpusd older than "
                                "0.3?): shown as unverified, never used for placement")
            return False
        if host.txt.hostname != announced_host(proof.host):
            host.copy_of = proof.host
            self._problem(peer, f"announces host {host.txt.hostname[:80]!r}, but the daemon it points at proved it "
                                f"is {proof.host[:80]!r}: an unverified copy of that host's announcement, "
                                "never used for placement")
            return False
        host.identity = SignedIdentity(proof.node_id, proof.host, proof.addresses)
        return True

    def _parse_snapshot(self, peer: _Peer, host: RemoteHost, data: str) -> HostSnapshot | None:
        try:
            snap = HostSnapshot.from_json(data)
        except (ValueError, TypeError, RecursionError) as exc:
            self._problem(peer, f"invalid snapshot: {str(exc)[:200]}")
            return None
        if host.verified is False:  # private fields are trusted only from daemons that proved themselves
            _drop_private(snap)
        if snap.node_id != host.node_id:
            self._problem(peer, f"snapshot names node {snap.node_id[:40]!r}, TXT says {host.node_id!r}")
            return None
        return snap

    def _threshold(self, peer: _Peer, host: RemoteHost, data: str) -> None:
        import json

        try:
            d = json.loads(data)
        except ValueError:
            return
        if not isinstance(d, dict) or d.get("state") not in ("exceeded", "cleared"):
            return
        device: Device | None = None
        gpu = d.get("gpu")
        for dev in peer.devices.values():
            if gpu is not None and (dev.uuid == gpu or dev.index == gpu):
                device = dev
        kind = THRESHOLD_EXCEEDED if d["state"] == "exceeded" else THRESHOLD_CLEARED
        self._emit(DiscoveryEvent(kind, host, device=device, data=d))

    def _job(self, peer: _Peer, host: RemoteHost, data: str) -> None:
        """A rebalancing decision (docs/jobs.md): only its known fields, typed and bounded."""
        import json

        try:
            d = json.loads(data[:8192])
        except ValueError:
            return
        if not isinstance(d, dict) or d.get("action") not in ("move", "pause", "resume"):
            return
        out: dict[str, Any] = {"action": d["action"], "ok": d.get("ok") is True}
        for key, limit in (("job", 32), ("gpu", 128), ("reason", 300), ("result", 300)):
            v = d.get(key)
            out[key] = v[:limit] if isinstance(v, str) else None
        for key in ("index", "to"):
            v = d.get(key)
            out[key] = v if type(v) is int and -1 <= v < 4096 else None
        device = next((dev for dev in peer.devices.values() if dev.uuid == out["gpu"]), None)
        self._emit(DiscoveryEvent(JOB, host, device=device, data=out))

    # -- reporting ----------------------------------------------------------------------------
    def _apply(self, peer: _Peer, host: RemoteHost, gpus: list[GpuInfo], snap: HostSnapshot | None = None) -> None:
        """Report what changed between the devices reported so far and ``gpus``."""
        if not peer.reported and snap is not None:
            other = self._shadowing(peer, host)
            if other is not None:  # one host found two ways (mDNS and --peer, say) is reported once
                log.debug("%s: %s is followed already (found via %s)", peer.name, host.hostname, other.via)
                peer.shadowed = peer.settled = True
                return
        if snap is not None:
            host.snapshot = snap
        peer.settled = True
        if not peer.reported:
            peer.reported = True
            self._emit(DiscoveryEvent(HOST_ADDED, host))
        wanted: dict[str, GpuInfo] = {}
        for g in gpus:
            if self.filters.device_ok(g) and g.uuid not in wanted:
                wanted[g.uuid] = g
        for uuid in [u for u in peer.devices if u not in wanted]:
            gone = peer.devices.pop(uuid)
            self._emit(DiscoveryEvent(DEVICE_REMOVED, host, device=gone))
        simulated = bool(snap.simulated) if snap is not None else host.txt.simulated
        for uuid, g in wanted.items():
            dev = Device(hostname=host.hostname, node_id=host.node_id, session=host.session, gpu=g, url=host.url,
                         source=host.source, live=host.live, simulated=simulated, host_key=host.key,
                         verified=host.verified, via=host.via, copy_of=host.copy_of)
            old = peer.devices.get(uuid)
            peer.devices[uuid] = dev
            if old is None:
                self._emit(DiscoveryEvent(DEVICE_ADDED, host, device=dev))
                continue
            changed = _changed(old.gpu, g)
            if changed:
                self._emit(DiscoveryEvent(DEVICE_UPDATED, host, device=dev, previous=old, changed=changed))

    def _shadowing(self, peer: _Peer, host: RemoteHost) -> _Peer | None:
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

    def _report_removed(self, peer: _Peer, reason: str) -> None:
        host = peer.host
        if host is not None:
            host.alive = False
        if not peer.reported or host is None:
            return
        log.info("host %s (%s) removed: %s", host.hostname, host.node_id, reason)
        peer.reported = False
        for dev in list(peer.devices.values()):
            self._emit(DiscoveryEvent(DEVICE_REMOVED, host, device=dev))
        peer.devices.clear()
        self._emit(DiscoveryEvent(HOST_REMOVED, host, data={"reason": reason}))


def _is_loopback(address: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _local_only(address: str) -> bool:
    """An address that points back at this machine or means nothing on the LAN: never followed when
    announced by someone else (finding 2 of issue 9: a record pointing at 127.0.0.1:4780)."""
    import ipaddress

    try:
        a = ipaddress.ip_address(address)
    except ValueError:
        return True
    return a.is_loopback or a.is_link_local or a.is_unspecified or a.is_multicast or a.is_reserved


def _carry(old: RemoteHost, new: RemoteHost) -> None:
    """What a followed host keeps while it is resolved again: what was reported (snapshot, alive,
    URL) and what its daemon proved (checked again on the next connection)."""
    new.snapshot, new.alive, new.url = old.snapshot, old.alive, old.url
    new.verified, new.identity, new.copy_of = old.verified, old.identity, old.copy_of


def _drop_private(snap: HostSnapshot) -> None:
    for g in snap.gpus:
        for p in g.processes or ():
            p.user = p.command = None
        for lease in g.leases or ():
            lease.user = lease.command = None


def _changed(old: GpuInfo, new: GpuInfo) -> tuple[str, ...]:
    if old == new:
        return ()
    return tuple(f for f in _GPU_FIELDS if getattr(old, f) != getattr(new, f))
