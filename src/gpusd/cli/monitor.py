"""``gpusd top`` and ``gpusd export prometheus-sd``."""

# Imports inside functions: start-up (a command's own module).
from __future__ import annotations

import argparse
import shutil
import sys
import time
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, GpusdError
from .trust import fleet_key

if TYPE_CHECKING:  # pragma: no cover
    from ..views.sources import Source


def _source(args: argparse.Namespace, settle: float) -> Source:
    if getattr(args, "local", False):
        from ..views.sources import LocalSource

        return LocalSource(args.simulate)
    if getattr(args, "simulate", None):
        raise ConfigError("--simulate needs --local (it simulates this machine's GPUs)")
    if args.url:
        from ..views.sources import FleetSource

        return FleetSource(args.url, key=fleet_key(args))
    from ..views.sources import DiscoverySource
    from .discover import beyond_args

    return DiscoverySource(session=None if args.all_sessions else args.session, settle=settle,
                           interfaces=args.interfaces, key=fleet_key(args), **beyond_args(args))


def top(args: argparse.Namespace) -> int:
    from ..thresholds import ThresholdEngine, load_rules
    from ..views.top import SORT_KEYS, HostBook, TopState, render_text

    if args.interval <= 0:
        raise ConfigError("--interval must be a positive number of seconds")
    if args.sort not in SORT_KEYS:  # pragma: no cover - argparse checks choices
        raise ConfigError(f"--sort must be one of {', '.join(SORT_KEYS)}")
    rules = load_rules(args.threshold or (), args.thresholds or ())
    book = HostBook(engine_factory=(lambda: ThresholdEngine(rules)) if rules else None)
    state = TopState(sort=args.sort, reverse=args.reverse, filter=args.filter or "")
    once = args.once or not sys.stdout.isatty()
    source = _source(args, settle=args.browse)
    from ..units import parse_duration
    from ..views.spark import Sparks

    try:
        window = parse_duration(args.history)
    except ValueError as exc:
        raise ConfigError(f"--history: {exc}") from None
    if not 60 <= window <= 30 * 86400:
        raise ConfigError("--history must be between 1m and 30d")
    sparks = Sparks(window=window, key=fleet_key(args))
    try:
        if once:
            width = args.width or shutil.get_terminal_size((120, 40)).columns
            views = sparks.update(book.update(source.hosts()), wait=2.0)
            sys.stdout.write(render_text(views, state, width=width, color=sys.stdout.isatty()))
            sys.stdout.flush()
            return 0
        from rich.console import Console

        from ..views.live import run_live

        return run_live(lambda: sparks.update(source.hosts()), state, book, args.interval,
                        Console(highlight=False))
    finally:
        sparks.close()
        source.close()


