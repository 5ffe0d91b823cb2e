"""``gpusd devices``: this machine's GPUs, as a table or JSON."""

from __future__ import annotations

import argparse
import sys

from ..inventory import open_backend


def run(args: argparse.Namespace) -> int:
    from ..alloc.leases import LeaseStore

    with open_backend(args.simulate, processes=args.processes) as backend:
        snap = backend.snapshot()
    store = LeaseStore()
    store.attach(snap)
    mutex = store.mutex_holders()
    if mutex:
        from .alloc import mutex_note

        print(f"gpusd: warning: {mutex_note(store, mutex)}", file=sys.stderr)
    if args.json:
        # strict JSON: never NaN or Infinity
        from ..sanitize import dumps

        sys.stdout.write(dumps(snap.to_dict(), separators=(",", ":")) + "\n")
    else:
        from .table import render_host

        print(render_host(snap))
    return 0
