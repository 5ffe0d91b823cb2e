"""``gpusd report``: usage over a period, for this host or the whole fleet (docs/history.md)."""

# Imports inside functions: start-up (a command's own module).
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, GpusdError

if TYPE_CHECKING:  # pragma: no cover
    from ..wire.signing import FleetKey

LOCAL_URL = "http://127.0.0.1:4780"


def _time(text: str, flag: str) -> float:
    """``2026-11-01``, ``2026-11-01T08:00``, or seconds since the epoch (``flag``: named in the error)."""
    try:
        return float(text)
    except ValueError:
        pass
    from datetime import datetime

    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise ConfigError(f"{flag}: not a time: {text!r} (examples: 2026-11-01, 2026-11-01T08:00, "
                          "1793000000)") from None


def _period(args: argparse.Namespace) -> tuple[float, float]:
    from ..units import parse_duration

    end = _time(args.to, "--to") if args.to else time.time()
    if args.from_:
        start = _time(args.from_, "--from")
    else:
        try:
            start = end - parse_duration(args.since)
        except ValueError as exc:
            raise ConfigError(f"--since: {exc}") from None
    if not start < end:
        raise ConfigError("--from must be before --to")
    return start, end


def _from_db(path: Path, start: float, end: float, idle_after: float) -> dict[str, Any]:
    import sqlite3

    from ..usage.db import Retention, connect
    from ..usage.query import latest, usage

    try:
        conn = connect(path, readonly=True)
    except (sqlite3.Error, OSError) as exc:
        raise GpusdError(f"cannot read the history database {path}: {exc}") from None
    try:
        now = max(time.time(), latest(conn) or 0.0)
        host = conn.execute("SELECT host FROM gpus ORDER BY last DESC LIMIT 1").fetchone()
        return usage(conn, start, end, now, Retention(), True, idle_after, host[0] if host else None)
    except sqlite3.Error as exc:
        raise GpusdError(f"cannot read the history database {path}: {exc}") from None
    finally:
        conn.close()


def _from_url(url: str, start: float, end: float, key: FleetKey | None) -> dict[str, Any]:
    from urllib.parse import urlencode

    from ..discovery.fleetview import base_url
    from ..views.sources import get_json

    answer = get_json(f"{base_url(url)}/api/v1/history/usage?" + urlencode({"from": start, "to": end}), key,
                      timeout=30.0)
    if not isinstance(answer, dict):
        raise GpusdError(f"{url}: the usage answer is not an object")
    return answer


def _fleet_urls(url: str, key: FleetKey | None) -> list[str]:
    """The API bases of the fleet's live hosts, as the daemon at ``url`` lists them.  With the fleet
    secret, only hosts that proved they hold it (to a daemon that proved it to us) are asked: a
    stranger gets no signed request and its made-up figures never reach the report."""
    from ..discovery.fleetview import base_url
    from ..sanitize import for_terminal
    from ..views.sources import hosts_from_fleet
    from ..wire.fleet import MAX_FLEET_BYTES
    from ..wire.http import fetch_json

    answer = fetch_json(f"{base_url(url)}/api/v1/fleet", key, max_bytes=MAX_FLEET_BYTES)
    hosts = [h for h in hosts_from_fleet(answer.data, trusted=answer.verified) if h.alive and h.url]
    if key is None:
        return [h.url for h in hosts if h.url]
    left_out = [h.hostname for h in hosts if h.verified is not True]
    if left_out:
        names = ", ".join(for_terminal(n, 64) for n in left_out[:10]) + (" ..." if len(left_out) > 10 else "")
        print(f"gpusd report: left out {len(left_out)} unverified host(s): {names}", file=sys.stderr)
    urls = [h.url for h in hosts if h.verified is True and h.url]
    if not urls:
        raise GpusdError(f"no verified host in the fleet of {url}: none proved it holds the fleet secret")
    return urls


