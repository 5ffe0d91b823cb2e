"""Starting and stopping a Ray cluster's nodes for ``gpusd ray up`` / ``ray down`` (docs/engines.md, "Ray").

* :func:`start` runs ``ray start`` on hosts (the head first, then the workers), their output on
  standard error — standard output is the cluster's address alone — and returns the hosts that failed
  with the last lines they said, so an error names the real cause (:func:`failure_lines`);
* :func:`stop` stops a cluster from its record: each host's guard (which stops that node's processes,
  and only those, and returns once they are gone) where gpusd reserved the GPUs, else
  ``ray stop --force`` (every Ray process of the user there).
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any, Sequence

from ..ids import LeaseId
from ..sanitize import for_terminal
from . import generate as g
from .launch import Failure, Launch, LaunchOptions, run_commands
from .placement import Placement
from .plan import guard_argv


def start(cmds: Sequence[g.HostCommand], opts: LaunchOptions) -> tuple[int, list[Failure]]:
    """Run ``ray start`` on these hosts, their output on stderr; the status and the hosts that failed."""
    job = Launch(cmds, opts, stdout=sys.stderr)
    status = asyncio.run(job.run())
    return status, job.failures


def failure_lines(failures: Sequence[Failure], status: int) -> list[str]:
    """Why ``ray up`` failed, host by host: the last lines of what ``ray start`` (or ssh, or the guard)
    said there — the real cause, whatever it is."""
    if not failures:
        return [f"ray up failed (status {status})"]
    out = []
    for f in failures:
        what = "ssh failed" if f.status == 255 else f"status {f.status}"
        said = "; ".join(for_terminal(line, 300) for line in f.tail[-3:]) or "no output"
        out.append(f"ray up failed on {for_terminal(f.label, 80)} ({what}): {said}")
    return out


def stop(record: dict[str, Any], opts: LaunchOptions, ray: str = "ray", python: str | None = None) -> int:
    """Stop Ray on every host of a cluster (``record``: what ``ray up`` kept); ``python``: the Python
    with gpusd on the hosts (default the record's, else found there).  The launcher's status."""
    p = Placement.from_dict(record["placement"])
    leases = [d["lease_id"] for d in record.get("leases") or []
              if isinstance(d, dict) and LeaseId.is_valid(d.get("lease_id"))]
    if leases and len(leases) == len(p.hosts):
        python = python or record.get("python")
        python = python if isinstance(python, str) and python else None
        # exit 3: no guard of that lease runs there (it stopped the node when the lease ended)
        cmds = [g.HostCommand(h, i, ["sh", "-c", '"$@" || [ $? -eq 3 ]', "gpusd-ray-down", *guard_argv(h, python),
                                     "--stop", "--lease", lease])
                for (i, h), lease in zip(enumerate(p.hosts), leases)]
        return run_commands(cmds, opts)
    return run_commands(g.ray_stop_commands(p, ray=ray), opts)
