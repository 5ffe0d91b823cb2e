"""mDNS conformance that python-zeroconf leaves to its users (docs/wire-format.md, "mDNS conformance").

* **Legacy unicast responses** (RFC 6762 §6.7): a query from a port other than 5353 comes from a
  simple resolver (``dig -p 5353 @host``), which caches what it gets like unicast DNS. python-zeroconf
  answers it with the records' full TTLs (120 s for A/SRV, 4500 s for PTR/TXT); the RFC says at most
  ten seconds. :class:`ConformingZeroconf` caps them. python-zeroconf sends every unicast answer
  through ``Zeroconf.async_send(out, addr, port)`` (its public send method) with the querier's port,
  so the subclass rewrites exactly the answers going to a port other than 5353. Its question echo,
  query id and cleared cache-flush bits are python-zeroconf's own. NSEC records are left out of
  these answers: mDNS compresses their next-name field (RFC 6762 §18.14), which unicast DNS forbids
  (RFC 4034 §4.1.1), and resolvers such as dnspython then reject the whole answer. tests/test_responder.py checks
  this against the installed python-zeroconf, and fails if a new version answers some other way.

This module imports zeroconf at once: import it lazily (``open_zeroconf`` does).
"""

from __future__ import annotations

import logging

# Exported by zeroconf's __init__ (and documented), though left out of its __all__.
from zeroconf import (  # type: ignore[attr-defined]
    DNSAddress,
    DNSHinfo,
    DNSNsec,
    DNSOutgoing,
    DNSPointer,
    DNSRecord,
    DNSService,
    DNSText,
    Zeroconf,
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
    name, type_, class_ = record.name, record.type, record.class_  # class_ without the cache-flush bit
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
            new.add_authorative_answer(short)  # type: ignore[arg-type]
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


class ConformingZeroconf(Zeroconf):
    """python-zeroconf's ``Zeroconf`` whose answers to legacy unicast queries carry TTLs of at most
    ten seconds (RFC 6762 §6.7)."""

    def async_send(self, out: DNSOutgoing, addr: str | None = None, port: int = MDNS_PORT,
                   v6_flow_scope: tuple[()] | tuple[int, int] = (), transport: object = None) -> None:
        if is_legacy_unicast_answer(out, addr, port):
            out = legacy_unicast_response(out)
        super().async_send(out, addr, port, v6_flow_scope, transport)  # type: ignore[arg-type]
