"""``gpusd top`` and ``gpusd export prometheus-sd``."""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from typing import TYPE_CHECKING

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
    source = _source(args, settle=args.wait)
    from ..units import parse_duration
    from ..views.spark import Sparks  # utilisation over the last hour, from the daemons' history

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
    from ..wire.promsd import Daemon

    if args.watch and not args.output:
        raise ConfigError("--watch needs --output FILE (Prometheus re-reads the file when it changes)")
    if args.interval <= 0:
        raise ConfigError("--interval must be a positive number of seconds")
    session = None if args.all_sessions else args.session

    source = None if args.url else _source(args, settle=args.wait)

    from ..wire.promsd import daemons_from_hosts

    def daemons() -> list[Daemon]:
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
                except OSError as exc:  # no such directory, no permission: one line, not a traceback
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
