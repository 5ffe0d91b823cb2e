"""The CUDA environment for chosen GPUs, done right.

* Indices are nvidia-smi's (NVML's) numbering, which is PCI bus order; CUDA's default order is
  FASTEST_FIRST and can differ, so ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` is always set with indices.
* UUIDs are emitted on request, and always for MIG slices (CUDA addresses a slice only by UUID); they
  also survive MPS and container renumbering.
* Setting ``CUDA_VISIBLE_DEVICES`` after CUDA has initialised in a process does nothing: we warn.
* AMD and Intel GPUs get their own vendor's variables (``ROCR_VISIBLE_DEVICES``, ``ZE_AFFINITY_MASK``),
  never ``CUDA_VISIBLE_DEVICES``: the rules are the inventory's (:mod:`gpusd.inventory.vendors`).
"""

# Imports inside functions: start-up (quick commands import this module).
from __future__ import annotations

import os
import sys
import warnings

from ..inventory.vendors import Visible, apply_cleared, counts_cuda_visible, device_order_env, visible_env

# typing is not imported at run time: start-up time
TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from typing import Iterable, MutableMapping

# (the vendors' variables themselves are gpusd.inventory.vendors')
__all__ = ["cuda_env", "apply_env", "apply_visible", "set_cuda_visible_devices", "cuda_initialized",
           "CudaAlreadyInitializedWarning"]


# the variables named in the warning
_DEVICE_LISTS = ("_VISIBLE_DEVICES", "ZE_AFFINITY_MASK")


class CudaAlreadyInitializedWarning(RuntimeWarning):
    """CUDA_VISIBLE_DEVICES was set in a process where CUDA is already initialised."""


def cuda_env(devices: Iterable[int | str], *, use_uuid: bool = False,
             uuids: Iterable[str] | None = None) -> dict[str, str]:
    """The variables that make exactly ``devices`` visible to CUDA.

    ``devices`` are NVML indices or UUIDs.  With ``use_uuid`` (or any MIG slice) ``uuids`` — the
    devices' UUIDs, in the same order — are emitted instead of indices."""
    # here: the quick commands that print no UUID need no ids
    from ..ids import GpuUuid

    items = [str(d) for d in devices]
    uuid_list = [str(u) for u in uuids] if uuids is not None else None
    if uuid_list is not None and (use_uuid or any(GpuUuid.is_slice(u) for u in uuid_list)):
        items = uuid_list
    return {**device_order_env(), "CUDA_VISIBLE_DEVICES": ",".join(items)}


def cuda_initialized() -> str | None:
    """Why we believe CUDA is already initialised in this process, or None."""
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_initialized():
                return "torch has initialised CUDA"
        except Exception:
            pass
    for name in ("cupy", "jax", "tensorflow", "numba.cuda", "pycuda.autoinit"):
        if name in sys.modules and _libcuda_loaded():
            return f"{name} is imported and libcuda is loaded"
    if "torch" not in sys.modules and _libcuda_loaded():
        return "libcuda is loaded in this process"
    return None


def _libcuda_loaded() -> bool:
    try:
        with open("/proc/self/maps") as f:
            return any("libcuda.so" in line for line in f)
    except OSError:
        return False


def apply_env(variables: dict[str, str], environ: MutableMapping[str, str] | None = None, stacklevel: int = 3) -> None:
    """Set ``variables`` in ``os.environ`` (or ``environ``), warning if it is too late for CUDA."""
    target = os.environ if environ is None else environ
    if environ is None:
        why = cuda_initialized()
        if why:
            warnings.warn(
                f"CUDA is already initialised in this process ({why}): setting "
                f"{' '.join(f'{k}={v}' for k, v in variables.items() if k.endswith(_DEVICE_LISTS))} now has no "
                "effect. Set it before CUDA starts "
                "(before importing torch & co.), or launch the job with `gpusd run`.",
                CudaAlreadyInitializedWarning,
                stacklevel=stacklevel,
            )
    target.update(variables)


