"""A GPU that fails a query mid-snapshot (lost, reset, a driver error): every backend reports it in
the snapshot as ``healthy: false`` with the failing query's reason, and reads the other GPUs as usual
(docs/inventory.md, "health")."""

from __future__ import annotations

from ..model import GpuInfo

# typing is not imported at run time: start-up time
TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from typing import Any, Callable, TypeVar

if TYPE_CHECKING:  # pragma: no cover
    D = TypeVar("D")


class GpuFailed(Exception):
    """One GPU's query failed; ``reason`` says which and why (it becomes the GPU's ``error``)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def filled(gpu: GpuInfo, fill: Callable[[D, GpuInfo], Any], dev: D) -> GpuInfo:
    """``gpu`` after ``fill(dev, gpu)``; flagged unhealthy with the reason where a query of it failed."""
    try:
        fill(dev, gpu)
    except GpuFailed as exc:
        gpu.healthy, gpu.error = False, exc.reason
    return gpu
