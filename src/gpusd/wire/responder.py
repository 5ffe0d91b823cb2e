"""mDNS conformance that python-zeroconf leaves to its users (docs/wire-format.md, "mDNS conformance").

* **Legacy unicast responses** (RFC 6762 §6.7): a query from a port other than 5353 comes from a
  simple resolver (``dig -p 5353 @host``), which caches what it gets like unicast DNS. python-zeroconf
  answers it with the records' full TTLs (120 s for A/SRV, 4500 s for PTR/TXT); the RFC says at most
  ten seconds. :class:`ConformingZeroconf` caps them. python-zeroconf sends every unicast answer
  through ``Zeroconf.async_send(out, addr, port)`` (its public send method) with the querier's port,
  so the subclass rewrites exactly the answers going to a port other than 5353. Its question echo,
  query id and cleared cache-flush bits are python-zeroconf's own. NSEC records are left out of
  these answers: mDNS compresses their next-name field (RFC 6762 §18.14), which unicast DNS forbids
  (RFC 4034 §4.1.1), and resolvers such as dnspython then reject the whole answer.
  tests/wire/test_responder.py checks this against the installed python-zeroconf, and fails if a new
  version answers some other way.
* **Unicast answers stay on the link** (RFC 6762 §5.5, §11): python-zeroconf answers a unicast query
  from any source address.  :class:`ConformingZeroconf` sends no unicast answer to an address that
  is not on one of the machine's subnets (the list is refreshed every 5 s).
* **The SRV target host name** (RFC 6762 §8.1, §9): python-zeroconf probes a service's instance
  name but never the host name its SRV record points to, and ignores another host announcing
  addresses for that name.  :class:`HostNameGuard` probes ``<instance>.local.`` before the first
  announcement (three QU probes with our addresses in the authority section, 250 ms apart), takes
  ``<instance>-2.local.``, ``-3``, ... while another host answers for it, and after the
  announcement reports any other host's address record for our name so that the announcer moves
  to a new name (probing again) instead of merging its addresses with the other host's.  The probes
  also ask for the A record: python-zeroconf answers A/AAAA questions about a registered service's
  host name but not the ANY questions of standard probes.  That is also why a standard probe by
  another host for *our* name goes unanswered (python-zeroconf's query handler offers no hook to
  answer it): a defence of §8.1 we cannot give; a probe that asks for A gets our answer.

This module imports zeroconf at once: import it lazily (``open_zeroconf`` does).
"""

# Imports inside functions: optional or heavy packages.
from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import random
import socket
import time
from collections import deque
from collections.abc import Callable

# Exported by zeroconf's __init__ (and documented), though left out of its __all__.
from zeroconf import (  # type: ignore[attr-defined]
    DNSAddress,
    DNSHinfo,
    DNSNsec,
    DNSOutgoing,
    DNSPointer,
    DNSQuestion,
    DNSRecord,
    DNSService,
    DNSText,
    RecordUpdate,
    RecordUpdateListener,
    Zeroconf,
    current_time_millis,
)

log = logging.getLogger(__name__)

MDNS_PORT = 5353
LEGACY_UNICAST_MAX_TTL = 10  # RFC 6762 §6.7
_FLAGS_QR_RESPONSE = 0x8000


def capped(record: DNSRecord, ttl: int = LEGACY_UNICAST_MAX_TTL) -> DNSRecord | None:
    """``record`` as a legacy unicast answer: with a TTL of at most ``ttl`` (a copy; cache entries are
    shared), or None to leave it out (NSEC, and record types this module does not know how to copy)."""
    if isinstance(record, DNSNsec):
        return None
    if record.ttl <= ttl:
        return record
    # class_ without the cache-flush bit
    name, type_, class_ = record.name, record.type, record.class_
    if isinstance(record, DNSAddress):
        return DNSAddress(name, type_, class_, ttl, record.address, scope_id=record.scope_id)
    if isinstance(record, DNSPointer):
        return DNSPointer(name, type_, class_, ttl, record.alias)
    if isinstance(record, DNSText):
        return DNSText(name, type_, class_, ttl, record.text)
    if isinstance(record, DNSService):
        return DNSService(name, type_, class_, ttl, record.priority, record.weight, record.port, record.server)
    if isinstance(record, DNSHinfo):
        return DNSHinfo(name, type_, class_, ttl, record.cpu, record.os)
    return None