def export_prometheus_sd(args: argparse.Namespace) -> int:
    from ..errors import SourceError
    from ..views import sd
    from ..views.sources import DiscoverySource, FleetSource
    from ..wire.promsd import ScrapeTarget

    if args.watch and not args.output:
        raise ConfigError("--watch needs --output FILE (Prometheus re-reads the file when it changes)")
    if args.interval <= 0:
        raise ConfigError("--interval must be a positive number of seconds")
    session = None if args.all_sessions else args.session

    source = None if args.url else _source(args, settle=args.browse)

    from ..wire.promsd import daemons_from_hosts

    def daemons() -> list[ScrapeTarget]:
        # the document every daemon serves at /api/v1/prometheus/http_sd, from the same function
        if source is None:
            fleet = FleetSource(args.url, key=fleet_key(args))
            hosts = sd.fleet_hosts(fleet.fleet(), trusted=fleet.verified)
            if fleet.verified is False:
                print(f"gpusd: {fleet.url} did not prove it holds the fleet secret: its hosts are left out",
                      file=sys.stderr)
            return daemons_from_hosts(hosts, session)
        assert isinstance(source, DiscoverySource)
        return daemons_from_hosts(source.remote_hosts(), session)

    try:
        while True:
            try:
                found = daemons()
            except SourceError as exc:
                if not args.watch:
                    raise
                # --watch: a daemon restarting is no reason to stop; keep the last good file
                # the message may quote the daemon's answer
                from ..sanitize import for_terminal

                print(f"gpusd: {for_terminal(exc, 2000)}; trying again in {args.interval:g}s", file=sys.stderr)
                time.sleep(args.interval)
                continue
            if args.output:
                try:
                    written = sd.write(args.output, found)
                except OSError as exc:
                    # no such directory, no permission: one line, not a traceback
                    raise GpusdError(f"cannot write {args.output}: {exc.strerror or exc}") from None
                if written:
                    print(f"gpusd: wrote {len(found)} target(s) to {args.output}", file=sys.stderr)
            else:
                sys.stdout.write(sd.dumps(found))
                sys.stdout.flush()
            if not args.watch:
                return 0
            time.sleep(args.interval)
    finally:
        if source is not None:
            source.close()


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]", name: str) -> None:
    """The parsers of ``gpusd top`` and ``gpusd export prometheus-sd|dns-sd-zone``."""
    from . import options as o

    if name == "export":
        _export_parsers(sub, o)
        return
    p = o.command(sub, name, "gpusd.cli.monitor:top",
                  "live view of every GPU on the LAN (or --local): utilisation, memory, leases, processes",
                  parents=[o.simulate(), o.interface(), o.session(), o.browse(2.0, old="--wait"),
                           o.thresholds(), o.token(o.SIGN), o.beyond()])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--local", action="store_true", help="this machine only, read directly (no daemon)")
    src.add_argument("--url", metavar="URL", help="read the fleet from this daemon, e.g. http://gpu-node-1:4780")
    p.add_argument("--once", action="store_true", help="print one frame and exit (also when stdout is not a terminal)")
    p.add_argument("--interval", type=o.positive_seconds, default=1.0, metavar="S",
                   help="refresh every S seconds (default 1)")
    p.add_argument("--sort", choices=("host", "util", "memory", "temp", "power", "free"), default="host",
                   help="sort GPUs (and hosts) by this key; key s cycles (default host)")
    p.add_argument("--reverse", action="store_true", help="reverse the sort order")
    p.add_argument("--filter", metavar="TEXT",
                   help="show only GPUs matching TEXT (host, model, UUID, user...; a term with * is a glob: A100*)")
    p.add_argument("--width", type=o.columns, metavar="N", help="with --once: render for N columns (20 or more)")
    p.add_argument("--history", default="1h", metavar="RANGE", type=o.duration_text,
                   help="the sparklines' window, from the daemons' history: 1h (default), 6h, 24h, 7d, 30d")


def _export_parsers(sub: Any, o: Any) -> None:
    what = "export the fleet for other tools"
    p = sub.add_parser("export", help=what, description=what)
    esub = p.add_subparsers(dest="export_format", metavar="FORMAT", parser_class=type(p), required=True)
    p = o.command(esub, "prometheus-sd", "gpusd.cli.monitor:export_prometheus_sd",
                  "write a Prometheus file_sd target list of the gpusd daemons discovered",
                  parents=[o.interface(), o.session(), o.browse(3.0, old="--wait"),
                           o.token("with --url: sign the request")])
    p.add_argument("-o", "--output", metavar="FILE", help="write to FILE atomically (default: standard output)")
    p.add_argument("--url", metavar="URL", help="ask this daemon for the fleet instead of browsing the LAN")
    p.add_argument("--watch", action="store_true", help="keep running; rewrite FILE when daemons come and go")
    p.add_argument("--interval", type=o.positive_seconds, default=10.0, metavar="S",
                   help="with --watch: check every S seconds")
    p = o.command(esub, "dns-sd-zone", "gpusd.cli.discover:export_dns_sd_zone",
                  "print zone-file records (PTR, SRV, TXT, A) publishing the hosts found under _gpusd._tcp.DOMAIN",
                  parents=[*o.client(), o.browse(3.0, old="--timeout")])
    p.add_argument("--domain", required=True, help="the wide-area DNS-SD domain, e.g. lab.example")
    p.add_argument("--ttl", type=int, default=300, help="TTL of the records in seconds (default 300)")
