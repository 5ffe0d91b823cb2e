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
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import SourceError
from ..wire.fleet import FleetView
from ..wire.promsd import Daemon, daemons_from_view, file_sd

if TYPE_CHECKING:  # pragma: no cover
    from ..wire.fleet import HostRecord


def fleet_hosts(fleet: dict[str, Any], trusted: bool | None = None) -> list[HostRecord]:
    """The hosts of a ``GET /api/v1/fleet`` answer (:class:`gpusd.wire.fleet.HostRecord`, malformed
    ones left out); ``trusted`` False (the daemon that answered did not prove it holds the fleet
    secret): none of them counts as verified."""

    try:
        view = FleetView.from_dict(fleet)
    except ValueError as exc:
        raise SourceError(f"bad fleet answer: {exc}") from None
    if trusted is False:
        for h in view.hosts:
            h.verified = False
    return list(view.hosts)


def daemons_from_fleet(fleet: dict[str, Any], session: str | None = None) -> list[Daemon]:
    """The live daemons of a ``GET /api/v1/fleet`` answer (:class:`gpusd.wire.fleet.FleetView`;
    hosts without a URL, not alive or malformed are left out)."""

    try:
        view = FleetView.from_dict(fleet)
    except ValueError as exc:
        raise SourceError(f"bad fleet answer: {exc}") from None
    return [Daemon(url=d.url, hostname=d.hostname, node_id=d.node_id, session=session)
            for d in daemons_from_view(view)]


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
