"""Where ``gpusd top`` and ``gpusd export prometheus-sd`` get their hosts from.

* :class:`LocalSource` — this machine's GPUs (NVML or a simulation), no daemon, no network.
* :class:`FleetSource` — one daemon's ``GET /api/v1/fleet`` (every host it discovered).
* :class:`DiscoverySource` — the LAN, browsed with the discovery client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

from ..errors import GpusdError
from ..wire.http import MAX_ANSWER as MAX_ANSWER  # re-exported
from ..wire.http import SourceError as SourceError
from ..wire.http import fetch_json
from .top import HostView

if TYPE_CHECKING:  # pragma: no cover
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

        snap = LeaseStore().attach(self._backend.snapshot())
        return [HostView(snap.hostname, snap.node_id, snap)]

    def close(self) -> None:
        self._backend.close()


def strip_api(path: str) -> str:
    """``/api/v1`` or ``/prefix/api/v1/`` -> ``""`` or ``/prefix``: the daemon's root path."""
    path = path.rstrip("/")
    return path.removesuffix("/api/v1")


def base_url(url: str) -> str:
    """``host:4780``, ``http://host:4780/`` or ``http://host:4780/api/v1`` -> ``http://host:4780``."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise GpusdError(f"not a daemon URL: {url!r} (example: http://gpu-node-1:4780)")
    return f"{parts.scheme}://{parts.netloc}{strip_api(parts.path)}"


def get_json(url: str, key: "FleetKey | None" = None, timeout: float = 5.0) -> Any:
    """GET a JSON document (at most 4 MiB), signed when there is a fleet key (see
    :func:`gpusd.wire.http.fetch_json`, which also says whether the daemon proved itself)."""
    return fetch_json(url, key, timeout).data


def hosts_from_fleet(data: Any, trusted: bool | None = None) -> list[HostView]:
    """HostViews from a ``GET /api/v1/fleet`` answer (:class:`gpusd.wire.fleet.FleetView`); malformed
    hosts are skipped.  ``trusted``: whether the daemon that answered proved it holds the fleet secret
    (False: no host is verified)."""
    from ..wire.fleet import FleetView

    try:
        view = FleetView.from_dict(data)
    except ValueError as exc:
        raise SourceError(f"bad fleet answer: {exc}") from None
    return [HostView(h.hostname, h.node_id, h.snapshot, alive=h.alive, url=h.url,
                     verified=False if trusted is False else h.verified) for h in view.hosts]


class FleetSource:
    """The hosts one daemon knows (``gpusd top --url http://gpu-node-1:4780``)."""

    def __init__(self, url: str, key: "FleetKey | None" = None, timeout: float = 5.0) -> None:
        self.url = base_url(url)
        self.key = key
        self.timeout = timeout
        self.verified: bool | None = None  # whether the daemon proved itself on the last answer
        self._tls: tuple[str, str | None] | None = None  # (URL, pinned fingerprint) once looked up

    def fleet(self) -> dict[str, Any]:
        from ..wire.fleet import MAX_FLEET_BYTES

        url, pin = self._secure_url()
        answer = fetch_json(f"{url}/api/v1/fleet", self.key, self.timeout, pin=pin, max_bytes=MAX_FLEET_BYTES)
        if not isinstance(answer.data, dict):
            raise SourceError(f"{self.url}/api/v1/fleet: expected an object")
        self.verified = answer.verified
        return answer.data

    def _secure_url(self) -> tuple[str, str | None]:
        """With the fleet secret and a plain ``http://`` URL: the daemon's HTTPS URL and certificate
        fingerprint as its ``/healthz`` says (private fields travel over TLS only; the fingerprint is
        checked against the daemon's signed proof, so a forged /healthz gains nothing)."""
        if self.key is None or not self.url.startswith("http://"):
            return self.url, None
        if self._tls is None:
            self._tls = (self.url, None)
            try:
                health = fetch_json(f"{self.url}/healthz", None, self.timeout).data
            except SourceError:
                return self.url, None
            port, fp = (health.get("tls_port"), health.get("cert_fp")) if isinstance(health, dict) else (None, None)
            if isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536 and isinstance(fp, str):
                from urllib.parse import urlsplit

                parts = urlsplit(self.url)
                host = f"[{parts.hostname}]" if parts.hostname and ":" in parts.hostname else parts.hostname
                self._tls = (f"https://{host}:{port}{parts.path}", fp)
        return self._tls

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
        return [HostView(h.hostname, h.node_id, h.snapshot, alive=h.alive, url=h.url, verified=h.verified)
                for h in self.remote_hosts()]

    def remote_hosts(self) -> list[Any]:
        """The client's hosts as discovery sees them (session, how each was found, verified)."""
        if not self._settled:
            self._client.wait_settled(self._settle)
            self._settled = True
        return list(self._client.hosts)

    def close(self) -> None:
        self._client.stop_listening()
