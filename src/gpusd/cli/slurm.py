"""``gpusd slurm conf``, ``gpusd slurm prolog``, ``gpusd slurm epilog`` (docs/slurm.md)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from ..errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from ..model import HostSnapshot


def _hosts(args: argparse.Namespace) -> list[tuple[HostSnapshot, str | None]]:
    """(snapshot, signed address) of every verified host of the fleet, or of this machine (--local)."""
    if args.local:
        from .._local import local_snapshot

        return [(local_snapshot(simulate=args.simulate), None)]
    if args.simulate:
        raise ConfigError("--simulate goes with --local (the fleet's hosts say what they have)")
    from ..discovery.sync import Client
    from .discover import beyond_args
    from .trust import fleet_key

    key = fleet_key(args)
    if key is None:
        raise ConfigError("gpusd slurm conf writes only hosts that proved themselves: give the fleet secret "
                          "(--token-file FILE, $GPUSD_TOKEN_FILE or $GPUSD_TOKEN), or use --local")
    client = Client(args.session, interfaces=args.interfaces, key=key, **beyond_args(args))
    try:
        client.wait_settled(args.wait)
        hosts = client.hosts
    finally:
        client.stop_listening()
    out = []
    for h in hosts:  # a host is what it proved: its signed name, its signed address
        if h.verified is not True or h.identity is None or h.snapshot is None or not h.alive:
            continue
        addrs = h.signed_addresses
        h.snapshot.hostname = h.hostname
        out.append((h.snapshot, addrs[0] if addrs else None))
    return out


def conf(args: argparse.Namespace) -> int:
    from ..slurm import conf as sconf

    hosts = _hosts(args)
    if args.check:
        try:
            with open(args.check, encoding="utf-8", errors="replace") as f:
                text = f.read(16 << 20)
        except OSError as exc:
            raise ConfigError(f"cannot read {args.check}: {exc.strerror}") from None
        diff = sconf.check(text, [s for s, _ in hosts])
        from ..sanitize import for_terminal

        for line in diff.lines():
            print(for_terminal(line, 400))
        return 0 if diff.same else 1
    if not hosts:
        print("gpusd: no verified host found (is the fleet secret the daemons'? --wait longer?)", file=sys.stderr)
    sys.stdout.write(sconf.gres_conf([s for s, _ in hosts]) if args.gres else sconf.slurm_conf(hosts))
    return 0


def prolog(args: argparse.Namespace) -> int:
    from ..slurm.jobs import begin, environ

    reply = begin(environ(), args.job, args.timeout)
    if reply is not None:
        print(f"gpusd: Slurm job {reply.get('slurm_job')}: leased {','.join(reply.get('devices') or [])}",
              file=sys.stderr)
    return 0


def epilog(args: argparse.Namespace) -> int:
    from ..errors import NoDaemon
    from ..slurm.jobs import end, environ

    try:
        end(environ(), args.job, args.timeout)
    except NoDaemon:  # the daemon held the lease: without it there is none left to end
        print("gpusd: no gpusd daemon here: no lease to end", file=sys.stderr)
    return 0
