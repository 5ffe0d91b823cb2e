"""The gpusd daemon: samples the local GPUs, serves them over HTTP, announces the host with mDNS.

* :mod:`.config` — :class:`DaemonConfig`, every knob in one place.
* :mod:`.service` — :class:`Daemon`: the sampling loop, history, event publishing.
* :mod:`.http` — the aiohttp application (``build_app``) and server-sent event streams.
* :mod:`.announce` — the DNS-SD announcement (rate-limited TXT updates, interface changes).
* :mod:`.fleet` — the fleet view (an :class:`~gpusd.discovery.client.AsyncClient` in the daemon).
* :mod:`.monitoring` — metrics, dashboard, alerts and threshold evaluation wired into the app.
* :mod:`.access` — who may read private fields and write (the access middleware).
* :mod:`.metrics` — Prometheus text format of the daemon's snapshot.
* :mod:`.process` — pid file, background start, stop, status, systemd notification.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Daemon", "DaemonConfig"]


def __getattr__(name: str) -> Any:
    if name == "Daemon":
        from .service import Daemon

        return Daemon
    if name == "DaemonConfig":
        from .config import DaemonConfig

        return DaemonConfig
    raise AttributeError(f"module 'gpusd.daemon' has no attribute {name!r}")
