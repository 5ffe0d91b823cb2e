"""The static-peer host source: ``--peer host[:port]``, ``$GPUSD_PEERS`` and ``--peers-file``.

What an announcement would say is read from each daemon's public ``/healthz`` and ``/api/v1/host``
(:func:`gpusd.discovery.beyond.peer_txt`, the same validated TXT codec); trust comes only from the
signed event stream, as for mDNS.  The peers file is re-read when it changes (checked every
``beyond.PEERS_FILE_CHECK`` s); a file that turns bad keeps the peers it listed before.
"""

# Imports inside functions: optional or heavy packages.
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Sequence

from ..errors import ConfigError
from . import beyond
from .types import RemoteHost

if TYPE_CHECKING:  # pragma: no cover
    from .follower import Follower, FollowingClient

# the client's log, as before the split
log = logging.getLogger("gpusd.discovery.client")


class StaticPeers:
    """Hosts the user named (``via`` "peer")."""

    via = "peer"
    browsed = True  # known at once

    def __init__(self, specs: Sequence[beyond.PeerSpec] = (), peers_file: str | None = None) -> None:
        self.specs = list(specs)
        self.peers_file = peers_file

    async def open(self, client: FollowingClient) -> None:
        pass

    def start(self, client: FollowingClient) -> None:
        for spec in self.specs:
            self._add(client, spec)
        if self.peers_file is not None:
            client.spawn(self._watch_peers_file(client, self.peers_file))

    async def stop(self) -> None:
        pass

    def _add(self, client: FollowingClient, spec: beyond.PeerSpec, from_file: bool = False) -> None:
        name = f"peer:{spec}"
        if client.follower(name) is None:
            client.add(name, self, spec=spec, from_file=from_file, capped=False)

    async def _watch_peers_file(self, client: FollowingClient, path: str) -> None:
        """Follow the peers in ``path``; re-read it when it changes (checked every few seconds).  A
        file that turns bad keeps the peers it had (the error is logged)."""
        stamp: object = ()
        while client.listening:
            now = beyond.file_stamp(path)
            if now != stamp:
                stamp = now
                try:
                    specs = beyond.parse_peers(beyond.read_peers_file(path))
                except ConfigError as exc:
                    log.warning("peers file: %s (keeping the peers it listed before)", exc)
                else:
                    names = {f"peer:{spec}" for spec in specs}
                    for peer in [p for p in client.followers() if p.from_file and p.name not in names]:
                        client.drop(peer, "no longer in the peers file")
                    for spec in specs:
                        self._add(client, spec, from_file=True)
            await asyncio.sleep(beyond.PEERS_FILE_CHECK)

    async def resolve(self, peer: Follower) -> RemoteHost | None:
        """A static peer's host record, from its daemon's public HTTP API (None: not now; retried)."""
        import aiohttp

        http = peer.client.http
        assert http is not None
        spec = peer.spec
        try:
            addresses = await beyond.addresses_of(spec.host)
        except (OSError, asyncio.TimeoutError) as exc:
            peer.problem(f"cannot resolve {spec.host}: {exc}")
            return None
        txt, port = None, spec.port
        for address in addresses:
            try:
                txt = await beyond.peer_txt(http, address, port)
                addresses = [address]
                break
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
                peer.problem(f"no gpusd daemon at {address}:{port} ({str(exc)[:200] or type(exc).__name__})")
        if txt is None:
            return None
        if not peer.client.filters.host_ok(txt):
            log.debug("ignoring %s: session %r / host %r filtered out", peer.name, txt.session, txt.hostname)
            return None
        return peer.keep(RemoteHost(key=peer.name, txt=txt, addresses=addresses, port=port, via=self.via))


__all__ = ["StaticPeers"]
