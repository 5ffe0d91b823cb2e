"""``gpusd select``, ``gpusd env``, ``gpusd run`` and ``gpusd leases``."""

from __future__ import annotations

import argparse
import json
import shlex
from typing import TYPE_CHECKING

from ..errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from ..alloc.api import Selection
    from ..alloc.select import Constraints


def _constraints(args: argparse.Namespace) -> "Constraints":
    from ..alloc.select import constraints_from_args

    return constraints_from_args(args)


def _allocate(args: argparse.Namespace, command: str | None = None) -> "Selection":
    from ..alloc.api import allocate

    if args.timeout is not None and not args.wait:
        raise ConfigError("--timeout only makes sense with --wait")
    sel = allocate(_constraints(args), lease=args.lease, wait=args.wait, timeout=args.timeout,
                   simulate=args.simulate, command=command)
    sel.use_uuid = args.uuid
    return sel


def select(args: argparse.Namespace) -> int:
    sel = _allocate(args)
    if args.json:
        print(json.dumps(sel.to_dict(), indent=2))
    else:
        print(sel.env()["CUDA_VISIBLE_DEVICES"])
    return 0


def env(args: argparse.Namespace) -> int:
    sel = _allocate(args)
    for key, value in sel.env().items():
        if key == "GPUSD_LEASE":
            continue  # the lease ends with this process: do not pretend otherwise
        print(f"export {key}={shlex.quote(value)}")
    return 0


def run_command(args: argparse.Namespace) -> int:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise ConfigError("no command given: gpusd run [options] -- CMD [ARGS...]")
    from ..alloc.runner import run_with

    sel = _allocate(args, command=shlex.join(cmd)[:512])
    return run_with(sel, cmd)


def leases(args: argparse.Namespace) -> int:
    import time

    from ..alloc import queue
    from ..alloc.leases import LeaseStore
    from .table import render_table

    store = LeaseStore()
    held = store.leases()
    queued = queue.waiting(store)
    if args.json:
        print(json.dumps({"lock_dir": str(store.dir), "leases": [le.to_dict() for le in held],
                          "queued": [str(p.name) for _, p in queued]}, indent=2))
        return 0
    now = time.time()
    rows = [[le.device or "-", le.lease_id, le.user or "-", str(le.pid),
             "shared" if le.shared else "exclusive",
             f"{le.memory / 2**30:.1f}GiB" if le.memory else "-",
             f"{now - le.started:.0f}s" if le.started else "-", (le.command or "-")[:40]] for le in held]
    print(f"lock directory {store.dir}: {len(held)} device lease(s), {len(queued)} job(s) waiting")
    if rows:
        print(render_table(["DEVICE", "LEASE", "USER", "PID", "MODE", "MEMORY", "AGE", "COMMAND"], rows))
    return 0