def report(args: argparse.Namespace) -> int:
    from ..errors import SourceError
    from ..usage.report import build
    from ..views.report import render
    from .trust import fleet_key

    key = fleet_key(args)
    start, end = _period(args)
    # say so before gathering anything
    if args.output and not Path(args.output).absolute().parent.is_dir():
        raise GpusdError(f"cannot write the report to {args.output}: no directory "
                         f"{Path(args.output).absolute().parent}")
    answers: list[dict[str, Any]] = []
    errors: list[str] = []
    if args.db:
        answers.append(_from_db(Path(args.db), start, end, args.idle_after))
    elif args.fleet or args.url:
        urls = list(args.url or [])
        if args.fleet:
            try:
                urls = _fleet_urls(urls[0] if urls else LOCAL_URL, key)
            except SourceError as exc:
                raise GpusdError(f"cannot read the fleet: {exc}") from None
        from concurrent.futures import ThreadPoolExecutor

        def one(u: str) -> dict[str, Any] | str:
            try:
                return _from_url(u, start, end, key)
            except (SourceError, GpusdError) as exc:
                return str(exc)

        with ThreadPoolExecutor(min(16, max(1, len(urls)))) as pool:
            for res in pool.map(one, urls):
                (errors.append(res) if isinstance(res, str) else answers.append(res))
    else:
        from ..identity import state_dir

        path = Path(args.state_dir) if args.state_dir else state_dir()
        db = path / "history.sqlite"
        if os.access(db, os.R_OK):
            answers.append(_from_db(db, start, end, args.idle_after))
        else:
            try:
                answers.append(_from_url(LOCAL_URL, start, end, key))
            except SourceError as exc:
                raise GpusdError(f"no history here: {db} is not readable and the local daemon does not answer "
                                 f"({exc}); use --url or --fleet") from None
    from ..sanitize import for_terminal

    for err in errors:
        print(f"gpusd: skipped a host: {for_terminal(err, 300)}", file=sys.stderr)
    if not answers:
        raise GpusdError("no host answered")
    text = render(build(answers, args.by), args.format)
    if args.output:
        _write_output(Path(args.output), text)
    else:
        sys.stdout.write(text)
    return 0


def _write_output(path: Path, text: str) -> None:
    """Write the report to ``path`` atomically: a new temporary file of our own beside it (never through
    a link someone left there), renamed over it; any failure is one line (``gpusd: cannot write ...``)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise GpusdError(f"cannot write the report to {path}: {exc.strerror or exc}") from None


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]", name: str) -> None:
    """The parser of ``gpusd report``."""
    from . import options as o

    p = o.command(sub, name, "gpusd.cli.report:report",
                  "usage report: GPU-hours used and held, idle reservations, utilisation, energy, top jobs",
                  parents=[o.state_dir(), o.token("sign requests: per-user figures and job owners from daemons that "
                                                  "prove they hold it")])
    when = p.add_argument_group("period")
    when.add_argument("--since", default="7d", metavar="DURATION", type=o.duration_text,
                      help="the last DURATION (default 7d; 12h, 30d...)")
    when.add_argument("--from", dest="from_", metavar="TIME", help="start (2026-11-01, 2026-11-01T08:00, epoch s)")
    when.add_argument("--to", metavar="TIME", help="end (default now)")
    p.add_argument("--by", choices=("user", "host", "gpu", "model"), default="user",
                   help="group by (default user; per-user figures need the token)")
    p.add_argument("--format", choices=("table", "csv", "json", "html"), default="table",
                   help="output format (html: one self-contained file with charts)")
    p.add_argument("-o", "--output", metavar="FILE", help="write to FILE (default: standard output)")
    srcs = p.add_mutually_exclusive_group()
    srcs.add_argument("--db", metavar="FILE", help="read this history database (default: the state directory's)")
    srcs.add_argument("--fleet", action="store_true",
                      help="every host of the fleet, as the daemon at --url (default this machine's) sees it")
    p.add_argument("--url", action="append", metavar="URL",
                   help="ask this daemon (repeatable; with --fleet: the daemon whose fleet to ask)")
    p.add_argument("--idle-after", type=o.positive_seconds, default=900.0, metavar="S",
                   help="with --db: flag leases held idle this long in all (default 900)")
