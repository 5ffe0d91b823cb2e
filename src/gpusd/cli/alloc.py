"""``gpusd select``, ``gpusd env``, ``gpusd run`` and ``gpusd leases``."""

from __future__ import annotations

import argparse
import json
import shlex

from ..errors import ConfigError


def _constraints(args: argparse.Namespace):  # -> Constraints
    from ..alloc.select import Constraints

    return Constraints.build(
        count=args.count, min_free=args.min_free, memory=args.memory, max_util=args.max_util,
        max_processes=args.max_processes, include=args.include, exclude=args.exclude, mig=args.mig,
        by=args.by, shared=args.share,
    )


def _allocate(args: argparse.Namespace, command: str | None = None):  # -> Selection
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
    from ..sanitize import for_terminal

    now = time.time()
    # Lease records are files other users write: every string is made safe before it is printed.
    rows = [[for_terminal(le.device or "-", 64, markup=False), for_terminal(le.lease_id, 16, markup=False),
             for_terminal(le.user or "-", 32, markup=False), str(le.pid),
             "shared" if le.shared else "exclusive",
             f"{le.memory / 2**30:.1f}GiB" if le.memory else "-",
             f"{now - le.started:.0f}s" if le.started else "-", for_terminal(le.command or "-", 40, markup=False)]
            for le in held]
    print(f"lock directory {store.dir}: {len(held)} device lease(s), {len(queued)} job(s) waiting")
    if rows:
        print(render_table(["DEVICE", "LEASE", "USER", "PID", "MODE", "MEMORY", "AGE", "COMMAND"], rows))
    return 0
