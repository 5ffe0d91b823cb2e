"""Where ``gpusd top`` and ``gpusd export prometheus-sd`` get their hosts from.

* :class:`LocalSource` — this machine's GPUs (NVML or a simulation), no daemon, no network.
* :class:`FleetSource` — one daemon's ``GET /api/v1/fleet`` (every host it discovered).
* :class:`DiscoverySource` — the LAN, browsed with the discovery client.
"""

from __future__ import annotations

import json
from typing import Any, Protocol
from urllib.parse import urlsplit

from ..errors import GpusdError
from ..errors import SourceError as SourceError  # re-exported: defined in gpusd.errors
from .top import HostView

MAX_ANSWER = 4 * 2**20  # bytes, as docs/wire-format.md says for HTTP answers


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


def get_json(url: str, token: str | None = None, timeout: float = 5.0) -> Any:
    """GET a JSON document (at most 4 MiB); :class:`SourceError` with a one-line reason otherwise."""
    import http.client
    import urllib.error
    import urllib.request

    headers = {"Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read(MAX_ANSWER + 1)
    except urllib.error.HTTPError as exc:
        raise SourceError(f"{url}: HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise SourceError(f"cannot reach {url}: {reason}") from None
    except http.client.HTTPException as exc:  # not HTTP (BadStatusLine), or the daemon died mid-answer
        raise SourceError(f"{url}: broken HTTP answer ({exc.__class__.__name__})") from None
    if len(body) > MAX_ANSWER:
        raise SourceError(f"{url}: answer larger than {MAX_ANSWER} bytes")
    try:
        return json.loads(body)
    except ValueError:
        raise SourceError(f"{url}: answer is not JSON") from None


def hosts_from_fleet(data: Any) -> list[HostView]:
    """HostViews from a ``GET /api/v1/fleet`` answer (:class:`gpusd.wire.fleet.FleetView`);
    malformed hosts are skipped."""
    from ..wire.fleet import FleetView

    try:
        view = FleetView.from_dict(data)
    except ValueError as exc:
        raise SourceError(f"bad fleet answer: {exc}") from None
    return [HostView(h.hostname, h.node_id, h.snapshot, alive=h.alive, url=h.url) for h in view.hosts]


class FleetSource:
    """The hosts one daemon knows (``gpusd top --url http://gpu-node-1:4780``)."""

    def __init__(self, url: str, token: str | None = None, timeout: float = 5.0) -> None:
        self.url = base_url(url)
        self.token = token
        self.timeout = timeout

    def fleet(self) -> dict[str, Any]:
        data = get_json(f"{self.url}/api/v1/fleet", self.token, self.timeout)
        if not isinstance(data, dict):
            raise SourceError(f"{self.url}/api/v1/fleet: expected an object")
        return data

    def hosts(self) -> list[HostView]:
        return hosts_from_fleet(self.fleet())

    def close(self) -> None:
        pass


class DiscoverySource:
    """Every gpusd host on the LAN, through :class:`gpusd.discovery.Client` (mDNS browsing and each
    host's event stream).  The first call waits up to ``settle`` seconds for the hosts to answer."""

    def __init__(self, session: str | None = "default", settle: float = 2.0,
                 interfaces: list[str] | None = None, token: str | None = None) -> None:
        from ..discovery import Client

        self._client = Client(session, interfaces=interfaces, all_sessions=session is None, daemon_thread=True,
                              token=token)
        self._settle = settle
        self._settled = False

    def hosts(self) -> list[HostView]:
        if not self._settled:
            self._client.wait_settled(self._settle)
            self._settled = True
        return [HostView(h.hostname, h.node_id, h.snapshot, alive=h.alive, url=h.url) for h in self._client.hosts]

    def close(self) -> None:
        self._client.stop_listening()
