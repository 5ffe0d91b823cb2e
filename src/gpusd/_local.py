"""One-call view of this host."""

# Imports inside functions: not yet hoisted.
from __future__ import annotations

from .model import HostSnapshot


def local_snapshot(simulate: str | None = None, leases: bool = True) -> HostSnapshot:
    """This host's GPUs now (through the process's shared NVML backend), with leases attached."""
    from .alloc.api import shared_backend
    from .alloc.leases import LeaseStore

    snap = shared_backend(simulate).snapshot()
    return LeaseStore().attach(snap) if leases else snap