def legacy_unicast_response(out: DNSOutgoing) -> DNSOutgoing:
    """A copy of the unicast response ``out`` with every TTL at most ten seconds (RFC 6762 §6.7).
    NSEC records, and records of a type that cannot be copied, are left out."""
    new = DNSOutgoing(out.flags, False, out.id)
    for question in out.questions:
        new.add_question(question)
    dropped = 0
    for record, _ in out.answers:
        short = capped(record)
        if short is None:
            dropped += 1
        else:
            new.add_answer_at_time(short, 0)
    for record in out.authorities:
        short = capped(record)
        if short is None:
            dropped += 1
        else:
            new.authorities.append(short)  # type: ignore[arg-type]
    for record in out.additionals:
        short = capped(record)
        if short is None:
            dropped += 1
        else:
            new.add_additional_answer(short)
    if dropped:
        log.debug("legacy unicast answer: %d NSEC or unknown record(s) left out", dropped)
    return new


def is_legacy_unicast_answer(out: DNSOutgoing, addr: str | None, port: int) -> bool:
    return addr is not None and port != MDNS_PORT and not out.multicast and bool(out.flags & _FLAGS_QR_RESPONSE)


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def local_networks() -> list[Network]:
    """The subnets of this machine's (network namespace's) interfaces."""
    import ifaddr

    nets: list[Network] = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            address = ip.ip if isinstance(ip.ip, str) else ip.ip[0]
            with contextlib.suppress(ValueError):
                nets.append(ipaddress.ip_network(f"{address.split('%')[0]}/{ip.network_prefix}", strict=False))
    return nets


def on_link(addr: str, networks: list[Network]) -> bool:
    """Whether a querier's source address is on one of our subnets (IPv6 link-local always is)."""
    try:
        ip = ipaddress.ip_address(addr.split("%")[0])
    except ValueError:
        return False
    return ip.is_link_local or any(ip.version == n.version and ip in n for n in networks)


class ConformingZeroconf(Zeroconf):
    """python-zeroconf's ``Zeroconf`` whose unicast answers follow RFC 6762: none to a querier
    outside our subnets (§5.5, §11), and TTLs of at most ten seconds in answers to legacy unicast
    queries (§6.7)."""

    # seconds the list of our subnets is kept
    NETWORKS_TTL = 5.0

    _networks: list[Network] | None = None
    _networks_at = 0.0

    def _on_link(self, addr: str) -> bool:
        now = time.monotonic()
        if self._networks is None or now - self._networks_at > self.NETWORKS_TTL:
            try:
                self._networks = local_networks()
            except Exception as exc:  # noqa: BLE001 - ifaddr trouble: answer as python-zeroconf would
                log.debug("cannot list local networks: %r", exc)
                return True
            self._networks_at = now
        return on_link(addr, self._networks)

    def async_send(self, out: DNSOutgoing, addr: str | None = None, port: int = MDNS_PORT,
                   v6_flow_scope: tuple[()] | tuple[int, int] = (), transport: object = None) -> None:
        if addr is not None and bool(out.flags & _FLAGS_QR_RESPONSE) and not self._on_link(addr):
            log.debug("not answering %s:%d: not on a local subnet (RFC 6762 §5.5)", addr, port)
            return
        if is_legacy_unicast_answer(out, addr, port):
            out = legacy_unicast_response(out)
        super().async_send(out, addr, port, v6_flow_scope, transport)  # type: ignore[arg-type]


# -- the SRV target host name ---------------------------------------------------------------------

_TYPE_A, _TYPE_AAAA, _TYPE_ANY, _CLASS_IN, _CLASS_UNIQUE = 1, 28, 255, 1, 0x8000
_FLAGS_QR_QUERY, _FLAGS_AA = 0x0000, 0x0400
# RFC 6762 §8.1: random 0-250 ms first, then three probes 250 ms apart
PROBE_WAIT = 0.25
PROBES = 3
# RFC 6762 §8.1 rate limit
CONFLICTS_BEFORE_PAUSE, CONFLICT_WINDOW, CONFLICT_PAUSE = 15, 10.0, 5.0


def _timings() -> tuple[float, float]:
    """(probe interval, longest first wait): shrunk with $GPUSD_MDNS_FAST, as for python-zeroconf,
    but not below the 20-120 ms a responder may wait before answering by multicast (RFC 6762 §6)."""
    if os.environ.get("GPUSD_MDNS_FAST", "") not in ("", "0"):
        return 0.1, 0.02
    return PROBE_WAIT, PROBE_WAIT


