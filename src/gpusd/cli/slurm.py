"""``gpusd slurm conf``, ``gpusd slurm prolog``, ``gpusd slurm epilog`` (docs/slurm.md)."""

# Imports inside functions: start-up (a command's own module).
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
        client.wait_settled(args.browse)
        hosts = client.hosts
    finally:
        client.stop_listening()
    out = []
    # a host is what it proved: its signed name, its signed address
    for h in hosts:
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
        print("gpusd: no verified host found (is the fleet secret the daemons'? --browse longer?)", file=sys.stderr)
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
    except NoDaemon:
        # the daemon held the lease: without it there is none left to end
        print("gpusd: no gpusd daemon here: no lease to end", file=sys.stderr)
    return 0


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]", name: str) -> None:
    """The parsers of ``gpusd slurm conf|prolog|epilog``."""
    from . import options as o

    what = "Slurm from the fleet: slurm.conf and gres.conf lines, prolog/epilog leases"
    p = sub.add_parser(name, help=what, description=what)
    ssub = p.add_subparsers(dest="slurm_command", metavar="conf|prolog|epilog", parser_class=type(p), required=True)
    p = o.command(ssub, "conf", "gpusd.cli.slurm:conf",
                  "print slurm.conf NodeName lines (or, with --gres, gres.conf lines) for every verified host",
                  parents=[o.browse(3.0, old="--wait"), o.simulate(), *o.fleet()])
    p.add_argument("--gres", action="store_true", help="print gres.conf lines instead of slurm.conf's")
    p.add_argument("--check", metavar="FILE",
                   help="compare FILE's NodeName lines with the fleet: hosts added, gone, changed (exit 1 if any)")
    p.add_argument("--local", action="store_true", help="this machine only (no fleet, no secret needed)")
    for name, what in (("prolog", "Slurm's Prolog: record the job's GPUs as a lease held by the Slurm job"),
                       ("epilog", "Slurm's Epilog: end the lease of the Slurm job")):
        p = o.command(ssub, name, f"gpusd.cli.slurm:{name}", what)
        p.add_argument("--job", metavar="ID", help="the Slurm job id (default $SLURM_JOB_ID)")
        p.add_argument("--timeout", type=o.positive_seconds, default=10.0, metavar="S",
                       help="give up asking the daemon after S seconds (default 10)")
