"""Following one host: its event stream, and what its daemon proved (docs/security.md).

A :class:`Follower` is made for each service instance a host source finds (an mDNS service, a static
peer, a wide-area DNS-SD instance).  It asks its source to resolve the instance into a
:class:`~gpusd.discovery.types.RemoteHost`, opens the daemon's event stream (``GET /api/v1/events``,
signed with the fleet key, over TLS pinned to the announced certificate where announced), checks the
answer's proof and the signed host identity (``Gpusd-Host``/``Gpusd-Addrs``: "What a client believes,
and from whom"), reads snapshots, heartbeats, threshold and job events, and reconnects within the
liveness bound.  What it learns goes to the client (:meth:`AsyncClient.report`,
:meth:`AsyncClient.report_removed`), which keeps the table of hosts and devices and emits the events.

How a stream ends is a typed :class:`StreamEnd` (it was a string before: ``"bye"``, ``"lost"``, a
reason): ``Ending.BYE``, ``Ending.LOST`` (streamed, then lost), ``Ending.FOLLOWED_ALREADY`` (its node is
reported, found another way), or ``Ending.FAILED`` with the reason.
"""

# Imports inside functions: optional or heavy packages.
from __future__ import annotations

import asyncio
import contextlib
import enum
import ipaddress
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..model import HostSnapshot, redact
from ..sanitize import json_object
from ..wire.mdns import rank_addresses
from ..wire.signing import Headers, Request, Response, fingerprint_bytes
from ..wire.sse import SSEError, SSEParser
from ..wire.txt import API_PREFIX, SERVICE_TYPE, announced_host
from .types import (
    JOB,
    THRESHOLD_CLEARED,
    THRESHOLD_EXCEEDED,
    Device,
    DiscoveryEvent,
    RemoteHost,
    SignedIdentity,
)

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Awaitable
    from typing import Protocol

    import aiohttp

    from ..model import GpuInfo
    from ..wire.signing import FleetKey, Proof
    from .types import Filters

    class FollowingClient(Protocol):
        """What a follower and a host source call on their client: :class:`gpusd.discovery.client.AsyncClient`
        (that module is above this one and the sources; docs/api.md documents this side of it)."""

        @property
        def listening(self) -> bool: ...
        @property
        def liveness_timeout(self) -> float: ...
        @property
        def silence_timeout(self) -> float: ...
        @property
        def pace(self) -> float | None: ...
        @property
        def http(self) -> aiohttp.ClientSession | None: ...
        @property
        def key(self) -> FleetKey | None: ...
        @property
        def allow_loopback(self) -> bool | None: ...
        @property
        def filters(self) -> Filters: ...
        @property
        def unmatched_hosts(self) -> set[str]: ...
        def report(self, peer: Follower, host: RemoteHost, gpus: list[GpuInfo],
                   snap: HostSnapshot | None = None) -> None: ...
        def report_removed(self, peer: Follower, reason: str) -> None: ...
        def deferring(self) -> bool: ...
        def defer(self, peer: Follower, text: str) -> None: ...
        def undefer(self, peer: Follower) -> None: ...
        def emit(self, event: DiscoveryEvent) -> None: ...
        def follower(self, name: str) -> Follower | None: ...
        def followers(self) -> list[Follower]: ...
        # source: a gpusd.discovery.source.HostSource (that module is above this one)
        def add(self, name: str, source: Any, *, service_type: str = SERVICE_TYPE, spec: Any = None,
                from_file: bool = False, hold: float = 0.0, answer: bool = False,
                capped: bool = True) -> Follower | None: ...
        def drop(self, peer: Follower, reason: str) -> None: ...
        def spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]: ...

    class FoundBy(Protocol):
        """What a follower asks of the host source that found it (:class:`gpusd.discovery.source.HostSource`)."""

        via: str

        async def resolve(self, follower: Follower) -> RemoteHost | None: ...

# the client's log, as before the split
log = logging.getLogger("gpusd.discovery.client")

