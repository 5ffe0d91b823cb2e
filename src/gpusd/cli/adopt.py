"""``gpusd adopt PID``: make a running GPU process a lease until it exits (gpusd.alloc.adopt)."""

# Imports inside functions: start-up (a command's own module).
from __future__ import annotations

import argparse


def adopt(args: argparse.Namespace) -> int:
    from ..alloc.adopt import adopt as take

    answer = take(args.pid, args.note)
    if args.json:
        from ..sanitize import dumps

        print(dumps(answer, indent=2))
        return 0
    devices = ", ".join(str(d) for d in answer.get("devices") or [])
    print(f"process {args.pid} is now lease {answer.get('lease')} of {answer.get('user')} on {devices}, held until "
          f"it exits (holder pid {answer.get('holder')})")
    return 0


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]", name: str) -> None:
    from . import options as o

    p = o.command(sub, name, "gpusd.cli.adopt:adopt",
                  "make a running GPU process (yours; root: anyone's) a lease on the GPUs it uses, until it exits",
                  parents=[o.json_output("the lease as JSON")])
    p.add_argument("pid", type=int, help="the process")
    p.add_argument("--note", default=None, metavar="TEXT", help="shown with the lease (its command column)")
