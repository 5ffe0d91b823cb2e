"""Finding gpusd daemons (and GPU-SD/hwsd daemons) on the LAN and beyond.

* :mod:`.types` — what discovery hands to applications: :class:`Device`, :class:`RemoteHost`,
  :class:`DiscoveryEvent`, the filters;
* :mod:`.client` — :class:`AsyncClient`: browse with python-zeroconf, follow each host's event stream,
  emit ``host_added``/``device_updated``/... events;
* :mod:`.sync` — :class:`Client`: the same, driven from a background thread for synchronous code;
* :mod:`.oneshot` — one browse that stops when the answers have settled (``gpusd list``);
* :mod:`.beyond` — hosts beyond the link: static peers, wide-area DNS-SD, zone records.

``gpusd.Client``, ``gpusd.AsyncClient``, ``gpusd.Device`` and ``gpusd.DiscoveryEvent`` are the public
names (docs/api.md); the rest is internal.  Nothing heavy is imported here: ``import gpusd.wire.txt``
stays cheap.
"""

from __future__ import annotations

from typing import Any

__all__ = ["AsyncClient", "Client", "Device", "RemoteHost", "DiscoveryEvent", "EVENTS"]


def __getattr__(name: str) -> Any:
    if name == "AsyncClient":
        from .client import AsyncClient

        return AsyncClient
    if name == "Client":
        from .sync import Client

        return Client
    if name in ("Device", "RemoteHost", "DiscoveryEvent", "EVENTS"):
        from . import types

        return getattr(types, name)
    raise AttributeError(f"module 'gpusd.discovery' has no attribute {name!r}")
