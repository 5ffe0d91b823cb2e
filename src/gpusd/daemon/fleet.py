"""The fleet view of a daemon: every host of its session, as its own discovery client sees them.

Serves ``/api/v1/fleet`` and ``/api/v1/fleet/events`` (the dashboard's feed).  In ``auto`` mode the
client starts on first use and stops after ``fleet_idle`` seconds without a request or a listener,
so a fleet of daemons does not keep N x N event streams open when nobody is looking.
"""

# Imports inside functions: memory at rest (loaded on request).
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

from ..model import redact
from ..sanitize import dumps
from ..wire.sse import format_event
from .access import needs_redaction
from .config import FD_RESERVE, open_file_limit
from .events import EventHub

if TYPE_CHECKING:  # pragma: no cover
    from zeroconf.asyncio import AsyncZeroconf

    from ..discovery.client import AsyncClient
    from ..discovery.types import DiscoveryEvent, RemoteHost
    from ..model import HostSnapshot
    from ..wire.fleet import FleetView, HostHeads, HostRecord
    from .config import DaemonConfig

log = logging.getLogger(__name__)

# Following more hosts than this, the fleet view parses a host's later snapshots at most every
# gpusd.discovery.client.REPARSE (5) s while nobody streams its events, and answers with each host as last
# parsed.  A snapshot of 8 GPUs costs ~0.35-0.55 ms to parse: up to this many hosts parsing every one on
# arrival costs under 4-6 % of a core at 1 s sampling; 1,000 hosts kept 49-64 % of a core busy, now about
# a fifth of that (bench/bench_fleet_scale.py).
DEFER_ABOVE = 100

# While a level of GET /api/v1/fleet (redacted or not) was asked for in the last WARM s (a reader that polls:
# gpusd top --url, a dashboard), each host's new snapshot is encoded for it when it comes, so the answer only
# joins bytes; beyond, it is encoded by the next answer (after WARM s most hosts have sent a newer one
# anyway), and the bytes kept for that level are freed.  Encoding on arrival costs what the answer saves
# only while answers come at least as often as the snapshots are parsed: hence a short window.
WARM = 10.0


