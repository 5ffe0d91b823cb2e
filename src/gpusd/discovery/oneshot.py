"""A one-shot browse (``gpusd list``): ask once, stop when the answers have settled.

A browser on port 5353 cannot tell when every host has answered: responders multicast their answers
20-120 ms after a query, and one that multicast the same record less than a second earlier (to
another querier, or in its own announcements) waits a second more (RFC 6762 §6, §14).  So
``gpusd list`` used to browse for a fixed 1.5 s.

Here the query goes out from an ephemeral port instead (a *one-shot* query, RFC 6762 §5.1, python-
zeroconf's ``unicast=True``): every responder answers it at once, by unicast, with no random delay and
no one-second limit, so all answers arrive within a few milliseconds of each other.  The browse has
settled when no new service came for ``QUIET`` s after the first ``SPREAD`` s of answers; each host
found is then read as before (its event stream's first snapshot).  The query is the browser's own
first one, sent at once (not after the random 20-120 ms of a continuous querier, RFC 6762 §5.2), and
asks for unicast answers (QU): responders drop a query identical to one they got in the last second
(another client's) unless it is QU.  There is no second query of our own: responders also multicast
their answers, and a second query right after the first would be answered by multicast a second
later (the one-second limit), possibly after a host that stopped meanwhile sent its goodbye, which
would bring it back to other browsers for a moment.

A network that drops unicast replies to an ephemeral port (a host firewall that only lets port 5353 in)
gets no answer at all: after ``NO_ANSWER`` s without one, the browse starts over as a multicast
browse with the old timing, so such a host pays ``NO_ANSWER`` s more than before, never a missing host.
(Except where hosts beyond the link -- ``--peer``, ``--dns-sd-domain`` -- answered: those are listed
without the multicast browse, which would cost 1.5 s more and browse the zone a second time.)
The one-shot socket asks for a receive buffer of ``RECEIVE_BUFFER``; where the kernel grants less and a
burst of answers overflowed it anyway (the kernel's count of datagrams dropped on the socket), the list
browses by multicast as well, as if nothing had answered: a dropped answer may have been a real host's.
What ``gpusd list`` may now miss: a responder that answers more than ``QUIET`` s after the others (a
host too loaded to answer for that long) or not at all to one-shot queries (RFC 6762 requires the
answer; python-zeroconf, Avahi and Bonjour give it).  ``gpusd watch`` and the daemons' fleet views
keep browsing on port 5353 (they need announcements and goodbyes): a host that answers late still
appears there.
"""

# Imports inside functions: optional or heavy packages.
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from ..wire import mdns
from ..wire.aio import load
from .source import Listing

if TYPE_CHECKING:  # pragma: no cover
    from zeroconf.asyncio import AsyncZeroconf

    from .client import AsyncClient

log = logging.getLogger(__name__)

# no new service for this long...
QUIET = 0.1
# ...and this long after the first answer: every responder has answered
SPREAD = 0.1
# no answer at all this long: browse by multicast instead
NO_ANSWER = 0.5
# Once the answers have settled, a service that has not answered this long after it was found (resolved,
# connected, its first snapshot read) is given up on, each on its own clock: the hosts that answered are
# listed, the others (tar pits: services that accept a connection and never answer, or whose responder
# takes seconds to resolve them) left out instead of holding the list until --browse runs out or delaying the
# rest.  A gpusd daemon on the link answers in milliseconds; one that takes longer than this is left out of
# the one-shot list (`gpusd watch` and the daemons' fleet views still follow it).  A host beyond the link
# (--peer, --dns-sd-domain) gets three times as long (TCP, TLS and HTTP round trips over a WAN).  Time
# this process could not run (a loaded machine) does not count (AsyncClient.wait_settled, STALL).
GIVE_UP = 0.5
# The one-shot sockets' receive buffer: every responder answers at once, a responder with hundreds of
# services (a flood of fake ones) in hundreds of datagrams, while this process is still importing; with
# Linux's default 208 KiB the burst overflowed it and real hosts' answers were dropped with the flood's
# (bench_oneshot_flood: ~540 datagrams dropped per list beside 500 fake services, and now and then a list
# missing real hosts).  The kernel grants at most net.core.rmem_max.
RECEIVE_BUFFER = 4 << 20


