"""The host source protocol: where a discovery client finds the hosts it follows.

A source finds *service instances* and resolves each into a
:class:`~gpusd.discovery.types.RemoteHost` (what it says about the host: node id, name, session,
addresses, port, TLS).  The client makes a :class:`~gpusd.discovery.follower.Follower` per instance,
which follows the host's event stream and checks what its daemon proves -- the same way whichever
source found it.  Nothing a source says is believed: trust comes only from the signed stream.

The sources of gpusd (each its own module):

* :class:`~gpusd.discovery.mdns.MdnsSource` -- mDNS browsing of ``_gpusd._tcp`` (and hwsd's
  ``_gpu-sd._tcp``) on the link;
* :class:`~gpusd.discovery.peers.StaticPeers` -- ``--peer``, ``$GPUSD_PEERS``, ``--peers-file``;
* :class:`~gpusd.discovery.widearea.WideAreaDnsSd` -- ``_gpusd._tcp.<domain>`` in unicast DNS;
* :class:`~gpusd.discovery.fleetview.LocalFleetView` -- a local daemon's fleet view: hosts it follows
  itself, read in one request; it yields the same records (``RemoteHost`` and ``Device``) but is read
  once rather than followed (``gpusd list``), so it implements :class:`HostListing`.

``AsyncClient(sources=[...])`` takes more sources (a test's fake, a future inventory service): they
are followed and verified like the built-in ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:  # pragma: no cover
    from .follower import Follower, FollowingClient
    from .types import Device, RemoteHost


class HostSource(Protocol):
    """What finds hosts for a following client."""

    #: how a host it found was found (``RemoteHost.via``): "mdns", "peer", "dns-sd", ...
    via: str

    @property
    def browsed(self) -> bool:
        """Its first listing is complete (``wait_settled`` waits for it)."""

    async def open(self, client: FollowingClient) -> None:
        """Get ready (open sockets); called before the client listens.  May raise ConfigError."""

    def start(self, client: FollowingClient) -> None:
        """Start finding instances: ``client.add(name, self, ...)`` each (it follows them),
        ``client.drop(follower, reason)`` those gone.  Called on the loop, once listening."""

    async def resolve(self, follower: Follower) -> RemoteHost | None:
        """The host an instance names now (None: not now or not wanted; retried later).  Set it with
        ``follower.keep(host)``, which carries over what was reported and proved."""

    async def stop(self) -> None:
        """Stop finding (the client cancels the followers itself)."""


class Listing(NamedTuple):
    """What a one-shot read of the fleet gives (it was a bare tuple): every reported device and host,
    and how many hosts the host filter left out (for "none matched --host")."""

    devices: list[Device]
    hosts: list[RemoteHost]
    unmatched: int


class HostListing(Protocol):
    """A source read once: the hosts a local daemon's fleet view lists (``gpusd list``)."""

    via: str

    def read(self) -> Listing | None:
        """The hosts and devices, filtered; None: no usable answer (browse instead)."""


__all__ = ["HostListing", "HostSource", "Listing"]
