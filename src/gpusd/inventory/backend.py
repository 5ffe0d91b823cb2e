"""The inventory backend: the one seam between a GPU vendor's library and the rest of gpusd.

Allocation (``alloc``), the daemon, discovery and the views read GPUs only through this protocol and
the :class:`~gpusd.model.HostSnapshot` it produces; every GPU in it says its ``vendor``, and that
vendor's visibility rule (which variables make a set of GPUs the only ones a job sees) lives beside
the backends in :mod:`gpusd.inventory.vendors`.  A new vendor is a module here (its reader, usually
on :class:`gpusd.inventory.base.VendorBackend`), its entry in :mod:`gpusd.inventory.combined` and its
rule in :mod:`gpusd.inventory.vendors` -- nothing above ``inventory`` changes.

Implemented by the NVML (``inventory.nvml``), amdsmi (``inventory.amd``), Level Zero
(``inventory.intel``), combined (``inventory.combined``) and simulated (``inventory.simulated``)
backends; ``tests/inventory/test_backend_protocol.py`` checks each of them against it.

This module is for the type checker and the tests (it imports ``typing`` at run time); the CLI's hot
paths import ``inventory`` without it.
"""

from __future__ import annotations

from typing import Mapping, Protocol, runtime_checkable

from ..model import HostSnapshot


@runtime_checkable
class Backend(Protocol):
    """What reads this machine's GPUs.  Thread-safe: the daemon's sampling, its lease authority and
    its pool share one (``daemon.inventory``)."""

    #: the name snapshots carry (``nvml``, ``amdsmi``, ``levelzero``, ``nvml+amdsmi``, ``simulated``)
    backend: str
    hostname: str
    node_id: str

    @property
    def vendors(self) -> tuple[str, ...]:
        """The vendors whose GPUs it reads (each has its visibility rule in :mod:`gpusd.inventory.vendors`)."""
        ...

    def snapshot(self, util_since: Mapping[str, float] | None = None, detail: bool = True) -> HostSnapshot:
        """Every GPU now.  ``util_since``: per GPU UUID, a time before which its utilisation samples are
        ignored (the load of a lease that has ended since); ``detail=False``: only what selection reads
        (no temperature, power, fan, process owners)."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> Backend: ...

    def __exit__(self, *exc: object) -> None: ...