def apply_visible(devices: Iterable[Visible], *, use_uuid: bool = False,
                  environ: MutableMapping[str, str] | None = None, stacklevel: int = 4) -> dict[str, str]:
    """Set each vendor's variables for ``devices`` (and remove those that would mask again)."""
    devs = list(devices)
    variables = visible_env(devs, use_uuid=use_uuid)
    target = os.environ if environ is None else environ
    apply_cleared(target, {d.vendor for d in devs}, keep=variables)
    apply_env(variables, environ, stacklevel=stacklevel)
    return variables


def _other_vendors_possible() -> bool:
    """Whether this process could see GPUs that are not NVIDIA's (a simulation, or the AMD or Intel
    package installed): only then does ``set_cuda_visible_devices`` read the inventory."""
    import importlib.util

    if os.environ.get("GPUSD_SIMULATE"):
        return True
    from ..inventory.vendors import PACKAGES

    # the vendors gpusd has no package of
    others = {v: p for v, p in PACKAGES.items() if p is not None}
    backends = os.environ.get("GPUSD_BACKENDS", "")
    if backends and backends != "auto":
        return any(v in backends for v in others)
    return any(importlib.util.find_spec(p) is not None for p in others.values())


def _resolve(items: list[int | str]) -> list[Visible] | None:
    """The local GPUs ``items`` name (gpusd indices or UUIDs), with their vendors; None where the
    local inventory cannot be read or does not know one of them."""
    from ..errors import GpusdError

    if not _other_vendors_possible():
        # an NVIDIA host: no NVML start-up just to learn that
        return None

    try:
        from .backend import shared_backend

        snap = shared_backend().snapshot(detail=False)
    except GpusdError:
        return None
    out = []
    for d in items:
        try:
            gpu = snap.gpu(d)
        except KeyError:
            return None
        out.append(Visible.of(gpu))
    return out


def _check_indices(items: list[int | str]) -> None:
    """ValueError where an index names no GPU of this host: a runtime would silently drop it (CUDA
    stops reading its list at the first device it does not have).  Unchecked where the GPUs cannot be
    read here."""
    indices = [d for d in items if isinstance(d, int) or (isinstance(d, str) and d.isdigit())]
    if not indices:
        return
    from ..errors import GpusdError

    try:
        from .backend import shared_backend

        count = len(shared_backend().snapshot(detail=False).gpus)
    except (GpusdError, OSError):
        return
    absent = [str(d) for d in indices if int(d) >= count]
    if absent:
        have = f"GPUs 0-{count - 1}" if count > 1 else ("GPU 0" if count else "no GPU")
        raise ValueError(f"no GPU {', '.join(absent)} on this host (it has {have}): a runtime would drop "
                         f"{'them' if len(absent) > 1 else 'it'} without a word")


def set_cuda_visible_devices(devices: Iterable[int | str] | int | str, vendor: str | None = None) -> dict[str, str]:
    """Make ``devices`` (gpusd's indices as in ``gpusd devices``, nvidia-smi's on NVIDIA hosts, or
    UUIDs) the GPUs this process sees.

    NVIDIA GPUs: sets ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` together with ``CUDA_VISIBLE_DEVICES``; AMD and
    Intel GPUs get their own variables (``ROCR_VISIBLE_DEVICES``, ``ZE_AFFINITY_MASK``; the name is kept
    for old scripts).  ``vendor`` says whose GPUs they are; by default the local inventory says, and
    NVIDIA is assumed where it cannot be read.  Warns when CUDA is already initialised.  Returns the
    variables set."""
    if isinstance(devices, (int, str)):
        devices = [devices]
    items = list(devices)
    for d in items:
        if isinstance(d, bool) or not isinstance(d, (int, str)) or (isinstance(d, int) and d < 0):
            raise ValueError(f"a GPU is an index (0, 1, ...) or a UUID, not {d!r}")
    _check_indices(items)
    resolved = _resolve(items) if vendor is None and items else None
    if resolved is None or all(counts_cuda_visible(v.vendor) for v in resolved):
        if vendor is None or counts_cuda_visible(vendor):
            variables = cuda_env(items)
            apply_env(variables)
            return variables
        resolved = [Visible(vendor, int(d)) if isinstance(d, int) else Visible(vendor, 0, d) for d in items]
    return apply_visible(resolved)
