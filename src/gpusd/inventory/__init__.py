"""Reading the local GPUs: NVML, amdsmi (AMD) and Level Zero Sysman (Intel) for real hardware, a
simulation for demos.

``open_backend()`` picks the simulation named by ``simulate`` / ``$GPUSD_SIMULATE``, or every vendor
backend that works here (``$GPUSD_BACKENDS`` to name them: :mod:`gpusd.inventory.combined`).  Every
backend implements one protocol (:class:`gpusd.inventory.backend.Backend`), the vendor libraries' on
one shared base (:mod:`gpusd.inventory.base`).
"""

from __future__ import annotations

import os

TYPE_CHECKING = False  # typing is not imported at run time: start-up time (issue 24)
if TYPE_CHECKING:  # pragma: no cover
    from .backend import Backend as Backend
else:
    Backend = object  # the protocol (inventory.backend) is for the type checker: typing stays unimported


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
