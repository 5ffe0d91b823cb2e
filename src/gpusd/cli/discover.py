"""``gpusd scan|list|watch``: what the LAN announces, every GPU with its live load, the event stream."""

# Imports inside functions: start-up (a command's own module).
from __future__ import annotations

import argparse
import shlex
import sys
import time
from itertools import groupby
from typing import TYPE_CHECKING, Any, Coroutine, Sequence, TypeVar

from ..errors import EXIT_NO_DAEMON, ConfigError
from ..model import display_name, shown_name
from ..sanitize import dumps, for_terminal
from ..units import format_bytes
from .table import render_table

T = TypeVar("T")

if TYPE_CHECKING:  # pragma: no cover
    from ..discovery.client import AsyncClient
    from ..discovery.fleetview import Reading
    from ..discovery.source import Listing
    from ..discovery.types import Device, RemoteHost


def _client(args: argparse.Namespace, **kw: Any) -> "AsyncClient":
    from ..discovery.client import AsyncClient
    from .trust import fleet_key

    return AsyncClient(
        session=args.session,
        all_sessions=args.all_sessions,
        key=fleet_key(args),
        interfaces=args.interfaces,
        **_filter_args(args),
        **beyond_args(args),
        **kw,
    )


def beyond_args(args: argparse.Namespace) -> dict[str, Any]:
    """``--peer``, ``--peers-file``, ``--dns-sd-domain``, ``--dns-server`` as AsyncClient arguments
    (absent flags: None, so the client reads the environment)."""
    return {"peers": getattr(args, "peers", None), "peers_file": getattr(args, "peers_file", None),
            "dns_sd_domain": getattr(args, "dns_sd_domain", None), "dns_server": getattr(args, "dns_server", None)}


def _filter_args(args: argparse.Namespace) -> dict[str, Any]:
    """The host and GPU filters of ``args`` (``hostname``, ``model``, ``min_free_memory``), checked."""
    from ..wire.txt import valid_session

    if not args.all_sessions and not valid_session(args.session):
        raise ConfigError(f"bad session name {args.session!r}")
    min_free = None
    if getattr(args, "min_free", None):
        from ..units import parse_memory

        try:
            min_free = int(parse_memory(args.min_free, ratio=False))
        except ValueError as exc:
            raise ConfigError(f"--min-free: {exc}") from None
    return {"hostname": args.host, "model": getattr(args, "model", None), "min_free_memory": min_free}