class HostNameGuard(RecordUpdateListener):
    """Probe for and keep watch over the host name ``<label>.local.`` that our SRV records point to
    (see the module docstring).  ``on_conflict`` is called (on the event loop) when, after
    :meth:`probe` returned, another host announces an address for our name."""

    def __init__(self, zc: Zeroconf, label: str, addresses: list[str],
                 on_conflict: Callable[[str], None] | None = None) -> None:
        self.zc = zc
        self.label = label
        self.number = 1
        self.addresses = list(addresses)
        # every address we ever announced
        self._own = {socket.inet_aton(a) for a in addresses}
        self.on_conflict = on_conflict
        # conflicts seen, probing or not
        self.conflicts = 0
        self._recent: deque[float] = deque(maxlen=CONFLICTS_BEFORE_PAUSE)
        self._probing = False
        self._conflict: asyncio.Event | None = None
        # the name whose conflict was reported (once per name)
        self._reported: str | None = None
        self._closed = False
        zc.async_add_listener(self, None)

    @property
    def name(self) -> str:
        return f"{self.label}.local." if self.number == 1 else f"{self.label}-{self.number}.local."

    def set_addresses(self, addresses: list[str]) -> None:
        self.addresses = list(addresses)
        self._own |= {socket.inet_aton(a) for a in addresses}

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(Exception):
            self.zc.async_remove_listener(self)

    # -- probing ----------------------------------------------------------------------------
    async def probe(self, rename: bool = False) -> str:
        """Probe until a name is ours and return it (``<label>.local.``, else ``-2``, ``-3``, ...).
        ``rename``: the current name is known to be taken; start with the next one."""
        interval, first_wait = _timings()
        if rename:
            await self._count_conflict()
            self.number += 1
        self._conflict = asyncio.Event()
        self._probing = True
        try:
            while True:
                self._conflict.clear()
                if not self._taken_in_cache():
                    await asyncio.sleep(random.uniform(0, first_wait))
                    for _ in range(PROBES):
                        if self._conflict.is_set():
                            break
                        self.zc.async_send(self._probe_packet())
                        with contextlib.suppress(asyncio.TimeoutError):
                            await asyncio.wait_for(self._conflict.wait(), interval)
                    if not self._conflict.is_set():
                        return self.name
                log.info("host name %s is in use by another host: trying the next one", self.name)
                await self._count_conflict()
                self.number += 1
        finally:
            self._probing = False

    async def _count_conflict(self) -> None:
        self.conflicts += 1
        now = time.monotonic()
        self._recent.append(now)
        if len(self._recent) == CONFLICTS_BEFORE_PAUSE and now - self._recent[0] < CONFLICT_WINDOW:
            # §8.1: fifteen conflicts within ten seconds
            await asyncio.sleep(CONFLICT_PAUSE)

    def _probe_packet(self) -> DNSOutgoing:
        out = DNSOutgoing(_FLAGS_QR_QUERY | _FLAGS_AA)
        out.add_question(DNSQuestion(self.name, _TYPE_ANY, _CLASS_IN | _CLASS_UNIQUE))  # QU, RFC 6762 §8.1
        # python-zeroconf answers no ANY question about a host name, only A/AAAA ones: ask for A too,
        # or other gpusd daemons (and anything else built on it) would never answer our probes
        out.add_question(DNSQuestion(self.name, _TYPE_A, _CLASS_IN | _CLASS_UNIQUE))
        for address in self.addresses:
            # the records we intend to own, without cache-flush bit (RFC 6762 §10.2); appended to the
            # public list, as python-zeroconf's add_authorative_answer takes PTR records only
            record = DNSAddress(self.name, _TYPE_A, _CLASS_IN, 120, socket.inet_aton(address))
            out.authorities.append(record)  # type: ignore[arg-type]
        return out

    def _foreign(self, record: DNSRecord) -> bool:
        """An address record for our current name that is not ours (and not a goodbye)."""
        return (isinstance(record, DNSAddress) and record.type in (_TYPE_A, _TYPE_AAAA)
                and record.name.lower() == self.name.lower() and record.ttl > 0
                and record.address not in self._own)

    def _taken_in_cache(self) -> bool:
        now = current_time_millis()
        return any(self._foreign(r) and not r.is_expired(now)
                   for type_ in (_TYPE_A, _TYPE_AAAA)
                   for r in self.zc.cache.get_all_by_details(self.name, type_, _CLASS_IN))

    # -- watching (RecordUpdateListener) --------------------------------------------------------
    def async_update_records(self, zc: Zeroconf, now: float, records: list[RecordUpdate]) -> None:
        if self._closed or not any(self._foreign(update.new) for update in records):
            return
        if self._probing:
            if self._conflict is not None:
                self._conflict.set()
            return
        if self._reported == self.name:
            # reported already: a flood of such records costs one rename, not one per packet
            return
        self._reported = self.name
        log.warning("another host announces an address for our host name %s: moving to a new name", self.name)
        if self.on_conflict is not None:
            self.on_conflict(self.name)

    def goodbye(self, name: str) -> None:
        """Withdraw our addresses under a name we no longer use (TTL 0 for our address records
        only, without cache-flush bit: the other host's records under that name stay)."""
        out = DNSOutgoing(0x8000 | _FLAGS_AA)
        for address in self.addresses:
            out.add_answer_at_time(DNSAddress(name, _TYPE_A, _CLASS_IN, 0, socket.inet_aton(address)), 0)
        self.zc.async_send(out)
