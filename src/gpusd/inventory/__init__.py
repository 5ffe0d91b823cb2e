"""Reading the local GPUs: NVML, amdsmi (AMD) and Level Zero Sysman (Intel) for real hardware, a
simulation for demos (docs/inventory.md).

``open_backend()`` picks the simulation named by ``simulate`` / ``$GPUSD_SIMULATE``, or every vendor
backend that works here (``$GPUSD_BACKENDS`` to name them).  All backends have the same interface
(:class:`Backend`):

* :mod:`.nvml` — NVIDIA, in-process; :mod:`.amd` — amdsmi; :mod:`.intel` — Level Zero through pyzes;
* :mod:`.nvmlfast` — the NVML calls of a backend without telemetry, without nvidia-ml-py's import;
* :mod:`.combined` — several vendors of one host as one backend;
* :mod:`.simulated` — simulated GPUs; :mod:`.contention` — the simulator's jobs sharing GPUs;
* :mod:`.window` — utilisation averaged over a time window;
* :mod:`.lost` — a GPU that fails mid-snapshot, flagged unhealthy;
* :mod:`.processes` — who runs a GPU process (user, command line);
* :mod:`.cgroups` — which container (or Slurm job) a process runs in, from its cgroup;
* :mod:`.vendors` — each vendor's visibility variables;
* :mod:`.backend` — the one protocol every backend implements; :mod:`.base` — the vendor libraries'
  shared reader (device list, lock, query, closing).

Internal (docs/api.md): ``gpusd.local_snapshot`` is the public way to read this machine's GPUs.
"""

# Imports inside functions: start-up (quick commands import this module).
from __future__ import annotations

import os

# typing is not imported at run time: start-up time
TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from .backend import Backend as Backend
else:
    # the protocol (inventory.backend) is for the type checker: typing stays unimported
    Backend = object


def open_backend(simulate: str | None = None, *, util_window: float = 5.0, processes: bool = True,
                 telemetry: bool = False) -> Backend:
    """The backend of every vendor present (NVML, amdsmi, Level Zero), or a simulated one for
    ``simulate`` (``"4xA100-80GB"`` or a scenario file).

    ``$GPUSD_SIMULATE`` is used when ``simulate`` is not given, so scripts and ``gpusd run`` children
    see the same simulated host.  ``telemetry``: also read what the DCGM-named metrics need (clocks,
    energy, XID events...: the daemon; a one-shot command has no use for them)."""
    simulate = simulate or os.environ.get("GPUSD_SIMULATE") or None
    if simulate:
        from .simulated import SimulatedBackend

        return SimulatedBackend(simulate)
    from .combined import open_backends

    return open_backends(util_window=util_window, processes=processes, telemetry=telemetry)
