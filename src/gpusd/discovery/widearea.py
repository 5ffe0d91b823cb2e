"""The wide-area DNS-SD host source (RFC 6763 §11): ``_gpusd._tcp.<domain>`` in unicast DNS.

The zone is browsed now and again (:func:`gpusd.discovery.beyond.browse_dns_sd`: every
``DNS_SD_INTERVAL`` s, sooner when a record's TTL is shorter, never more often than
``DNS_SD_MIN_INTERVAL`` s).  A host leaves when the zone no longer lists it; a server that does not
answer drops nothing.  An instance whose node, port or addresses change is followed anew.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from . import beyond
from .types import RemoteHost

if TYPE_CHECKING:  # pragma: no cover
    from .follower import Follower, FollowingClient

# the client's log, as before the split
log = logging.getLogger("gpusd.discovery.client")


class WideAreaDnsSd:
    """Hosts a DNS zone lists (``via`` "dns-sd")."""

    via = "dns-sd"

    def __init__(self, domain: str, server: str | None = None) -> None:
        self.domain = domain
        self.server = server
        # the first browse is done (wait_settled waits for it)
        self.browsed = False

    async def open(self, client: FollowingClient) -> None:
        pass

    def start(self, client: FollowingClient) -> None:
        client.spawn(self._browse(client))

    async def stop(self) -> None:
        pass

    async def _browse(self, client: FollowingClient) -> None:
        logged: set[str] = set()
        while client.listening:
            try:
                browse = await beyond.browse_dns_sd(self.domain, self.server)
            except Exception:
                # never let a resolver's bug stop discovery
                log.exception("wide-area DNS-SD browse of %s failed", self.domain)
                browse = beyond.Browse([], beyond.DNS_SD_INTERVAL, [], set(), complete=False)
            for problem in browse.problems:
                log.log(logging.DEBUG if problem in logged else logging.WARNING, "DNS-SD: %s", problem)
                logged.add(problem)
            # a host leaves when the zone no longer lists it; a server that does not answer drops nothing
            names = {inst.name for inst in browse.found} | browse.unknown
            gone = [p for p in client.followers() if p.source is self and p.name not in names]
            for peer in gone if browse.complete else []:
                client.drop(peer, "removed from DNS-SD")
            for inst in browse.found:
                known = client.follower(inst.name)
                if known is None:
                    client.add(inst.name, self, spec=inst)
                    continue
                old, known.spec = known.spec, inst
                if (old.txt.node_id, old.port, old.addresses) != (inst.txt.node_id, inst.port, inst.addresses):
                    known.restart()
                elif known.host is not None:
                    known.host.txt = inst.txt
            self.browsed = True
            await asyncio.sleep(browse.ttl)

    async def resolve(self, peer: Follower) -> RemoteHost | None:
        inst = peer.spec
        txt, addresses, port = inst.txt, list(inst.addresses), inst.port
        if not peer.client.filters.host_ok(txt):
            log.debug("ignoring %s: session %r / host %r filtered out", peer.name, txt.session, txt.hostname)
            return None
        return peer.keep(RemoteHost(key=peer.name, txt=txt, addresses=addresses, port=port, via=self.via))


__all__ = ["WideAreaDnsSd"]
