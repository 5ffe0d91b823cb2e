"""Plain-text tables for the CLI (no rich here: these commands must start fast).

Every cell is hostile data (names from the network, users and commands from other users' files):
:func:`render_table` passes each one through :func:`gpusd.sanitize.for_terminal`, bounded to
``max_cell`` characters, so no escape sequence reaches the terminal and no line is unbounded.
"""

from __future__ import annotations

from ..model import GpuInfo, HostSnapshot, display_name
from ..sanitize import for_terminal
from ..units import format_bytes

TYPE_CHECKING = False  # typing is not imported at run time: start-up time (issue 24)
if TYPE_CHECKING:  # pragma: no cover
    from typing import Sequence

MAX_CELL = 80  # characters shown of one cell
NAME_MAX = 64  # of a host name


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = (),
                 max_cell: int = MAX_CELL) -> str:
    rows = [[for_terminal(cell, max_cell) for cell in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def line(cells: Sequence[str]) -> str:
        out = []
        for i, cell in enumerate(cells):
            out.append(cell.rjust(widths[i]) if i in right else cell.ljust(widths[i]))
        return "  ".join(out).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}%"


def _procs(g: GpuInfo) -> str:
    if not g.processes:
        return "-"
    parts = []
    for p in g.processes[:3]:
        who = f"{p.user}:" if p.user else ""
        mem = f"({format_bytes(p.used_memory, 'MiB')})" if p.used_memory is not None else ""
        parts.append(f"{who}{p.pid}{mem}")
    more = f" +{len(g.processes) - 3}" if len(g.processes) > 3 else ""
    return " ".join(parts) + more


def _leases(g: GpuInfo) -> str:
    if not g.leases:
        return "-"
    return " ".join(f"{le.user or '?'}:{le.pid}{'(shared)' if le.shared else ''}{_until(le.expires)}"
                    for le in g.leases)


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


def gpu_rows(snap: HostSnapshot) -> list[list[str]]:
    rows = []
    for g in snap.gpus:
        if g.memory_total is not None:
            mem = f"{format_bytes(g.memory_used)} / {format_bytes(g.memory_total)}"
        else:
            mem = "-"
        power = f"{g.power_draw:.0f}W" if g.power_draw is not None else "-"
        status = "ok" if g.healthy else f"UNHEALTHY: {g.error or 'unknown'}"
        rows.append([
            str(g.index), display_name(g.name), mem, _pct(g.utilization_gpu),
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
