"""``gpusd devices``: this machine's GPUs, as a table or JSON; ``--topology``: how they connect."""

# Imports inside functions: start-up (quick commands import this module).
from __future__ import annotations

import argparse
import sys

from ..inventory import open_backend

# typing is not imported at run time: start-up time
TYPE_CHECKING = False

if TYPE_CHECKING:  # pragma: no cover
    from ..model import HostSnapshot


def run(args: argparse.Namespace) -> int:
    from ..alloc.leases import LeaseStore

    with open_backend(args.simulate, processes=args.processes) as backend:
        snap = backend.snapshot()
    store = LeaseStore()
    store.attach(snap)
    # (job records only where a container runs)
    if any(p.container for g in snap.gpus for p in g.processes):
        from ..jobs.containers import name_containers

        name_containers(snap)
    mutex = store.mutex_holders()
    if mutex:
        from .alloc import mutex_note

        print(f"gpusd: warning: {mutex_note(store, mutex)}", file=sys.stderr)
    if args.json:
        # strict JSON: never NaN or Infinity
        from ..sanitize import dumps

        sys.stdout.write(dumps(snap.to_dict(), separators=(",", ":")) + "\n")
    elif getattr(args, "topology", False):
        print(render_topology(snap))
    else:
        from .table import render_host

        print(render_host(snap))
    return 0


def render_topology(snap: HostSnapshot) -> str:
    """The GPU matrix as ``nvidia-smi topo -m`` prints it: ``X`` on the diagonal, ``NV#`` for # bonded
    NVLinks, else ``PIX``/``PXB``/``PHB``/``NODE``/``SYS``; then each GPU's CPU and NUMA affinity and
    the legend.  Every cell is built from numbers (a CPU list is parsed and written again), so nothing
    a device or a peer said reaches the terminal as text."""
    from ..topology import LEGEND, format_cpulist, label, link_between, local_cpus
    from ..views.tables import render_table

    gpus = snap.gpus
    header = [""] + [f"GPU{g.index}" for g in gpus] + ["CPU Affinity", "NUMA Affinity", "GPU NUMA ID"]
    rows = []
    for a in gpus:
        cells = [f"GPU{a.index}"]
        for b in gpus:
            cells.append(" X " if a is b else label(link_between(a, b)))
        cpus = local_cpus(a)
        cells.append(format_cpulist(cpus) if cpus else "N/A")
        cells.append(str(a.numa_node) if a.numa_node is not None else "N/A")
        # a GPU's own memory NUMA node (Grace Hopper): not read
        cells.append("N/A")
        rows.append(cells)
    sim = "\n(simulated GPUs)" if snap.simulated else ""
    return render_table(header, rows, rule=False) + "\n\n" + LEGEND + sim


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]", name: str) -> None:
    """The parser of ``gpusd devices``."""
    from . import options as o

    p = o.command(sub, name, "gpusd.cli.devices:run", "show this machine's GPUs",
                  parents=[o.json_output("the host snapshot as JSON"), o.simulate()])
    p.add_argument("--topology", action="store_true",
                   help="print how the GPUs connect, as nvidia-smi topo -m does (NV#, PIX, PXB, PHB, NODE, SYS)")
    p.add_argument("--no-processes", dest="processes", action="store_false", help="skip process lists")
