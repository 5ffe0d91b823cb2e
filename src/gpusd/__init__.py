"""gpusd: GPU service discovery and allocation.

Everything is imported lazily so that ``import gpusd`` (and the ``gpusd`` CLI) start fast::

    import gpusd
    with gpusd.select(count=2, min_free="20GiB") as sel:   # least-loaded GPUs, leased
        sel.apply()                                          # CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER
    gpusd.set_cuda_visible_devices([1, 3])
    snap = gpusd.local_snapshot()                            # this host's GPUs
    client = gpusd.Client()                                  # every GPU on the LAN
"""

from __future__ import annotations

from importlib import import_module

from ._version import __version__

TYPE_CHECKING = False  # typing is not imported at run time: start-up time (issue 24)

_LAZY = {
    "select": "gpusd.alloc.api",
    "Selection": "gpusd.alloc.api",
    "set_cuda_visible_devices": "gpusd.alloc.env",
    "CudaAlreadyInitializedWarning": "gpusd.alloc.env",
    "Constraints": "gpusd.alloc.select",
    "LeaseStore": "gpusd.alloc.leases",
    "open_backend": "gpusd.inventory",
    "local_snapshot": "gpusd._local",
    "HostSnapshot": "gpusd.model",
    "GpuInfo": "gpusd.model",
    "MigInstance": "gpusd.model",
    "ProcessInfo": "gpusd.model",
    "LeaseInfo": "gpusd.model",
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
    "Client": "gpusd.discovery.sync",
    "AsyncClient": "gpusd.discovery.client",
}

__all__ = ["__version__", *_LAZY]

if TYPE_CHECKING:  # pragma: no cover  (every name of _LAZY, re-exported: a type checker sees the real objects)
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
    from .discovery.sync import (
        Client as Client,
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


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gpusd' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
