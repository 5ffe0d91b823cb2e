"""Finding gpusd daemons (and GPU-SD/hwsd daemons) on the LAN.

* :mod:`.client` — :class:`AsyncClient`: browse with python-zeroconf, follow each host's event stream,
  emit ``host_added``/``device_updated``/... events.
* :mod:`.sync` — :class:`Client`: the same, driven from a background thread for synchronous code.

Nothing heavy is imported here: ``import gpusd.wire.txt`` stays cheap.
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