def run_loop(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coro)``, its result handed back outside the main task: Python's ``asyncio.run``
    (3.11) asks ``signal.getsignal`` for its SIGINT handler as it ends, which formats the handler's
    ``repr`` -- the main task and its result with it: 0.3 s of CPU for a list of 8,000 GPUs."""
    import asyncio

    box: list[T] = []

    async def main() -> None:
        box.append(await coro)

    asyncio.run(main())
    return box[0]


# -- scan ------------------------------------------------------------------------------------------
def scan(args: argparse.Namespace) -> int:
    async def go() -> tuple[list[RemoteHost], int]:
        client = _client(args)
        try:
            return await client.scan(args.browse), len(client.unmatched_hosts)
        finally:
            await client.stop_listening()

    hosts, unmatched = run_loop(go())
    if args.json:
        print(dumps([_scan_dict(h) for h in hosts], indent=1))
        return 0 if hosts else EXIT_NO_DAEMON
    if not hosts:
        where = "any session" if args.all_sessions else f"session {args.session!r}"
        print(_nothing_found(args, unmatched, f"no gpusd hosts announced in {where} (browsed {args.browse:g} s)"),
              file=sys.stderr)
        return EXIT_NO_DAEMON
    rows = []
    for h in hosts:
        t = h.txt
        rows.append([
            h.hostname, t.node_id[:16], t.session, str(t.count), "-" if t.free is None else str(t.free),
            _inventory(t.inventory) + ("  [SIMULATED]" if t.simulated else ""),
            f"{','.join(h.addresses) or '-'}:{h.port}" if h.source == "gpusd" else ",".join(h.addresses) or "-",
            h.source,
        ])
    print(render_table(["HOST", "NODE", "SESSION", "GPUS", "FREE", "INVENTORY", "ADDRESS", "SOURCE"], rows,
                       right=(3, 4)))
    return 0


def _nothing_found(args: argparse.Namespace, unmatched: int, otherwise: str) -> str:
    """Why nothing is listed: the --host filter left out every host found, or there was none."""
    if args.host and unmatched:
        return (f"gpusd: {unmatched} gpusd host(s) found, but none matched --host {args.host!r} "
                "(a glob on the host name, case-insensitive)")
    return f"gpusd: {otherwise}"


def _scan_dict(h: "RemoteHost") -> dict[str, Any]:
    return {"hostname": h.hostname, "node_id": h.node_id, "session": h.session, "source": h.source,
            "via": h.via, "addresses": h.addresses, "port": h.port, "service": h.key, "txt": h.txt.to_dict()}


def export_dns_sd_zone(args: argparse.Namespace) -> int:
    """``gpusd export dns-sd-zone --domain lab.example``: zone-file lines publishing the hosts found
    (wide-area DNS-SD, docs/daemon.md "Beyond one link")."""
    from ..discovery.beyond import valid_domain, zone_records

    domain = valid_domain(args.domain)
    if not 0 < args.ttl <= 86400:
        raise ConfigError("--ttl must be between 1 and 86400 seconds")

    async def go() -> list[RemoteHost]:
        client = _client(args)
        try:
            return await client.scan(args.browse)
        finally:
            await client.stop_listening()

    lines = zone_records(run_loop(go()), domain, int(args.ttl))
    if not lines:
        print("gpusd: no gpusd host with an IPv4 address found", file=sys.stderr)
        return EXIT_NO_DAEMON
    print("\n".join(lines))
    return 0


def _inventory(inv: Sequence[tuple[str, int | None]]) -> str:
    """``4x A100-SXM4-80GB (80GiB), 2x RTX 4090 (24GiB)``."""
    if not inv:
        return "-"
    parts: list[str] = []
    for (model, mib), run in groupby(inv):
        mem = f" ({format_bytes(mib * 2**20)})" if mib else ""
        parts.append(f"{len(list(run))}x {display_name(model)}{mem}")
    return ", ".join(parts)


# -- list ------------------------------------------------------------------------------------------
def list_devices(args: argparse.Namespace) -> int:
    from ..localdaemon import may_run

    local = None
    if args.all_sessions or not may_run():
        from ..discovery import oneshot

        # no local daemon to ask: the browse will need them
        oneshot.prefetch_imports()
    else:
        local = _ask_local_daemon(args)
    from ..discovery.fleetsource import choose

    if args.json and local is not None and local.arrived():
        # the devices straight from the daemon's JSON: no model object on the way
        rows = local.rows()
        if rows is not None:
            print(json_list(rows[0]))
            return 0 if rows[1] else EXIT_NO_DAEMON
    devices, hosts, unmatched = choose(local, lambda slow: _browse(args, slow))
    if args.json:
        print(json_list([d.to_dict() for d in devices]))
        return 0 if hosts else EXIT_NO_DAEMON
    if not hosts:
        where = "any session" if args.all_sessions else f"session {args.session!r}"
        start = "gpusd start" + ("" if args.all_sessions or args.session == "default" else
                                 f" --session {shlex.quote(args.session)}")
        print(_nothing_found(args, unmatched, f"no gpusd hosts found in {where}; is a daemon running "
                             f"({for_terminal(start, 200)})? Try gpusd demo."), file=sys.stderr)
        return EXIT_NO_DAEMON
    print(render_devices(devices, hosts))
    return 0


def json_list(items: Sequence[Any]) -> str:
    """A JSON array with one item a line: the C encoder writes each (``indent`` would take Python's
    own encoder, 4-5x slower: 0.5 s for 8,000 GPUs), strict JSON as :func:`gpusd.sanitize.dumps`."""
    if not items:
        return "[]"
    return "[\n" + ",\n".join(dumps(item) for item in items) + "\n]"


def _browse(args: argparse.Namespace, local: Reading | None) -> Listing:
    """The one-shot browse (:mod:`gpusd.discovery.oneshot`); the local daemon's fleet view instead
    where ``local``, asked already, answers first or within its bound."""
    from ..discovery import oneshot
    from ..discovery.fleetsource import race

    return run_loop(race(local, oneshot.browse_settled(lambda **kw: _client(args, **kw), args.interfaces,
                                                       args.browse)))


def _ask_local_daemon(args: argparse.Namespace) -> Reading | None:
    """Ask this host's own daemon for its fleet view (:func:`gpusd.discovery.fleetsource.ask_local_daemon`,
    docs/daemon.md) with the options given: none when hosts beyond the link are asked for (``--peer`` &
    co., or their variables); the interfaces must be the daemon's (``--interface eth9`` is checked first:
    exit 2 when there is no such interface, as when browsing)."""
    from ..discovery.fleetsource import ask_local_daemon, beyond_link
    from ..discovery.types import Filters
    from ..wire.mdns import resolve_interfaces
    from .trust import fleet_key

    filters = Filters(session=args.session, **_filter_args(args))
    # ConfigError (exit 2) for an interface that is not there
    interfaces = resolve_interfaces(args.interfaces)
    beyond = beyond_args(args)
    if beyond_link(beyond["peers"], beyond["peers_file"], beyond["dns_sd_domain"]):
        # before the fleet secret is read: it is not needed
        return None
    return ask_local_daemon(filters, key=fleet_key(args), interfaces=interfaces)


def render_devices(devices: Sequence["Device"], hosts: Sequence["RemoteHost"]) -> str:
    """The ``gpusd list`` table: one row per GPU, grouped by host."""
    rows: list[list[str]] = []
    booked = {h.node_id: h.snapshot.bookings for h in hosts if h.snapshot is not None and h.snapshot.bookings}
    for d in devices:
        g = d.gpu
        if d.live:
            mem = (f"{format_bytes(g.memory_used)} / {format_bytes(g.memory_total)}"
                   if g.memory_total is not None else "-")
            util = f"{g.utilization_gpu:.0f}%" if g.utilization_gpu is not None else "-"
            temp = f"{g.temperature}C" if g.temperature is not None else "-"
            power = f"{g.power_draw:.0f}W" if g.power_draw is not None else "-"
            if not g.healthy:
                state = f"UNHEALTHY: {g.error or '?'}"[:40]
            elif g.leases:
                state = "leased"
                remote = [le for le in g.leases if le.expires is not None]
                # held by a daemon for a remote holder (docs/pool.md): who, and for how long
                if remote:
                    # the user is private (hidden from an unverified reader); how long the reservation
                    # lasts (its holder's --for), else that its holder renews it (the TTL is no end)
                    who = for_terminal(remote[0].user, 24)
                    ends = remote[0].ends
                    until = (f"until {time.strftime('%H:%M', time.localtime(ends))}" if ends is not None
                             and ends > time.time() else "renewed")
                    state = f"reserved{' by ' + who if who else ''} ({until})"
            elif g.processes:
                state = f"{len(g.processes)} proc"
            elif g.is_free:
                state = "free"
            else:
                state = "busy" if g.utilization_gpu is not None else "no reading"
        else:
            mem = util = temp = power = "-"
            state = "announced (hwsd)"
        name = shown_name(g.name, g.vendor)
        state += booking_note(booked.get(d.node_id, []), g.index)
        if d.simulated:
            state += " [sim]"
        # its daemon proved it is another host: a copy of that one's announcement
        if d.copy_of is not None:
            state += f" [unverified: a copy of {for_terminal(d.copy_of, 64)}]"
        elif d.verified is False:
            # did not prove it holds the fleet secret: maybe a stranger
            state += " [unverified]"
        rows.append([d.hostname, str(g.index), name, mem, util, temp, power, state])
    table = render_table(["HOST", "IDX", "NAME", "MEMORY", "UTIL", "TEMP", "POWER", "STATE"], rows, right=(1, 4, 5, 6))
    n_gpus = len(devices)
    footer = f"{len(hosts)} host(s), {n_gpus} GPU(s)"
    if any(d.simulated for d in devices):
        footer += "  (SIMULATED GPUs marked [sim])"
    if any(d.verified is False for d in devices):
        footer += "  ([unverified]: the host did not prove it holds the fleet secret)"
    return table + "\n" + footer


def booking_note(bookings: Sequence[Any], index: int, now: float | None = None) -> str:
    """`` [booked 14:00-16:00]``: the next booking of the GPU ``index`` (docs/pool.md, "Time"), ``held``
    while the daemon holds it for its booker; empty when none."""
    now = time.time() if now is None else now
    mine = sorted((b for b in bookings if index in b.indices and b.end > now), key=lambda b: b.start)
    if not mine:
        return ""
    b = mine[0]
    day = "%Y-%m-%d %H:%M" if time.localtime(b.start)[:3] != time.localtime(now)[:3] else "%H:%M"
    span = f"{time.strftime(day, time.localtime(b.start))}-{time.strftime('%H:%M', time.localtime(b.end))}"
    who = for_terminal(b.user, 24) if b.user else ""
    return f" [{'held for' if b.held else 'booked'}{' ' + who if who else ''} {span}]"


# -- watch -----------------------------------------------------------------------------------------
def watch(args: argparse.Namespace) -> int:
    import asyncio

    # 0 or less: every host would be removed right after it is added, over and over
    if not args.liveness > 0:
        raise ConfigError(f"--liveness must be a positive number of seconds, not {args.liveness:g}")
    async def go() -> None:
        client = _client(args, liveness_timeout=args.liveness)
        await client.start_listening()
        try:
            events = client.events()
            end = time.monotonic() + args.duration if args.duration else None
            while True:
                timeout = None if end is None else end - time.monotonic()
                if timeout is not None and timeout <= 0:
                    return
                try:
                    ev = await asyncio.wait_for(events.__anext__(), timeout)
                except (asyncio.TimeoutError, StopAsyncIteration):
                    return
                if args.json:
                    line = dumps(ev.to_dict(), separators=(",", ":"))
                else:
                    # names, users and commands from the LAN: sanitised, and the line bounded
                    line = f"{time.strftime('%H:%M:%S', time.localtime(ev.ts))} {for_terminal(ev, 512)}"
                print(line, flush=True)
        finally:
            await client.stop_listening()

    # Ctrl-C: main() says "interrupted" and exits 130, as documented
    asyncio.run(go())
    return 0


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]", name: str) -> None:
    """The parsers of ``gpusd scan``, ``list`` (and the seed's ``list_devices``) and ``watch``."""
    from . import options as o

    if name == "scan":
        o.command(sub, name, "gpusd.cli.discover:scan", "list the hosts announced on the LAN (mDNS)",
                  parents=[*o.client(), o.browse(2.0, old="--timeout"), o.json_output()])
        return
    if name in ("list", "list_devices"):
        p = o.command(sub, name, "gpusd.cli.discover:list_devices",
                      "every GPU on the LAN with its live load" if name == "list"
                      else "every GPU on the LAN (alias of list)",
                      parents=[*o.client(model=True), o.browse(3.0, old="--timeout"), o.json_output()])
    else:
        p = o.command(sub, name, "gpusd.cli.discover:watch", "print discovery events as they happen, one per line",
                      parents=[*o.client(model=True), o.json_output("one JSON object per line")])
        p.add_argument("--duration", type=o.positive_seconds, default=None, metavar="S", help="stop after S seconds")
        p.add_argument("--liveness", type=o.positive_seconds, default=10.0, metavar="S",
                       help="report a silent host removed after S seconds (default 10)")
    p.add_argument("--min-free", metavar="MEM", help="only GPUs with at least this much free memory (20GiB)")
