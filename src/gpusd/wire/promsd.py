"""Prometheus service-discovery target groups of gpusd daemons: one definition for ``gpusd export
prometheus-sd`` (file_sd, :mod:`gpusd.views.sd`) and every daemon's ``GET /api/v1/prometheus/http_sd``
(docs/wire-format.md, "Prometheus HTTP service discovery").  Both are the same JSON document::

    [{"targets": ["198.18.0.1:4780"], "labels": {"__meta_gpusd_hostname": "node-a", ...}}]

The fleet's facts are ``__meta_gpusd_*`` labels: Prometheus offers them to ``relabel_configs`` and drops
them afterwards, so a fact that changes (``__meta_gpusd_verified``, ``__meta_gpusd_via``) never changes a
series' identity; docs/monitoring.md has the relabel config that keeps the stable ones.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:  # pragma: no cover
    from .fleet import FleetView, HostRecord



# the prefix of every discovery label
META = "__meta_gpusd_"


@dataclass(frozen=True)
class ScrapeTarget:
    """A daemon to scrape: its HTTP base URL (``http://198.18.0.1:4780``) and who it is."""

    url: str
    hostname: str
    node_id: str
    session: str | None = None
    # extra labels (__meta_gpusd_verified, _via)
    labels: tuple[tuple[str, str], ...] = field(default=())

    @property
    def address(self) -> str:
        """``host:port`` as Prometheus wants it (IPv6 in brackets)."""
        parts = urlsplit(self.url)
        if not parts.hostname:
            raise ValueError(f"not an http URL: {self.url!r}")
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return f"{host}:{port}"


Daemon = ScrapeTarget  # its older name


def daemons_from_hosts(hosts: Iterable[HostRecord], session: str | None = None) -> list[ScrapeTarget]:
    """The daemons to scrape among ``hosts`` (the :class:`gpusd.wire.fleet.HostRecord` s of a fleet view,
    or a client's, :class:`gpusd.discovery.types.RemoteHost` being one): the one definition behind both
    ``GET /api/v1/prometheus/http_sd`` and ``gpusd export prometheus-sd``.  Live hosts with an API URL
    Prometheus can scrape, of ``session`` when one is given; hosts that failed to prove they hold the
    fleet secret are left out; each carries its own session, ``__meta_gpusd_verified`` (true, or unknown
    without a secret to check) and ``__meta_gpusd_via`` (mdns, peer, dns-sd)."""
    out = []
    for h in hosts:
        if not h.url or not h.alive or h.verified is False:
            continue
        if session is not None and h.session is not None and h.session != session:
            continue
        d = _scrapeable(h, session, str(h.via or "mdns"))
        if d is not None:
            out.append(d)
    return out


def daemons_from_view(view: "FleetView", session: str | None = None, *, labels: bool = False,
                      unverified: bool = True) -> list[ScrapeTarget]:
    """The live daemons of a fleet view (hosts without a URL, not alive, or with a URL Prometheus
    cannot scrape are left out).  ``unverified=False`` also leaves out hosts that failed to prove
    they hold the fleet secret; ``labels`` adds ``__meta_gpusd_verified`` (true, false, unknown) and
    ``__meta_gpusd_via`` (mdns, peer, dns-sd).  Each daemon carries its own session (``session``: for hosts
    that name none)."""
    out = []
    for h in view.hosts:
        if not h.url or not h.alive or (h.verified is False and not unverified):
            continue
        d = _scrapeable(h, session, h.via if labels else None)
        if d is not None:
            out.append(d)
    return out


def _scrapeable(h: Any, session: str | None, via: str | None) -> ScrapeTarget | None:
    """The daemon of host ``h`` (its own session, else ``session``), labelled with
    ``__meta_gpusd_verified`` and ``__meta_gpusd_via`` when ``via`` is given; None when its URL is not
    one Prometheus can scrape (from the network: anything)."""
    extra: tuple[tuple[str, str], ...] = ()
    if via is not None:
        verified = "unknown" if h.verified is None else str(h.verified).lower()
        extra = ((META + "verified", verified), (META + "via", via))
    d = ScrapeTarget(url=h.url, hostname=h.hostname, node_id=h.node_id, session=h.session or session, labels=extra)
    try:
        d.address  # noqa: B018 - raises ValueError for a URL Prometheus cannot scrape
    except ValueError:
        return None
    return d


def file_sd(daemons: Iterable[ScrapeTarget]) -> list[dict[str, Any]]:
    """The file_sd JSON document: one target group per daemon, sorted by host name, with labels
    ``__meta_gpusd_hostname``, ``__meta_gpusd_node_id`` (and ``__meta_gpusd_session``, ``__scheme__``,
    ``__metrics_path__`` where they are not the defaults)."""
    groups = []
    seen = set()
    for d in sorted(daemons, key=lambda d: (d.hostname, d.node_id, d.url)):
        address = d.address
        if address in seen:
            continue
        seen.add(address)
        labels = {META + "hostname": d.hostname, META + "node_id": d.node_id}
        if d.session:
            labels[META + "session"] = d.session
        labels.update(d.labels)
        parts = urlsplit(d.url)
        if parts.scheme == "https":
            labels["__scheme__"] = "https"
        path = parts.path.rstrip("/")
        # the API's root, not the API
        prefix = path.removesuffix("/api/v1")
        if prefix:
            labels["__metrics_path__"] = prefix + "/metrics"
        groups.append({"targets": [address], "labels": labels})
    return groups


__all__ = ["META", "ScrapeTarget", "daemons_from_hosts", "daemons_from_view", "file_sd"]
