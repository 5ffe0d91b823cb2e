"""The mDNS host source: browsing ``_gpusd._tcp.local.`` (and hwsd's ``_gpu-sd._tcp.local.``).

A python-zeroconf ``AsyncServiceBrowser`` reports services; each is resolved and its TXT record
validated (records of other sessions, other versions, malformed or lying records are logged once and
skipped).  A goodbye removes a host at once; a service announced again right after its goodbye is
followed only after :data:`REAPPEAR_HOLD`.  An update of a followed service's TXT is read from the
cache; a new node, session or host name there starts the host over.
"""

# Imports inside functions: optional or heavy packages.
from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import time
from typing import TYPE_CHECKING, Any, Sequence

from ..wire.mdns import open_zeroconf, resolve_interfaces
from ..wire.txt import HWSD_TYPE, SERVICE_TYPE, TxtError, decode_hwsd, decode_txt
from .follower import RESOLVE_TIMEOUT
from .types import RemoteHost

if TYPE_CHECKING:  # pragma: no cover
    from zeroconf.asyncio import AsyncServiceBrowser, AsyncZeroconf

    from .follower import Follower, FollowingClient

# the client's log, as before the split
log = logging.getLogger("gpusd.discovery.client")

# A service that said goodbye and is announced again within this long is followed only then: a
# stopping responder may still multicast an answer it had queued (python-zeroconf delays an answer
# by a second when it multicast the record less than a second before), and the stopping daemon may
# still accept a connection; a restarted daemon (probing alone takes ~0.75 s) is merely seen later.
REAPPEAR_HOLD = 2.0


