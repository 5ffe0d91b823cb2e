"""The CLI's tables of hosts and GPUs, rendered by gpusd's one table renderer
(:func:`gpusd.views.tables.render_table`, rich: every cell sanitised, plain text out).
"""

from __future__ import annotations

from ..model import GpuInfo, HostSnapshot, shown_name
from ..sanitize import for_terminal
from ..units import format_bytes
from ..views.tables import MAX_CELL, container_tag, render_table

__all__ = ["MAX_CELL", "render_table", "render_host", "gpu_rows", "host_header"]
NAME_MAX = 64  # of a host name


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}%"


def _procs(g: GpuInfo) -> str:
    if not g.processes:
        return "-"
    parts = []
    for p in g.processes[:3]:
        who = f"{p.user}:" if p.user else ""
        mem = f"({format_bytes(p.used_memory, 'MiB')})" if p.used_memory is not None else ""
        parts.append(f"{who}{p.pid}{mem}{container_tag(p)}{f' unleased (gpusd adopt {p.pid})' if p.unleased else ''}")
    more = f" +{len(g.processes) - 3}" if len(g.processes) > 3 else ""
    return " ".join(parts) + more


def _leases(g: GpuInfo) -> str:
    if not g.leases:
        return "-"
    return " ".join(f"{le.user or '?'}:{le.pid}{'(shared)' if le.shared else ''}{_until(le.expires)}"
                    f"{'(not-through-authority)' if le.outside_authority else ''}{'(OVER-CAP)' if le.over_cap else ''}"
                    f"{'(record unreadable)' if le.unreadable else ''}" for le in g.leases)


def _until(expires: float | None) -> str:
    """A remote reservation's expiry (docs/pool.md), on the local clock."""
    if expires is None:
        return ""
    import time

    return "@" + time.strftime("%H:%M:%S", time.localtime(expires))


def host_header(snap: HostSnapshot) -> str:
    sim = "  [SIMULATED GPUs]" if snap.simulated else ""
    return (f"{for_terminal(snap.hostname, NAME_MAX)}  node {for_terminal(snap.node_id, NAME_MAX)}  "
            f"driver {for_terminal(snap.driver_version, 32) or '-'}  "
            f"CUDA {for_terminal(snap.cuda_version, 32) or '-'}  {len(snap.gpus)} GPU(s){sim}")


def vendor_name(g: GpuInfo) -> str:
    """The NAME cell: the shown name, with the vendor for a GPU that is not NVIDIA's (``MI300X [amd]``)."""
    return shown_name(g.name, g.vendor)


def gpu_rows(snap: HostSnapshot) -> list[list[str]]:
    rows = []
    for g in snap.gpus:
        if g.memory_total is not None:
            mem = f"{format_bytes(g.memory_used)} / {format_bytes(g.memory_total)}"
            if g.memory_shared:
                # the host's memory (unified memory), not the GPU's own
                mem += " shared"
        else:
            mem = "-"
        power = f"{g.power_draw:.0f}W" if g.power_draw is not None else "-"
        status = "ok" if g.healthy else f"UNHEALTHY: {g.error or 'unknown'}"
        rows.append([
            str(g.index), vendor_name(g), mem, _pct(g.utilization_gpu),
            f"{g.temperature}C" if g.temperature is not None else "-", power,
            _procs(g), _leases(g), status,
        ])
        for m in g.mig_instances:
            # One cell per column, as the GPU rows: a slice has no utilisation, temperature or power
            # of its own.  Its UUID is in --json (a 40-character cell would push every row wide).
            mmem = f"{format_bytes(m.memory_used)} / {format_bytes(m.memory_total)}" if m.memory_total else "-"
            rows.append([f"{g.index}:{m.index}", f"  MIG {m.profile or '?'}", mmem, "-", "-", "-", "-", "-",
                         "ok" if g.healthy else "-"])
    return rows


GPU_HEADERS = ["IDX", "NAME", "MEMORY", "UTIL", "TEMP", "POWER", "PROCESSES", "LEASES", "STATUS"]


def render_host(snap: HostSnapshot) -> str:
    return host_header(snap) + "\n" + render_table(GPU_HEADERS, gpu_rows(snap), right=(3, 4, 5))
