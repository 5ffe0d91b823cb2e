"""This process's one inventory backend (NVML initialised once, handles cached), shared by the
selection API (:mod:`.api`), ``set_cuda_visible_devices`` (:mod:`.env`) and the job supervisor."""

# Imports inside functions: start-up (quick commands import this module).
from __future__ import annotations

import os
import threading

from ..errors import BackendUnavailable
from ..inventory import Backend, open_backend

_backends: dict[str, Backend] = {}
_backends_lock = threading.Lock()


def shared_backend(simulate: str | None = None) -> Backend:
    """One backend per process (NVML initialised once, handles cached).  Where this process has no
    driver library but the local daemon serves its GPUs (real, or simulated), they are read from the
    daemon (:class:`gpusd.alloc.authority.DaemonInventory`)."""
    key = simulate or os.environ.get("GPUSD_SIMULATE") or ""
    with _backends_lock:
        backend = _backends.get(key)
        if backend is None:
            try:
                backend = open_backend(key or None)
            except BackendUnavailable:
                if key:
                    raise
                # here: only without a driver library
                from .authority import daemon_inventory

                backend = daemon_inventory()
                if backend is None:
                    raise
            _backends[key] = backend
        return backend


def close_all() -> None:
    """Close every backend this process opened (a test's end; they open again on next use)."""
    with _backends_lock:
        for backend in _backends.values():
            backend.close()
        _backends.clear()