# seconds between daemon heartbeats (the daemon's default)
HEARTBEAT = 2.0
RESOLVE_TIMEOUT = 3.0
# seconds a reconnection may take before the host counts as gone
RECONNECT_BUDGET = 2.0
# retrying an announced host that does not answer (doubling)
RETRY_MIN, RETRY_MAX = 1.0, 15.0


class Ending(enum.Enum):
    """How one connection to a host's event stream ended."""

    # the daemon said goodbye
    BYE = "bye"
    # streamed, then lost (closed, silent, broken)
    LOST = "lost"
    # its node is reported already, found another way
    FOLLOWED_ALREADY = "followed already"
    # no valid stream here (``reason`` says why)
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class StreamEnd:
    how: Ending
    reason: str = ""

    @property
    def why(self) -> str:
        """The words a ``host_removed`` event and the log give."""
        return self.reason or self.how.value


BYE, LOST, FOLLOWED_ALREADY = StreamEnd(Ending.BYE), StreamEnd(Ending.LOST), StreamEnd(Ending.FOLLOWED_ALREADY)


def failed(reason: str) -> StreamEnd:
    return StreamEnd(Ending.FAILED, reason)


@dataclass(eq=False)
class Follower:
    """One service instance a source found, and the task that follows it."""

    client: FollowingClient
    source: FoundBy
    name: str
    type: str = SERVICE_TYPE
    task: asyncio.Task[None] | None = None
    # set once resolved and valid
    host: RemoteHost | None = None
    # host_added was emitted
    reported: bool = False
    # reported devices by UUID
    devices: dict[str, Device] = field(default_factory=dict)
    updated: asyncio.Event = field(default_factory=asyncio.Event)
    streaming: bool = False
    # resolved and either reported or given up on (for wait_settled)
    settled: bool = False
    problems: set[str] = field(default_factory=set)  # logged once each
    # what the source knows of it (a static peer's PeerSpec, a wide-area DnsSdInstance)
    spec: Any = None
    # a static peer listed in the peers file (dropped when the file drops it)
    from_file: bool = False
    # its node is reported already, found another way (AsyncClient.shadowing)
    shadowed: bool = False
    # the newest snapshot received and not parsed yet (AsyncClient.defer_snapshots: parsed when read)
    pending: str | None = None
    # time.monotonic() when its last snapshot was parsed
    parsed_at: float = 0.0

    @property
    def via(self) -> str:
        """How it was found: ``mdns``, ``peer`` (static) or ``dns-sd`` (wide area)."""
        return self.source.via

    def start(self, hold: float = 0.0) -> None:
        self.task = asyncio.ensure_future(self.follow(hold))

    def restart(self) -> None:
        """Forget what was reported and follow again (another node, session or name now)."""
        if self.task is not None:
            self.task.cancel()
        self.client.report_removed(self, "identity changed")
        self.start()

    def problem(self, message: str, level: int = logging.WARNING) -> None:
        """Log a problem with this instance once (repeats at debug level)."""
        level = logging.DEBUG if message in self.problems else level
        self.problems.add(message)
        log.log(level, "skipping %s: %s", self.name, message)

    # -- the follow loop ------------------------------------------------------------------------
    async def follow(self, hold: float = 0.0) -> None:
        client = self.client
        retry = RETRY_MIN
        try:
            # back right after its goodbye (mdns.REAPPEAR_HOLD)
            if hold > 0:
                await asyncio.sleep(hold)
            while client.listening:
                self.updated.clear()
                host = await self.source.resolve(self)
                if host is None:
                    client.report_removed(self, "announcement no longer valid")
                    self.settled = True
                    await self._wait_update(retry)
                    retry = min(retry * 2, RETRY_MAX)
                    continue
                if host.txt.source == "hwsd":
                    self.settled = True
                    self._report_static(host)
                    await self.updated.wait()
                    continue
                connected = await self._stream(host)
                self.settled = True
                if connected:
                    retry = RETRY_MIN
                await self._wait_update(retry)
                retry = min(retry * 2, RETRY_MAX)
        except asyncio.CancelledError:
            raise
        except Exception:
            # never let one host's trouble escape
            log.exception("following %s failed", self.name)
            self.settled = True

    def keep(self, host: RemoteHost) -> RemoteHost:
        """``host``, newly resolved, as this instance's host; it keeps what was reported (snapshot, alive,
        URL) and what its daemon proved (checked again on the next connection)."""
        old = self.host
        if old is not None and self.reported:
            host.snapshot, host.alive, host.url = old.snapshot, old.alive, old.url
            host.verified, host.identity, host.copy_of = old.verified, old.identity, old.copy_of
        self.host = host
        return host

    async def _wait_update(self, seconds: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.updated.wait(), seconds)

    def _report_static(self, host: RemoteHost) -> None:
        """An hwsd host: its GPUs come from the announcement."""
        host.alive = True
        host.heard()
        self.client.report(self, host, host.gpus())

    async def _stream(self, host: RemoteHost) -> bool:
        """Follow a gpusd host's event stream until it is gone; report its removal.  Returns whether
        a stream was ever established."""
        client = self.client
        ever = False
        quick_losses = 0
        try:
            while client.listening:
                started = time.monotonic()
                # a reconnection: within what is left of the liveness bound
                if self.reported:
                    deadline = min(host.heard_at + client.liveness_timeout - 0.3, started + RECONNECT_BUDGET)
                else:
                    deadline = started + RESOLVE_TIMEOUT + 2.0
                end = await self._session(host, deadline)
                if end.how is Ending.BYE:
                    client.report_removed(self, "bye")
                    return True
                if end.how is Ending.LOST:
                    ever = True
                    quick_losses = quick_losses + 1 if time.monotonic() - started < 2.0 else 0
                    if quick_losses < 3:
                        # one more connection within the liveness budget
                        continue
                    reason = "stream keeps closing"
                else:
                    reason = end.why
                client.report_removed(self, reason)
                return ever
        finally:
            self.streaming = False
        return ever

    async def _session(self, host: RemoteHost, deadline: float) -> StreamEnd:
        """One connection: BYE, LOST (streamed, then lost), FOLLOWED_ALREADY, or FAILED with a reason."""
        import aiohttp

        client = self.client
        http = client.http
        assert http is not None
        key = client.key
        failure = failed("unreachable")
        pace = client.pace
        # a static peer's address is the user's own choice (--peer 127.0.0.1 is fine); announced ones
        # (mDNS, wide-area DNS-SD) are followed only where they point at another machine
        addresses = [a for a in rank_addresses(host.addresses)
                     if client.allow_loopback or self.via == "peer" or not local_only(a)]
        if not addresses:
            self.problem(f"announces only loopback/link-local addresses {host.addresses[:4]}: not followed")
            return failed("no usable address")
        # With the fleet secret, over TLS where the host announces it (its certificate pinned to the
        # announced fingerprint, which its signed proof must name too), else plain HTTP.
        tls = key is not None and host.txt.tls_port is not None and host.txt.cert_fp is not None
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
                return failed("no answer within the liveness bound")
            headers = {"Accept": "text/event-stream"}
            nonce = None
            events = url + "/events" + ("" if pace is None else f"?pace={pace:g}")
            if key is not None:
                # over TLS, bound to the certificate pinned (aiohttp checks the connection shows it)
                signed, nonce = key.sign_request("GET", events, node_id=host.node_id,
                                                 cert_fp=host.txt.cert_fp if secure else None)
                headers.update(signed)
            try:
                resp = await asyncio.wait_for(http.get(events, headers=headers, ssl=ssl_arg), budget)
                if resp.status == 401 and nonce is not None:
                    # a daemon of another fleet (another secret): follow its public data, unverified
                    resp.release()
                    headers, nonce = {"Accept": "text/event-stream"}, None
                    host.verified = False
                    resp = await asyncio.wait_for(http.get(events, headers=headers, ssl=ssl_arg),
                                                  max(0.1, deadline - time.monotonic()))
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                failure = failed(f"cannot connect to {url}: {exc.__class__.__name__}")
                log.debug("%s: %s", self.name, failure.reason)
                continue
            try:
                if resp.status != 200 or not resp.content_type.startswith("text/event-stream"):
                    self.problem(f"{url}/events answered {resp.status} {resp.content_type}")
                    failure = failed("not a gpusd event stream")
                    continue
                host.identity = host.copy_of = None
                # a snapshot kept from the last connection: not of what this one proves
                self.client.undefer(self)
                if key is None:
                    host.verified = None
                elif nonce is None:
                    # refused our signature (another fleet)
                    host.verified = False
                else:
                    host.verified = self._believe(host, self._proved(
                        events, headers, resp, nonce, host, host.txt.cert_fp if secure else None))
                if host.verified is False and host.copy_of is None:
                    # INFO: the views mark such a host [unverified] and the pool commands say once how
                    # many they left out (a LAN of strangers would otherwise print a line per host)
                    self.problem("did not prove it holds the fleet secret: shown as unverified, "
                                 "without private fields", logging.INFO)
                # host.url stays the plain HTTP API base (public reads, Prometheus targets, the
                # dashboard's alert requests), also when the stream itself came over TLS
                end = await self._read_stream(host, resp, f"http://{address}:{host.port}{API_PREFIX}", deadline)
                if end.how is not Ending.FAILED:
                    return end
                # no valid stream at this address (another machine's?): try the next
                failure = end
            finally:
                resp.release()
        return failure

    async def _read_stream(self, host: RemoteHost, resp: Any, url: str, deadline: float) -> StreamEnd:
        parser = SSEParser()
        got_snapshot = False
        silence = self.client.silence_timeout
        while True:
            # before the first snapshot: the connection deadline; then: silence timeout
            timeout = (deadline - time.monotonic()) if not got_snapshot else silence
            if timeout <= 0:
                return failed("no snapshot within the liveness bound")
            try:
                chunk = await asyncio.wait_for(resp.content.readany(), timeout)
            except asyncio.TimeoutError:
                return LOST if got_snapshot else failed("no snapshot in time")
            except Exception as exc:
                # aiohttp.ClientPayloadError, ConnectionResetError, ...
                log.debug("%s: stream error %r", self.name, exc)
                return LOST if got_snapshot else failed("stream error")
            if not chunk:
                return LOST if got_snapshot else failed("stream closed")
            try:
                events = list(parser.feed(chunk))
            except SSEError as exc:
                self.problem(f"bad event stream: {exc}")
                return LOST if got_snapshot else failed("bad event stream")
            for name, data in events:
                if name == "snapshot":
                    if got_snapshot and self.reported and self.client.deferring():
                        # kept as received, parsed when the client's hosts are read (AsyncClient.catch_up):
                        # a fleet view nobody reads need not parse 1,000 snapshots a second
                        self.client.defer(self, data)
                        host.heard()
                        continue
                    self.client.undefer(self)
                    snap = self.parse_snapshot(host, data)
                    if snap is None:
                        if not got_snapshot:
                            return failed("invalid snapshot")
                        continue
                    if not got_snapshot:
                        got_snapshot = True
                        host.url = url
                        self.streaming = True
                        self.problems.clear()
                    host.heard()
                    host.alive = True
                    self.client.report(self, host, snap.gpus, snap)
                    if self.shadowed:
                        self.shadowed = False
                        return FOLLOWED_ALREADY
                elif not got_snapshot:
                    # anything before the snapshot is ignored
                    continue
                elif name == "heartbeat":
                    host.heard()
                elif name == "bye":
                    return BYE
                elif name == "threshold":
                    host.heard()
                    self._threshold(host, data)
                elif name == "job":
                    host.heard()
                    self._job(host, data)

    # -- verification ---------------------------------------------------------------------------
    def _proved(self, url: str, sent: dict[str, str], resp: Any, nonce: str, host: RemoteHost,
                cert_fp: str | None = None) -> Proof | None:
        """The fleet's proof the answer carries for our request to ``host`` (its node id; over TLS,
        naming the pinned certificate ``cert_fp``), or None."""
        key = self.client.key
        assert key is not None
        answer = Response(resp.status, Request("GET", url, Headers(sent)), Headers(resp.headers.items()))
        return key.response_proof(answer, nonce, node_id=host.node_id, cert_fp=cert_fp)

    def _believe(self, host: RemoteHost, proof: Proof | None) -> bool:
        """Whether ``host`` is verified: its daemon proved it holds the fleet secret *and* signed the
        host name its announcement gives (docs/security.md, "What a client believes, and from whom").
        Sets ``host.identity`` (the signed name and addresses) when it is; ``host.copy_of`` when the
        daemon proved it is another host (the announcement is a copy, under a name of its own)."""
        if proof is None:
            return False
        if proof.host is None:
            self.problem("proved it holds the fleet secret but signed no host name (a gpusd older than "
                         "0.3?): shown as unverified, never used for placement")
            return False
        if host.txt.hostname != announced_host(proof.host):
            host.copy_of = proof.host
            self.problem(f"announces host {host.txt.hostname[:80]!r}, but the daemon it points at proved it "
                         f"is {proof.host[:80]!r}: an unverified copy of that host's announcement, "
                         "never used for placement")
            return False
        host.identity = SignedIdentity(proof.node_id, proof.host, proof.addresses)
        return True

    def parse_snapshot(self, host: RemoteHost, data: str) -> HostSnapshot | None:
        """A snapshot event's text as a checked snapshot of ``host`` (None: invalid, logged once)."""
        self.parsed_at = time.monotonic()
        try:
            snap = HostSnapshot.from_json(data)
        except (ValueError, TypeError, RecursionError) as exc:
            self.problem(f"invalid snapshot: {str(exc)[:200]}")
            return None
        # private fields are trusted only from daemons that proved themselves
        if host.verified is False:
            redact(snap)
        if snap.node_id != host.node_id:
            self.problem(f"snapshot names node {snap.node_id[:40]!r}, TXT says {host.node_id!r}")
            return None
        return snap

    # -- the stream's other events --------------------------------------------------------------
    def _threshold(self, host: RemoteHost, data: str) -> None:
        try:
            d = json_object(data)
        except ValueError:
            return
        if d.get("state") not in ("exceeded", "cleared"):
            return
        device: Device | None = None
        gpu = d.get("gpu")
        for dev in self.devices.values():
            if gpu is not None and (dev.uuid == gpu or dev.index == gpu):
                device = dev
        kind = THRESHOLD_EXCEEDED if d["state"] == "exceeded" else THRESHOLD_CLEARED
        self.client.emit(DiscoveryEvent(kind, host, device=device, data=d))

    def _job(self, host: RemoteHost, data: str) -> None:
        """A rebalancing decision (docs/jobs.md): only its known fields, typed and bounded."""
        try:
            d = json_object(data[:8192])
        except ValueError:
            return
        if d.get("action") not in ("move", "pause", "resume"):
            return
        out: dict[str, Any] = {"action": d["action"], "ok": d.get("ok") is True}
        for key, limit in (("job", 32), ("gpu", 128), ("reason", 300), ("result", 300)):
            v = d.get(key)
            out[key] = v[:limit] if isinstance(v, str) else None
        for key in ("index", "to"):
            v = d.get(key)
            out[key] = v if type(v) is int and -1 <= v < 4096 else None
        device = next((dev for dev in self.devices.values() if dev.uuid == out["gpu"]), None)
        self.client.emit(DiscoveryEvent(JOB, host, device=device, data=out))


def local_only(address: str) -> bool:
    """An address that points back at this machine or means nothing on the LAN: never followed when
    announced by someone else (a record pointing at 127.0.0.1:4780 would send the client to itself)."""
    try:
        a = ipaddress.ip_address(address)
    except ValueError:
        return True
    return a.is_loopback or a.is_link_local or a.is_unspecified or a.is_multicast or a.is_reserved


__all__ = ["Ending", "Follower", "StreamEnd", "local_only"]