async def open_oneshot_zeroconf(interfaces: list[str] | None) -> AsyncZeroconf:
    """An ``AsyncZeroconf`` whose sockets use an ephemeral port (queries are one-shot queries; it
    neither answers nor hears multicast), on ``interfaces`` (None: all)."""
    from zeroconf import InterfaceChoice, IPVersion
    from zeroconf.asyncio import AsyncZeroconf

    mdns.apply_test_timings()
    try:
        aiozc = AsyncZeroconf(interfaces=list(interfaces) if interfaces else InterfaceChoice.All,
                              ip_version=IPVersion.V4Only, unicast=True)
    except OSError as exc:
        raise ConfigError(f"cannot open the mDNS sockets on {interfaces or 'all interfaces'}: {exc}") from None
    await aiozc.zeroconf.async_wait_for_start()
    granted = mdns.widen_receive_buffer(aiozc, RECEIVE_BUFFER)
    # (Linux reports twice what it grants: its own bookkeeping included)
    if granted < 2 * RECEIVE_BUFFER:
        log.info("the one-shot query's receive buffer is %d bytes, not %d (net.core.rmem_max): a burst of "
                 "answers may overflow it (then gpusd list browses by multicast as well)", granted, RECEIVE_BUFFER)
    return aiozc


def prefetch_imports() -> None:
    """Import python-zeroconf and aiohttp in a thread (their imports take most of a cold ``gpusd list``
    process's time): the process's other start-up work, and the first query's round trip, overlap
    with them.  A later ``import`` of either waits for the thread (Python's import lock)."""
    def run() -> None:
        try:
            import zeroconf.asyncio  # noqa: F401

            # aiohttp, without the CA store in a gpusd process (gpusd.wire.aio)
            load()
        except ImportError:  # pragma: no cover - dependencies of gpusd
            return

    threading.Thread(target=run, name="gpusd-prefetch", daemon=True).start()


# RFC 1035 record type PTR and class IN, with RFC 6762 §5.4's unicast-response (QU) bit
_PTR, _CLASS_IN_QU = 12, 0x8001


def ask_now(zeroconf: Any, types: Sequence[str]) -> None:
    """Send a one-shot query (RFC 6762 §5.1) for ``types`` at once, through python-zeroconf's public
    API (``DNSOutgoing``, ``DNSQuestion``, ``Zeroconf.async_send``).  A browser delays its first query
    by 20-120 ms, as §5.2 asks of a *continuous* querier so that many starting together do not query
    in step; a one-shot query, made when a user asks, has no such rule.  The answers (unicast, QU, to
    this zeroconf's own port) reach the browser through the cache like any other.  Call it on the
    event loop, after the browser started."""
    # Top-level names of the package (not in its __all__, hence the ignores), stable since 0.2x; no
    # private module of zeroconf and no private constant is touched.
    from zeroconf import DNSOutgoing, DNSQuestion  # type: ignore[attr-defined]

    # flags 0: a standard query
    out = DNSOutgoing(0)
    for t in types:
        out.add_question(DNSQuestion(t, _PTR, _CLASS_IN_QU))
    zeroconf.async_send(out)


async def browse_settled(make_client: Callable[..., AsyncClient], interfaces: Sequence[str] | None,
                         timeout: float) -> Listing:
    """Every reported device and host, and how many hosts the host filter left out, once the browse
    has settled (at most ``timeout`` s waiting for hosts found to answer).  ``make_client(**kw)``
    builds the :class:`AsyncClient` (filters, fleet key), ``zeroconf=`` given for the one-shot browse."""

    zc = await open_oneshot_zeroconf(mdns.resolve_interfaces(list(interfaces) if interfaces is not None else None))
    client = make_client(zeroconf=zc)
    try:
        await client.start_listening()
        ask_now(zc.zeroconf, client.service_types)
        await client.wait_settled(timeout, minimum=NO_ANSWER, early=(QUIET, SPREAD), give_up=GIVE_UP)
        lost = mdns.dropped(zc)
        # hosts beyond the link (peers, wide-area DNS-SD) answered: no multicast browse for the rest
        # (it would start a second client, browse the zone again and cost 1.5 s more)
        if (client.answered or client.hosts) and not lost:
            return Listing(client.list_devices(), client.hosts, len(client.unmatched_hosts))
        # answers were lost (a burst larger than the buffer): any host may be among them
        if lost:
            log.info("%d answers to the one-shot query were dropped (receive buffer full): browsing by "
                     "multicast", lost)
    finally:
        await client.stop_listening()
        await _close(zc)
    log.debug("no answer to the one-shot query in %.1f s: browsing by multicast", NO_ANSWER)
    client = make_client()
    try:
        await client.wait_settled(timeout, give_up=GIVE_UP)
        return Listing(client.list_devices(), client.hosts, len(client.unmatched_hosts))
    finally:
        await client.stop_listening()


async def _close(zc: Any) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(zc.async_close(), 5)
