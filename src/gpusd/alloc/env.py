"""The CUDA environment for chosen GPUs, done right.

* Indices are nvidia-smi's (NVML's) numbering, which is PCI bus order; CUDA's default order is
  FASTEST_FIRST and can differ, so ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` is always set with indices.
* UUIDs are emitted on request, and always for MIG slices (CUDA addresses a slice only by UUID); they
  also survive MPS and container renumbering.
* Setting ``CUDA_VISIBLE_DEVICES`` after CUDA has initialised in a process does nothing: we warn.
"""

from __future__ import annotations

import os
import sys
import warnings

TYPE_CHECKING = False  # typing is not imported at run time: start-up time (issue 24)
if TYPE_CHECKING:  # pragma: no cover
    from typing import Iterable, MutableMapping


class CudaAlreadyInitializedWarning(RuntimeWarning):
    """CUDA_VISIBLE_DEVICES was set in a process where CUDA is already initialised."""


def cuda_env(devices: Iterable[int | str], *, use_uuid: bool = False,
             uuids: Iterable[str] | None = None) -> dict[str, str]:
    """The variables that make exactly ``devices`` visible to CUDA.

    ``devices`` are NVML indices or UUIDs.  With ``use_uuid`` (or any MIG slice) ``uuids`` — the
    devices' UUIDs, in the same order — are emitted instead of indices."""
    items = [str(d) for d in devices]
    uuid_list = [str(u) for u in uuids] if uuids is not None else None
    if uuid_list is not None and (use_uuid or any(u.startswith("MIG-") for u in uuid_list)):
        items = uuid_list
    return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ",".join(items)}


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
                f"CUDA is already initialised in this process ({why}): setting CUDA_VISIBLE_DEVICES="
                f"{variables.get('CUDA_VISIBLE_DEVICES')} now has no effect. Set it before CUDA starts "
                "(before importing torch & co.), or launch the job with `gpusd run`.",
                CudaAlreadyInitializedWarning,
                stacklevel=stacklevel,
            )
    target.update(variables)


def set_cuda_visible_devices(devices: Iterable[int | str] | int | str) -> dict[str, str]:
    """Make ``devices`` (NVML indices as in nvidia-smi, or UUIDs) the GPUs this process sees.

    Sets ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` together with ``CUDA_VISIBLE_DEVICES`` and warns when CUDA is
    already initialised.  Returns the variables set."""
    if isinstance(devices, (int, str)):
        devices = [devices]
    items = list(devices)
    for d in items:
        if isinstance(d, bool) or not isinstance(d, (int, str)) or (isinstance(d, int) and d < 0):
            raise ValueError(f"a GPU is an index (0, 1, ...) or a UUID, not {d!r}")
    variables = cuda_env(items)
    apply_env(variables)
    return variables
