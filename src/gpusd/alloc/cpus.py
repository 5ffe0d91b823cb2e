"""``gpusd run --bind-cpus``: run the command on the CPUs close to its GPUs (docs/allocation.md).

The CPUs are those NVML reports as local to each chosen GPU (``nvmlDeviceGetCpuAffinity``, in the
snapshot as ``local_cpus``), all GPUs together, intersected with the CPUs this process may use (its
own affinity: a cgroup's cpuset or ``taskset`` still bound it).  The command is bound with the
kernel's ``sched_setaffinity`` in the child before it starts; nothing is bound (and gpusd says why)
when a GPU's CPUs are unknown or none of them may be used here.
"""

from __future__ import annotations

import os

from ..model import GpuInfo
from ..topology import format_cpulist, local_cpus

# typing is not imported at run time: start-up time
TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from typing import Callable, Sequence


def binding(gpus: Sequence[GpuInfo]) -> tuple[frozenset[int] | None, str]:
    """(the CPUs to bind the command to, what gpusd tells the user); None: leave it unbound."""
    names = ", ".join(str(g.index) for g in gpus)
    wanted: set[int] = set()
    for g in gpus:
        cpus = local_cpus(g)
        if cpus is None:
            return None, f"--bind-cpus: the CPUs local to GPU {g.index} are unknown; the command is not bound"
        wanted |= cpus
    try:
        allowed = frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError) as exc:  # pragma: no cover - Linux has it
        return None, f"--bind-cpus: cannot read this process's CPU affinity ({exc}); the command is not bound"
    chosen = frozenset(wanted) & allowed
    if not chosen:
        return None, (f"--bind-cpus: none of the CPUs local to GPU(s) {names} ({format_cpulist(wanted)}) may be "
                      f"used here ({format_cpulist(allowed)}); the command is not bound")
    return chosen, f"--bind-cpus: the command runs on CPUs {format_cpulist(chosen)} (local to GPU(s) {names})"


def preexec(cpus: frozenset[int] | None, own_group: bool) -> Callable[[], None] | None:
    """What the child runs before exec: its own process group (when asked), then its CPUs."""
    if cpus is None and not own_group:
        return None

    def run() -> None:
        if own_group:
            os.setpgid(0, 0)
        if cpus is not None:
            os.sched_setaffinity(0, cpus)

    return run
