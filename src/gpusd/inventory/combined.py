"""One host, several vendors: the NVML, amdsmi and Level Zero backends side by side, as one backend.

Each vendor's GPUs keep their own numbers (``GpuInfo.vendor_index``: what CUDA, ROCm or Level Zero
count); ``index`` runs over the host in the order NVIDIA, AMD, Intel, so that it stays unique.  A
vendor backend that fails mid-run fails the snapshot (a one-line BackendUnavailable, as NVML's).
"""

# Imports inside functions: start-up (quick commands import this module).
from __future__ import annotations

import os
import time

from ..errors import BackendUnavailable
from ..model import GpuInfo, HostSnapshot
from .vendors import BACKENDS

# typing is not imported at run time: start-up time
TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from typing import Mapping, Sequence

    from . import Backend

# NVIDIA, AMD, Intel: the order of the host's GPU indices
ORDER = tuple(BACKENDS)
# which vendors to read: "nvidia,amd", or "auto" (default)
ENV = "GPUSD_BACKENDS"


def wanted(value: str | None = None) -> tuple[tuple[str, ...], bool]:
    """(vendors to try, whether the list was given) from ``$GPUSD_BACKENDS``."""
    raw = (value if value is not None else os.environ.get(ENV, "")).strip().lower()
    if not raw or raw == "auto":
        return ORDER, False
    names = tuple(n.strip() for n in raw.split(",") if n.strip())
    unknown = [n for n in names if n not in ORDER]
    if unknown:
        raise BackendUnavailable(f"{ENV}: unknown vendor {unknown[0][:20]!r} (known: {', '.join(ORDER)}, auto)")
    return names, True


def open_vendor(vendor: str, *, util_window: float, processes: bool, telemetry: bool = False) -> Backend:
    """One vendor's backend (``vendors.BACKENDS``); ``telemetry`` (what the DCGM-named metrics read)
    goes to the backends that read it (NVML's)."""
    import importlib

    module, name = BACKENDS[vendor]
    cls = getattr(importlib.import_module(f"{__package__}.{module}"), name)
    kwargs = {"telemetry": telemetry} if getattr(cls, "telemetry_counters", False) else {}
    backend: Backend = cls(util_window=util_window, processes=processes, **kwargs)
    return backend


def _installed(vendor: str) -> bool:
    """Whether trying ``vendor`` on a host that did not ask for it is worth it (its package is there)."""
    import importlib.util

    from .vendors import PACKAGES

    package = PACKAGES.get(vendor)
    return package is None or importlib.util.find_spec(package) is not None


def open_backends(*, util_window: float = 5.0, processes: bool = True, telemetry: bool = False) -> Backend:
    """The backend of every vendor present: one alone as itself, several as a :class:`CombinedBackend`.

    ``$GPUSD_BACKENDS`` names the vendors to read (every one named must work); by default NVML is
    tried, and AMD and Intel when their package is installed; the first failure's reason is raised
    when none works.  ``telemetry`` goes to NVML (the daemon's clocks, energy, XID events...)."""
    vendors, explicit = wanted()
    opened: list[Backend] = []
    first: BackendUnavailable | None = None
    for vendor in vendors:
        if not explicit and not _installed(vendor):
            continue
        try:
            opened.append(open_vendor(vendor, util_window=util_window, processes=processes, telemetry=telemetry))
        except BackendUnavailable as exc:
            if explicit:
                for b in opened:
                    b.close()
                raise
            first = first or exc
    if not opened:
        raise first or BackendUnavailable("no GPU backend could be opened", hint=True)
    return opened[0] if len(opened) == 1 else CombinedBackend(opened)


class CombinedBackend:
    """Several vendor backends of one host as one."""

    def __init__(self, parts: Sequence[Backend]) -> None:
        self.parts = list(parts)
        self.backend = "+".join(p.backend for p in self.parts)
        self.vendors = tuple(v for p in self.parts for v in p.vendors)
        self.hostname = self.parts[0].hostname
        self.node_id = self.parts[0].node_id

    def snapshot(self, util_since: Mapping[str, float] | None = None, detail: bool = True) -> HostSnapshot:
        snaps = [p.snapshot(util_since, detail) for p in self.parts]
        gpus: list[GpuInfo] = []
        for snap in snaps:
            for g in snap.gpus:
                g.vendor_index = g.device_index
                g.index = len(gpus)
                if g.vendor_index == g.index:
                    g.vendor_index = None
                gpus.append(g)
        first = snaps[0]
        return HostSnapshot(hostname=self.hostname, node_id=self.node_id, timestamp=time.time(), gpus=gpus,
                            driver_version=first.driver_version, cuda_version=first.cuda_version,
                            nvml_version=first.nvml_version, backend=self.backend)

    def close(self) -> None:
        for p in self.parts:
            p.close()

    def __enter__(self) -> CombinedBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
