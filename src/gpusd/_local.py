"""One-call view of this host."""

from __future__ import annotations

from .alloc.api import shared_backend
from .alloc.leases import LeaseStore
from .model import HostSnapshot


def local_snapshot(simulate: str | None = None, leases: bool = True) -> HostSnapshot:
    """This host's GPUs now (through the process's shared NVML backend), with leases attached."""
    snap = shared_backend(simulate).snapshot()
    return LeaseStore().attach(snap) if leases else snap
