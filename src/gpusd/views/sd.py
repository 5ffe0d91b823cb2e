"""Prometheus ``file_sd`` target lists of gpusd daemons.

Prometheus reads the file with a ``file_sd_configs`` scrape job and re-reads it when it changes, so
the file is written atomically (temporary file, then rename)::

    scrape_configs:
      - job_name: gpusd
        file_sd_configs:
          - files: [/etc/prometheus/gpusd.json]
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit


@dataclass(frozen=True)
class Daemon:
    """A daemon to scrape: its HTTP base URL (``http://198.18.0.1:4780``) and who it is."""

    url: str
    hostname: str
    node_id: str
    session: str | None = None

    @property
    def address(self) -> str:
        """``host:port`` as Prometheus wants it (IPv6 in brackets)."""
        parts = urlsplit(self.url)
        if not parts.hostname:
            raise ValueError(f"not an http URL: {self.url!r}")
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return f"{host}:{port}"


def daemons_from_fleet(fleet: dict[str, Any], session: str | None = None) -> list[Daemon]:
    """The live daemons of a ``GET /api/v1/fleet`` answer (:class:`gpusd.wire.fleet.FleetView`;
    hosts without a URL, not alive or malformed are left out)."""
    from ..wire.fleet import FleetView

    try:
        hosts = FleetView.from_dict(fleet).hosts
    except ValueError as exc:
        from .sources import SourceError

        raise SourceError(f"bad fleet answer: {exc}") from None
    out = []
    for h in hosts:
        if not h.url or not h.alive:
            continue
        d = Daemon(url=h.url, hostname=h.hostname, node_id=h.node_id, session=session)
        try:
            d.address  # noqa: B018 - a URL Prometheus cannot scrape (from the network: anything) is left out
        except ValueError:
            continue
        out.append(d)
    return out


def file_sd(daemons: Iterable[Daemon]) -> list[dict[str, Any]]:
    """The file_sd JSON document: one target group per daemon, sorted by host name, with labels
    ``gpusd_hostname``, ``gpusd_node_id`` (and ``gpusd_session``, ``__scheme__``, ``__metrics_path__``
    where they are not the defaults)."""
    groups = []
    seen = set()
    for d in sorted(daemons, key=lambda d: (d.hostname, d.node_id, d.url)):
        address = d.address
        if address in seen:
            continue
        seen.add(address)
        labels = {"gpusd_hostname": d.hostname, "gpusd_node_id": d.node_id}
        if d.session:
            labels["gpusd_session"] = d.session
        parts = urlsplit(d.url)
        if parts.scheme == "https":
            labels["__scheme__"] = "https"
        path = parts.path.rstrip("/")
        prefix = path.removesuffix("/api/v1")  # the API's root, not the API
        if prefix:
            labels["__metrics_path__"] = prefix + "/metrics"
        groups.append({"targets": [address], "labels": labels})
    return groups


def dumps(daemons: Iterable[Daemon]) -> str:
    return json.dumps(file_sd(daemons), indent=2) + "\n"


def write(path: str | Path, daemons: Iterable[Daemon]) -> bool:
    """Write the target list to ``path`` atomically; return False when the file already had exactly
    this content (Prometheus then has nothing to re-read)."""
    path = Path(path)
    text = dumps(daemons)
    try:
        if path.read_text() == text:
            return False
    except OSError:
        pass
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return True
