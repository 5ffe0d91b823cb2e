"""gpusd: GPU service discovery and allocation.

Everything is imported lazily so that ``import gpusd`` (and the ``gpusd`` CLI) start fast::

    import gpusd
    with gpusd.select(count=2, min_free="20GiB") as sel:   # least-loaded GPUs, leased
        sel.apply()                                          # CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER
    gpusd.set_cuda_visible_devices([1, 3])
    snap = gpusd.local_snapshot()                            # this host's GPUs
    client = gpusd.Client()                                  # every GPU on the LAN
    with gpusd.reserve(count=2) as r: ...                    # GPUs on any host of the fleet

The public API is the names of ``__all__`` (docs/api.md, "Public API"; ``tests/core/test_public_api.py``
pins them and the signatures of the entry points).  Every other module is internal: importable, but
without a promise between releases.
"""

from __future__ import annotations

from importlib import import_module

from ._version import __version__

# typing is not imported at run time: start-up time
TYPE_CHECKING = False

# The public names, each resolved on first use from the module that defines it.
_LAZY = {
    # local GPUs: choose, lease, set the visibility variables, read
    "select": "gpusd.alloc.api",
    "Selection": "gpusd.alloc.api",
    "Constraints": "gpusd.alloc.select",
    "set_cuda_visible_devices": "gpusd.alloc.env",
    "CudaAlreadyInitializedWarning": "gpusd.alloc.env",
    "local_snapshot": "gpusd._local",
    # the fleet: discovery clients and what they return, the pool's reservations
    "Client": "gpusd.discovery.sync",
    "AsyncClient": "gpusd.discovery.client",
    "Device": "gpusd.discovery.types",
    "DiscoveryEvent": "gpusd.discovery.types",
    "RemoteHost": "gpusd.discovery.types",
    "DiscoveryOptions": "gpusd.discovery.options",
    "reserve": "gpusd.pool.client",
    "Reservation": "gpusd.pool.client",
    # the data model
    "HostSnapshot": "gpusd.model",
    "GpuInfo": "gpusd.model",
    "GpuLink": "gpusd.model",
    "MigInstance": "gpusd.model",
    "ProcessInfo": "gpusd.model",
    "LeaseInfo": "gpusd.model",
    # the one exception tree
    "GpusdError": "gpusd.errors",
    "ConfigError": "gpusd.errors",
    "BackendUnavailable": "gpusd.errors",
    "NoGpuAvailable": "gpusd.errors",
    "WaitTimeout": "gpusd.errors",
    "IdError": "gpusd.errors",
    "SecretError": "gpusd.errors",
    "WireError": "gpusd.errors",
    "TxtError": "gpusd.errors",
    "SSEError": "gpusd.errors",
    "NoDaemon": "gpusd.errors",
    "SourceError": "gpusd.errors",
    "AlreadyRunning": "gpusd.errors",
    "LockBusy": "gpusd.errors",
    "DaemonStartFailed": "gpusd.errors",
    "DiskFull": "gpusd.errors",
}

# Names 0.2 exported that are internal: still resolved, with a DeprecationWarning, until 0.4.
_DEPRECATED = {
    "LeaseStore": "gpusd.alloc.leases",
    "open_backend": "gpusd.inventory",
}

__all__ = ["__version__", *_LAZY]

if TYPE_CHECKING:  # pragma: no cover
    # What a type checker sees: every name of _LAZY and _DEPRECATED, re-exported.  Kept equal to the tables
    # by tests/core/test_exports.py, which prints the lines to paste when they differ.
    from ._local import (
        local_snapshot as local_snapshot,
    )
    from .alloc.api import (
        Selection as Selection,
    )
    from .alloc.api import (
        select as select,
    )
    from .alloc.env import (
        CudaAlreadyInitializedWarning as CudaAlreadyInitializedWarning,
    )
    from .alloc.env import (
        set_cuda_visible_devices as set_cuda_visible_devices,
    )
    from .alloc.leases import (
        LeaseStore as LeaseStore,
    )
    from .alloc.select import (
        Constraints as Constraints,
    )
    from .discovery.client import (
        AsyncClient as AsyncClient,
    )
    from .discovery.options import (
        DiscoveryOptions as DiscoveryOptions,
    )
    from .discovery.sync import (
        Client as Client,
    )
    from .discovery.types import (
        Device as Device,
    )
    from .discovery.types import (
        DiscoveryEvent as DiscoveryEvent,
    )
    from .discovery.types import (
        RemoteHost as RemoteHost,
    )
    from .errors import (
        AlreadyRunning as AlreadyRunning,
    )
    from .errors import (
        BackendUnavailable as BackendUnavailable,
    )
    from .errors import (
        ConfigError as ConfigError,
    )
    from .errors import (
        DaemonStartFailed as DaemonStartFailed,
    )
    from .errors import (
        DiskFull as DiskFull,
    )
    from .errors import (
        GpusdError as GpusdError,
    )
    from .errors import (
        IdError as IdError,
    )
    from .errors import (
        LockBusy as LockBusy,
    )
    from .errors import (
        NoDaemon as NoDaemon,
    )
    from .errors import (
        NoGpuAvailable as NoGpuAvailable,
    )
    from .errors import (
        SecretError as SecretError,
    )
    from .errors import (
        SourceError as SourceError,
    )
    from .errors import (
        SSEError as SSEError,
    )
    from .errors import (
        TxtError as TxtError,
    )
    from .errors import (
        WaitTimeout as WaitTimeout,
    )
    from .errors import (
        WireError as WireError,
    )
    from .inventory import (
        open_backend as open_backend,
    )
    from .model import (
        GpuInfo as GpuInfo,
    )
    from .model import (
        GpuLink as GpuLink,
    )
    from .model import (
        HostSnapshot as HostSnapshot,
    )
    from .model import (
        LeaseInfo as LeaseInfo,
    )
    from .model import (
        MigInstance as MigInstance,
    )
    from .model import (
        ProcessInfo as ProcessInfo,
    )
    from .pool.client import (
        Reservation as Reservation,
    )
    from .pool.client import (
        reserve as reserve,
    )


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        module = _DEPRECATED.get(name)
        if module is None:
            raise AttributeError(f"module 'gpusd' has no attribute {name!r}")
        import warnings

        warnings.warn(f"gpusd.{name} is internal and leaves gpusd's namespace in 0.4: import it from {module}",
                      DeprecationWarning, stacklevel=2)
        # not cached: every use warns
        return getattr(import_module(module), name)
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