class MdnsSource:
    """Hosts announced on the link (``via`` "mdns")."""

    via = "mdns"
    # a browser never finishes: wait_settled's quiet period covers it
    browsed = True

    def __init__(self, interfaces: Sequence[str] | None = None, include_hwsd: bool = True,
                 zeroconf: AsyncZeroconf | None = None) -> None:
        self.interface_specs = list(interfaces) if interfaces is not None else None
        self.include_hwsd = include_hwsd
        self.zc: AsyncZeroconf | None = zeroconf
        self._own_zc = zeroconf is None
        self._browser: AsyncServiceBrowser | None = None
        # the DNSQuestionType of our queries (set when listening starts)
        self._question: Any = None
        # service name -> monotonic time of its goodbye
        self._goodbyes: dict[str, float] = {}
        self._client: FollowingClient | None = None

    @property
    def service_types(self) -> list[str]:
        return [SERVICE_TYPE] + ([HWSD_TYPE] if self.include_hwsd else [])

    def bound_to_loopback(self) -> bool:
        """Whether the client browses on loopback only (tests, the demo)."""
        ifaces = resolve_interfaces(self.interface_specs)
        return bool(ifaces) and all(_is_loopback(a) for a in ifaces or ())

    async def open(self, client: FollowingClient) -> None:
        if self.zc is None:
            self.zc = await open_zeroconf(resolve_interfaces(self.interface_specs))
            self._own_zc = True

    def start(self, client: FollowingClient) -> None:
        from zeroconf import DNSQuestionType
        from zeroconf.asyncio import AsyncServiceBrowser

        assert self.zc is not None
        self._client = client
        # QM questions (multicast answers) only: with QU the answers come by unicast to port 5353,
        # which the kernel hands to just one of the sockets bound there -- often another gpusd
        # process on this machine (its daemon) rather than us.  A one-shot zeroconf (.oneshot: its
        # own port, answered by unicast there) asks QU: responders drop a query identical to one
        # they got in the last second (another client's), unless it is QU.
        self._question = DNSQuestionType.QU if getattr(self.zc.zeroconf, "unicast", False) else DNSQuestionType.QM
        self._browser = AsyncServiceBrowser(self.zc.zeroconf, self.service_types, handlers=[self._on_service_change],
                                            question_type=self._question)

    async def stop(self) -> None:
        if self._browser is not None:
            with contextlib.suppress(Exception):
                await self._browser.async_cancel()
            self._browser = None
        if self.zc is not None and self._own_zc:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.zc.async_close(), 5)
            self.zc = None

    # -- the browser ----------------------------------------------------------------------------
    def _on_service_change(self, zeroconf: Any, service_type: str, name: str, state_change: Any) -> None:
        from zeroconf import ServiceStateChange

        client = self._client
        if client is None or not client.listening:
            return
        log.debug("browser: %s %s", state_change.name, name)
        peer = client.follower(name)
        if state_change is ServiceStateChange.Removed:
            if peer is not None:
                client.drop(peer, "goodbye")
                now = time.monotonic()
                self._goodbyes = {k: t for k, t in self._goodbyes.items() if now - t < REAPPEAR_HOLD}
                self._goodbyes[name] = now
            return
        if peer is None:
            gone = self._goodbyes.get(name)
            hold = gone + REAPPEAR_HOLD - time.monotonic() if gone is not None else 0.0
            if client.add(name, self, service_type=service_type, hold=hold, answer=True) is not None:
                self._goodbyes.pop(name, None)
            return
        # Updated: a new TXT (free count, inventory), new address, or a restarted daemon.
        peer.updated.set()
        if peer.streaming and peer.host is not None:
            self._refresh_txt(peer)
        elif peer.task is None or peer.task.done():
            peer.start()

    def _refresh_txt(self, peer: Follower) -> None:
        """Re-read a followed host's TXT from the cache; restart following when it changed identity."""
        from zeroconf.asyncio import AsyncServiceInfo

        assert self.zc is not None and peer.host is not None
        info = AsyncServiceInfo(peer.type, peer.name)
        if not info.load_from_cache(self.zc.zeroconf):
            return
        try:
            txt = decode_txt(info.text or b"")
        except TxtError as exc:
            peer.problem(f"invalid TXT update: {exc}")
            return
        if (txt.node_id == peer.host.node_id and peer.client.filters.host_ok(txt)
                and txt.hostname == peer.host.txt.hostname):
            peer.host.txt = txt
            return
        # Another node, session or host name now: forget what was reported and start over (a new
        # name is checked against the daemon's signed one again).
        peer.restart()

    # -- resolving ------------------------------------------------------------------------------
    async def resolve(self, peer: Follower) -> RemoteHost | None:
        from zeroconf import IPVersion
        from zeroconf.asyncio import AsyncServiceInfo

        assert self.zc is not None
        filters = peer.client.filters
        info = AsyncServiceInfo(peer.type, peer.name)
        try:
            ok = await info.async_request(self.zc.zeroconf, int(RESOLVE_TIMEOUT * 1000), question_type=self._question)
        except Exception as exc:
            # malformed names and the like
            peer.problem(f"cannot resolve: {exc}")
            return None
        if not ok:
            peer.problem("no answer to the resolve query")
            return None
        raw = info.text or b""
        try:
            txt = decode_hwsd(raw) if peer.type == HWSD_TYPE else decode_txt(raw)
        except TxtError as exc:
            peer.problem(f"invalid TXT record: {exc}")
            return None
        if txt.source == "hwsd" and txt.gpusd_marker:
            # a gpusd daemon's compatibility record: the host is listed via _gpusd._tcp
            return None
        if not filters.host_ok(txt):
            if filters.hostname and filters.session in (None, txt.session):
                peer.client.unmatched_hosts.add(peer.name)
            log.debug("ignoring %s: session %r / host %r filtered out", peer.name, txt.session, txt.hostname)
            return None
        addresses = info.parsed_addresses(IPVersion.V4Only)
        if not addresses and txt.source == "gpusd":
            peer.problem("no IPv4 address")
            return None
        port = int(info.port or 0)
        if txt.source == "gpusd" and not 0 < port < 65536:
            peer.problem(f"bad port {port}")
            return None
        if txt.source == "hwsd" and not txt.node_id:
            txt.node_id = peer.name.split(".")[0][:64]
        if txt.source == "hwsd" and not txt.hostname:
            txt.hostname = (info.server or peer.name).rstrip(".").removesuffix(".local")
        return peer.keep(RemoteHost(key=peer.name, txt=txt, addresses=addresses, port=port))


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


__all__ = ["REAPPEAR_HOLD", "MdnsSource"]
