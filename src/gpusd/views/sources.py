"""Where ``gpusd top`` and ``gpusd export prometheus-sd`` get their hosts from.

* :class:`LocalSource` — this machine's GPUs (NVML or a simulation), no daemon, no network.
* :class:`FleetSource` — one daemon's ``GET /api/v1/fleet`` (every host it discovered), read by
  :class:`gpusd.discovery.fleetview.FleetReader`.
* :class:`DiscoverySource` — the LAN, browsed with the discovery client.
"""

# Imports inside functions: optional or heavy packages; start-up (gpusd top imports this module).
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from ..errors import SourceError
from ..wire.fleet import FleetView
from ..wire.http import fetch_json
from .top import HostView

if TYPE_CHECKING:  # pragma: no cover
    from ..discovery.types import RemoteHost
    from ..wire.signing import FleetKey


class Source(Protocol):
    def hosts(self) -> list[HostView]: ...

    def close(self) -> None: ...


class LocalSource:
    """This machine, read directly (``gpusd top --local``)."""

    def __init__(self, simulate: str | None = None) -> None:
        from ..inventory import open_backend

        self._backend = open_backend(simulate)

    def hosts(self) -> list[HostView]:
        from ..alloc.leases import LeaseStore
        from ..jobs.containers import name_containers

        snap = LeaseStore().attach(self._backend.snapshot())
        name_containers(snap)
        return [HostView(snap.hostname, snap.node_id, snap)]

    def close(self) -> None:
        self._backend.close()


def get_json(url: str, key: "FleetKey | None" = None, timeout: float = 5.0) -> Any:
    """GET a JSON document (at most 4 MiB), signed when there is a fleet key (see
    :func:`gpusd.wire.http.fetch_json`, which also says whether the daemon proved itself)."""
    return fetch_json(url, key, timeout).data


def hosts_from_fleet(data: Any, trusted: bool | None = None) -> list[HostView]:
    """HostViews from a ``GET /api/v1/fleet`` answer (:class:`gpusd.wire.fleet.FleetView`); malformed
    hosts are skipped.  ``trusted``: whether the daemon that answered proved it holds the fleet secret
    (False: no host is verified)."""
    try:
        view = FleetView.from_dict(data)
    except ValueError as exc:
        raise SourceError(f"bad fleet answer: {exc}") from None
    return [HostView.of(h, verified=False if trusted is False else h.verified) for h in view.hosts]


class FleetSource:
    """The hosts one daemon knows (``gpusd top --url http://gpu-node-1:4780``), read by
    :class:`gpusd.discovery.fleetview.FleetReader`."""

    def __init__(self, url: str, key: "FleetKey | None" = None, timeout: float = 5.0) -> None:
        from ..discovery.fleetview import FleetReader

        self.reader = FleetReader(url, key, timeout)
        self.url = self.reader.url

    @property
    def verified(self) -> bool | None:
        """Whether the daemon proved itself on the last answer."""
        return self.reader.verified

    def fleet(self) -> dict[str, Any]:
        return self.reader.fetch()

    def _secure_url(self) -> tuple[str, str | None]:
        return self.reader.secure_url()

    def hosts(self) -> list[HostView]:
        data = self.fleet()
        return hosts_from_fleet(data, self.verified)

    def close(self) -> None:
        pass


class DiscoverySource:
    """Every gpusd host on the LAN, through :class:`gpusd.discovery.Client` (mDNS browsing and each
    host's event stream).  The first call waits up to ``settle`` seconds for the hosts to answer."""

    def __init__(self, session: str | None = "default", settle: float = 2.0,
                 interfaces: list[str] | None = None, key: "FleetKey | None" = None, **beyond: Any) -> None:
        from ..discovery import Client

        # beyond: peers, peers_file, dns_sd_domain, dns_server (hosts past the mDNS link)
        self._client = Client(session, interfaces=interfaces, all_sessions=session is None, daemon_thread=True,
                              key=key, **beyond)
        self._settle = settle
        self._settled = False

    def hosts(self) -> list[HostView]:
        if not self._settled:
            self._client.wait_settled(self._settle)
            self._settled = True
        return [HostView.of(h) for h in self.remote_hosts()]

    def remote_hosts(self) -> list[RemoteHost]:
        """The client's hosts as discovery sees them (session, how each was found, verified)."""
        if not self._settled:
            self._client.wait_settled(self._settle)
            self._settled = True
        return list(self._client.hosts)

    def close(self) -> None:
        self._client.stop_listening()
