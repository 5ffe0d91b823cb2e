"""Finding gpusd daemons (and GPU-SD/hwsd daemons) on the LAN and beyond.

* :mod:`.client` — :class:`AsyncClient`: follow every host its sources find, emit
  ``host_added``/``device_updated``/... events.
* :mod:`.sync` — :class:`Client`: the same, driven from a background thread for synchronous code.
* :mod:`.options` — :class:`DiscoveryOptions`: what both clients are asked, as one value.
* :mod:`.source` — the host source protocol; the sources: :mod:`.mdns` (browsing the link),
  :mod:`.peers` (static peers), :mod:`.widearea` (wide-area DNS-SD), :mod:`.fleetview` (a daemon's
  fleet view, read once); :mod:`.beyond` — the helpers of the two sources beyond the link.
* :mod:`.follower` — following one host: its event stream and what its daemon proves.
* :mod:`.bus` — the event bus; :mod:`.types` — hosts, devices, events, filters; :mod:`.oneshot` —
  the one-shot browse of ``gpusd list``; :mod:`.fleetsource` — where a one-shot reading comes from:
  this host's daemon's fleet view in time, else the browse.

``gpusd.Client``, ``gpusd.AsyncClient``, ``gpusd.Device`` and ``gpusd.DiscoveryEvent`` are the public
names (docs/api.md); the rest is internal.  Nothing heavy is imported here: ``import gpusd.wire.txt``
stays cheap.
"""

# Imports inside functions: start-up (gpusd list imports this module).
from __future__ import annotations

from typing import Any

from . import types

__all__ = ["AsyncClient", "Client", "Device", "DiscoveryOptions", "RemoteHost", "DiscoveryEvent", "EVENTS"]


def __getattr__(name: str) -> Any:
    if name == "AsyncClient":
        from .client import AsyncClient

        return AsyncClient
    if name == "Client":
        from .sync import Client

        return Client
    if name == "DiscoveryOptions":
        from .options import DiscoveryOptions

        return DiscoveryOptions
    if name in ("Device", "RemoteHost", "DiscoveryEvent", "EVENTS"):
        return getattr(types, name)
    raise AttributeError(f"module 'gpusd.discovery' has no attribute {name!r}")