def followed_cap(configured: int) -> int:
    """The hosts the fleet view follows at most: ``fleet_max_hosts``, lowered where the open-file
    limit would run out first.  A followed host costs one descriptor (its event stream,
    bench/bench_fleet_scale.py); half of what the limit leaves beyond the daemon's
    :data:`~gpusd.daemon.config.FD_RESERVE` goes to followed hosts, the other half to incoming
    connections (:func:`~gpusd.daemon.service.connection_cap`)."""
    soft = open_file_limit()
    return configured if soft is None else min(configured, max(16, (soft - FD_RESERVE) // 2))


class Fleet:
    """The fleet view.  It gets what it uses: the daemon's configuration (session, token, fleet mode)
    and the daemon's shared zeroconf instance."""

    def __init__(self, config: "DaemonConfig", zc: "AsyncZeroconf | None", *, allow_loopback: bool = False) -> None:
        self.config = config
        self.zc = zc
        # follow announced loopback addresses (a daemon pinned to loopback)
        self.allow_loopback = allow_loopback
        self.hub = EventHub(maxsize=1024, max_subscribers=config.max_subscribers,
                            per_peer=config.max_subscribers_per_peer,
                            reserved=config.reserved_subscribers if config.token else 0)
        self.client: AsyncClient | None = None
        self._start_lock = asyncio.Lock()
        self._last_used = time.monotonic()
        self._idle_task: asyncio.Task[None] | None = None
        # parses the snapshots due each second (_parse_due)
        self._due_task: asyncio.Task[None] | None = None
        # stop() was called: a late request must not start a client again
        self._closed = False
        # per answer level (redacted or not): id(host) -> (the host, its snapshot, the snapshot's bytes)
        self._kept: dict[bool, dict[int, tuple[RemoteHost, HostSnapshot, bytes]]] = {False: {}, True: {}}
        # time.monotonic() of the last answer of each level
        self._asked = {False: -WARM, True: -WARM}
        self._heads: HostHeads | None = None
        # the replay's messages of each host, formatted around their ts (replay), and the client they are of
        self._replayed: dict[int, tuple[RemoteHost, tuple[Any, ...], list[tuple[bytes, bytes]]]] = {}
        self._replay_of: AsyncClient | None = None

    def touch(self) -> None:
        self._last_used = time.monotonic()

    async def ensure_started(self, settle: float = 2.0) -> None:
        self.touch()
        if self._closed or (self.client is not None and self.client.listening):
            return
        async with self._start_lock:
            if self._closed or (self.client is not None and self.client.listening):
                return
            from ..discovery.client import AsyncClient

            cfg = self.config
            cap = followed_cap(cfg.fleet_max_hosts)
            if cap < cfg.fleet_max_hosts:
                log.warning("fleet view: following at most %d hosts, not %d (fleet_max_hosts): the open-file "
                            "limit leaves no more", cap, cfg.fleet_max_hosts)
            # Requests to peers are signed with the fleet secret (never sent); peers that prove they
            # hold it too are "verified" and show this daemon (so its signed readers) their process
            # owners; to readers without the secret the fleet view is redacted on the way out.
            # Announced loopback addresses are followed only by a daemon itself pinned to loopback.
            client = AsyncClient(session=cfg.session, zeroconf=self.zc, token=cfg.token,
                                 max_hosts=cap, allow_loopback=self.allow_loopback,
                                 peers=cfg.peers, peers_file=cfg.peers_file, dns_sd_domain=cfg.dns_sd_domain,
                                 dns_server=cfg.dns_server)
            client.register_event_handler("*", self._republish)
            client.on_snapshot = self._snapshot_came
            # Beyond DEFER_ABOVE hosts, while nobody streams the fleet's events, a host's later snapshots
            # are parsed at most every REPARSE s, the newest kept as received; what reads the view inside
            # the daemon (the pool's cap, a stream's replay) parses them first (docs/scale.md).  A stream's
            # replay reads the view, then every snapshot is parsed on arrival while it lasts.
            client.defer_snapshots = self._unwatched
            await client.start_listening()
            self.client = client
            log.info("fleet view started (session %s, following at most %d hosts)", cfg.session, cap)
            if cfg.fleet == "auto" and self._idle_task is None:
                self._idle_task = asyncio.ensure_future(self._stop_when_idle())
            if self._due_task is None:
                self._due_task = asyncio.ensure_future(self._parse_due())
            await client.wait_settled(settle)

    def _unwatched(self) -> bool:
        client = self.client
        return len(self.hub) == 0 and client is not None and client.followed > DEFER_ABOVE

    def _republish(self, event: DiscoveryEvent) -> None:
        # no reader: no event to format (8 a host a second where GPUs' loads change)
        if len(self.hub):
            self.hub.publish(event.event, event.to_dict())

    def replay(self) -> list[bytes]:
        """What a new fleet stream starts with: host_added and device_added for everything known.  Each
        host's messages are kept formatted (1,000 hosts of 8 GPUs: 9,000 messages, ~0.5 s of CPU to
        format) until what they say changes (its snapshot, its announcement, its name or proof); only
        their ``ts``, the time of this replay, is written anew."""
        out: list[bytes] = []
        client = self.client
        if client is None:
            return out
        # with the client (not at rest)
        from ..discovery.types import DEVICE_ADDED, HOST_ADDED, DiscoveryEvent

        # another client (stopped when idle, started again): its own filters
        if self._replay_of is not client:
            self._replayed, self._replay_of = {}, client
        # as the JSON encoder writes a float
        stamp = repr(time.time()).encode()
        kept: dict[int, tuple[RemoteHost, tuple[Any, ...], list[tuple[bytes, bytes]]]] = {}
        for host in client.hosts:
            facts = (host.snapshot, host.txt, host.hostname, host.node_id, host.session, host.url, host.source,
                     host.via, host.verified, host.copy_of)
            hit = self._replayed.get(id(host))
            if hit is not None and hit[0] is host and _same(hit[1], facts):
                parts = hit[2]
            else:
                parts = [_around_ts(format_event(HOST_ADDED, DiscoveryEvent(HOST_ADDED, host, ts=_TS_MARK).to_dict()))]
                for dev in host.devices():
                    if client.filters.device_ok(dev.gpu):
                        parts.append(_around_ts(format_event(DEVICE_ADDED, DiscoveryEvent(
                            DEVICE_ADDED, host, device=dev, ts=_TS_MARK).to_dict())))
            # the host held: its id is not reused while kept
            kept[id(host)] = (host, facts, parts)
            out.extend(head + stamp + tail for head, tail in parts)
        self._replayed = kept
        return out

    def view(self, catch_up: bool = True) -> FleetView:
        """The fleet as ``GET /api/v1/fleet`` serves it (:class:`gpusd.wire.fleet.FleetView`); with
        ``catch_up`` False, each host as last parsed (beyond ``DEFER_ABOVE`` hosts: at most
        :data:`gpusd.discovery.client.REPARSE` s older than its newest snapshot)."""
        # on the first request: a daemon at rest has no fleet view
        from ..wire.fleet import FleetView

        view = FleetView(session=self.config.session)
        if self.client is not None:
            view.hosts = [h.record() for h in self.client.host_list(catch_up)]
            view.hosts_dropped = self.client.dropped_hosts
        return view

    def to_dict(self) -> dict[str, Any]:
        return self.view().to_dict()

    def answer(self, only_own: str | None = None, redact: bool = False) -> bytes:
        """The bytes of ``GET /api/v1/fleet`` (the document of :meth:`to_dict`), each host as last parsed,
        assembled from the parts kept per host: its snapshot's bytes (encoded when the snapshot came, while
        answers are asked for: :meth:`_snapshot_came`; else here, once per snapshot), its head's fields
        that follow its announcement (:class:`~gpusd.wire.fleet.HostHeads`), so an answer costs little
        more than joining them (1,000 hosts of 8 GPUs: 10.6 MB, ~0.25 s of CPU to encode afresh).
        ``redact``: private fields (process owners, commands) nulled, except those of the host ``only_own``
        names (a node id: the answer for a local reader without the fleet secret), if any."""
        from ..wire.fleet import FleetView, HostHeads, host_json, snapshot_bytes

        self._asked[redact] = time.monotonic()
        view = FleetView(session=self.config.session)
        hosts: list[RemoteHost] = []
        if self.client is not None:
            # the snapshots due a parse are parsed by _parse_due each second, not by the answer
            hosts = self.client.host_list(catch_up=None if self._due_task is not None else False)
            view.hosts_dropped = self.client.dropped_hosts
        # the hosts themselves: only their record's fields are read
        view.hosts = list(hosts)
        if self._heads is None:
            self._heads = HostHeads()
        heads = self._heads
        kept, plain = self._kept[redact], self._kept[False]
        fresh: dict[int, tuple[RemoteHost, HostSnapshot, bytes]] = {}
        # id(host) -> its snapshot's bytes in this answer
        parts: dict[int, bytes] = {}
        for h in hosts:
            snap = h.snapshot
            if snap is None:
                continue
            mine = plain.get(id(h))
            unredacted = mine[2] if mine is not None and mine[1] is snap else None
            # this host's own: not redacted
            if redact and only_own is not None and h.node_id == only_own:
                parts[id(h)] = unredacted if unredacted is not None else snapshot_bytes(snap)
                continue
            hit = kept.get(id(h))
            if hit is not None and hit[1] is snap:
                body = hit[2]
            else:
                body = unredacted if unredacted is not None else snapshot_bytes(snap)
                if redact:
                    body = _redacted(body, snap)
            # the host held: its id is not reused while kept
            fresh[id(h)] = (h, snap, body)
            parts[id(h)] = body

        def one(h: HostRecord) -> bytes:
            return host_json(h, heads, parts.get(id(h), b"null"))

        try:
            return view.to_json(one)
        finally:
            self._kept[redact] = fresh
            heads.rotate()

    def _snapshot_came(self, host: RemoteHost) -> None:
        """A host's new snapshot (checked, redacted where it did not prove itself): encoded now for each
        level of answer asked for in the last :data:`WARM` s, so that an answer finds it encoded; a level
        nobody asked for lately keeps nothing (its bytes are freed)."""
        snap = host.snapshot
        if snap is None:
            return
        from ..wire.fleet import snapshot_bytes

        now = time.monotonic()
        warm = {level: now - self._asked[level] < WARM for level in (False, True)}
        for level, on in warm.items():
            if not on and self._kept[level]:
                self._kept[level] = {}
        if warm[False] or warm[True]:
            body = snapshot_bytes(snap)
            if warm[False]:
                self._kept[False][id(host)] = (host, snap, body)
            if warm[True]:
                self._kept[True][id(host)] = (host, snap, _redacted(body, snap))

    async def _parse_due(self) -> None:
        """Each second, the snapshots kept unparsed longer than REPARSE s (their hosts sent no newer one)
        are parsed, as an answer would otherwise do first: an answer then only reads (each host at most
        REPARSE + 1 s older than its newest snapshot)."""
        from ..discovery import client as discovery_client

        try:
            while True:
                await asyncio.sleep(1.0)
                client = self.client
                if client is not None:
                    try:
                        client.catch_up(discovery_client.REPARSE)
                    except Exception:
                        # one host's trouble must not stop the others being parsed
                        log.exception("fleet view: parsing the snapshots due failed")
        except asyncio.CancelledError:
            pass

    async def _stop_when_idle(self) -> None:
        idle = self.config.fleet_idle
        try:
            while True:
                await asyncio.sleep(min(idle, 30.0))
                if len(self.hub) or time.monotonic() - self._last_used < idle:
                    continue
                client, self.client = self.client, None
                if client is not None:
                    log.info("fleet view idle: stopped")
                    await client.stop_listening()
        except asyncio.CancelledError:
            pass
        finally:
            self._idle_task = None

    async def stop(self) -> None:
        self._closed = True
        if self._idle_task is not None:
            self._idle_task.cancel()
        if self._due_task is not None:
            self._due_task.cancel()
            self._due_task = None
        self.hub.close()
        if self.client is not None:
            with contextlib.suppress(Exception):
                await self.client.stop_listening()
            self.client = None


# the ts a kept replay message is formatted with, then cut out: no event is that old
_TS_MARK = -1.25


def _around_ts(message: bytes) -> tuple[bytes, bytes]:
    """A replay message formatted with ts ``_TS_MARK``, cut around that value (the first field after
    "event": strings are escaped, so the mark is found where the field is)."""
    mark = b'"ts":' + repr(_TS_MARK).encode() + b","
    at = message.index(mark) + len(b'"ts":')
    return message[:at], message[at + len(repr(_TS_MARK)):]


def _same(kept: tuple[Any, ...], now: tuple[Any, ...]) -> bool:
    """Whether a host's facts are what they were: its snapshot and announcement the same objects, the
    rest equal."""
    return kept[0] is now[0] and kept[1] is now[1] and kept[2:] == now[2:]


def _redacted(body: bytes, snap: HostSnapshot) -> bytes:
    """A snapshot's bytes (``body``, as :func:`~gpusd.wire.fleet.snapshot_bytes` wrote ``snap``) with its
    private fields (process owners, commands) nulled: ``body`` itself where it carries none."""
    if not needs_redaction(body):
        return body
    return dumps(redact(snap.to_dict()), separators=(",", ":")).encode()
