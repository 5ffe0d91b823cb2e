"""``gpusd reserve``, ``gpusd release``, ``gpusd reservations`` and ``gpusd run --fleet`` (docs/pool.md)."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Sequence

from ..errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from ..discovery.sync import Client
    from ..discovery.types import RemoteHost
    from ..pool.client import HostLease, Reservation
    from ..wire.signing import FleetKey

REMOTE_PID = "gpusd-remote-pid"


def _key(args: argparse.Namespace) -> FleetKey:
    from .trust import fleet_key

    key = fleet_key(args)
    if key is None:
        raise ConfigError("the fleet pool needs the fleet secret: --token-file FILE, $GPUSD_TOKEN_FILE or $GPUSD_TOKEN")
    return key


def _client(args: argparse.Namespace, key: FleetKey) -> Client:
    """The discovery client of a pool command: mDNS on the link, plus --peer & co. beyond it."""
    from ..discovery.sync import Client
    from .discover import beyond_args

    return Client(args.session, interfaces=args.interfaces, key=key, **beyond_args(args))


def _hosts(args: argparse.Namespace, key: FleetKey) -> list[RemoteHost]:
    client = _client(args, key)
    try:
        client.wait_settled(3.0)
        return client.hosts
    finally:
        client.stop_listening()


def _reserve(args: argparse.Namespace, key: FleetKey, note: str | None, client: Client | None = None
             ) -> Reservation:
    from ..alloc.select import constraints_from_args
    from ..pool.client import reserve

    c = constraints_from_args(args)
    per = getattr(args, "per_host", None)
    if args.timeout is not None and not args.wait:
        raise ConfigError("--timeout only makes sense with --wait")
    return reserve(c.count, per_host=per, constraints=c, host=args.host, model=args.model, session=args.session,
                   interfaces=args.interfaces, ttl=args.ttl, note=note, wait=args.wait, timeout=args.timeout,
                   key=key, client=client)


def _exports(env: dict[str, str]) -> list[str]:
    return [f"export {k}={shlex.quote(v)}" for k, v in env.items()]


def reserve(args: argparse.Namespace) -> int:
    from ..sanitize import dumps, for_terminal
    from ..usage.query import parse_duration

    try:
        duration = parse_duration(args.duration)
    except ValueError as exc:
        raise ConfigError(f"--for: {exc}") from None
    from .trust import secret

    key = _key(args)
    client = _client(args, key)
    try:
        res = _reserve(args, key, args.note, client)
        until = time.time() + duration
        pid = _start_renewer(res, secret(args) or "", until)  # before anything slow: the TTL runs
    finally:
        client.stop_listening()
    if args.json:
        print(dumps({**res.to_dict(), "until": until, "renewer_pid": pid}, indent=2))
    else:
        for p in res.parts:
            where = "this machine" if p.local else for_terminal(p.hostname, 64)
            print(f"reserved {len(p.devices)} GPU(s) on {where}: lease {p.lease_id} until "
                  f"{time.strftime('%H:%M:%S', time.localtime(until))} (renewed by pid {pid}; "
                  f"gpusd release {p.lease_id} to end it)")
            for line in _exports({k: v for k, v in p.env.items()}):
                print("  " + line)
    sys.stdout.flush()
    return 0


def _start_renewer(res: Reservation, fleet_secret: str, until: float) -> int:
    """Start ``python -m gpusd.pool.renewer`` in its own session, the lease(s) and the secret on its
    stdin (never argv or the environment); returns its pid."""
    import json
    import select

    proc = subprocess.Popen([sys.executable, "-m", "gpusd.pool.renewer"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
                            close_fds=True)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps({"secret": fleet_secret, "until": until,
                                 "leases": [p.to_dict() for p in res.parts]}).encode())
    proc.stdin.close()
    # return once it renews (a SIGTERM from now on releases the lease), at most 10 s
    ready, _, _ = select.select([proc.stdout], [], [], 10.0)
    line = proc.stdout.readline() if ready else b""
    proc.stdout.close()
    if line.strip() != b"renewing":
        import logging

        logging.getLogger("gpusd.pool").warning("the renewer did not start: the lease ends with its TTL")
    return proc.pid


def _mine(d: dict[str, Any]) -> bool:
    import getpass

    holder = d.get("user")
    return isinstance(holder, str) and holder.split("@")[0] == getpass.getuser()


def release(args: argparse.Namespace) -> int:
    from ..errors import GpusdError
    from ..pool.client import HostLease, Reservation, reservations

    key = _key(args)
    found = reservations(key, _hosts(args, key), mine=lambda d: d.get("lease_id") == args.lease_id)
    if not found:
        raise GpusdError(f"no reservation {args.lease_id!r} on the fleet (released, or expired)")
    for d in found:
        Reservation([HostLease.from_dict(d)], key).release()
        print(f"released {args.lease_id} on {d.get('host')}")
    return 0


def reservations(args: argparse.Namespace) -> int:
    from ..pool.client import reservations as listing
    from ..sanitize import dumps, for_terminal
    from .table import render_table

    key = _key(args)
    found = listing(key, _hosts(args, key), mine=None if args.all else _mine)
    if args.json:
        print(dumps({"reservations": found}, indent=2))
        return 0
    now = time.time()
    rows = [[for_terminal(str(d.get("lease_id")), 16), for_terminal(str(d.get("host")), 32),
             ",".join(str(x.get("index")) for x in d.get("devices") or [] if isinstance(x, dict)),
             for_terminal(str(d.get("user")), 40), for_terminal(str(d.get("remote_from")), 40),
             f"{max(0.0, float(d.get('expires') or now) - now):.0f}s",
             for_terminal(str(d.get("command") or "-"), 40)] for d in found]
    if not rows:
        print("no reservations" + ("" if args.all else " of yours (--all: everyone's)"))
        return 0
    print(render_table(["LEASE", "HOST", "GPUS", "HOLDER", "FROM", "EXPIRES IN", "NOTE"], rows))
    return 0


# -- gpusd run --fleet ----------------------------------------------------------------------------
from ..alloc.runner import FORWARDED as FORWARDED  # noqa: E402  (one list of the signals a runner passes on)


def ssh_base(options: Sequence[str]) -> list[str]:
    argv = ["ssh"]
    config = os.environ.get("GPUSD_SSH_CONFIG")
    if config:
        argv += ["-F", config]
    for opt in options:
        argv += ["-o", opt]
    return argv


def remote_script(env: dict[str, str], cmd: Sequence[str]) -> str:
    """What the remote shell runs: say its pid (for signals), set the environment, exec CMD."""
    exports = "; ".join(f"export {k}={shlex.quote(v)}" for k, v in env.items())
    return f"printf '{REMOTE_PID} %s\\n' \"$$\" >&2; {exports}; exec {shlex.join(cmd)}"


def run_fleet(args: argparse.Namespace, cmd: list[str]) -> int:
    from ..alloc.runner import _interactive

    key = _key(args)
    client = _client(args, key)
    try:
        res = _reserve(args, key, shlex.join(cmd)[:512], client)
        # renew from the moment the GPUs are ours: stopping discovery can outlast a short TTL
        res.start_renewing()
    finally:
        client.stop_listening()
    try:
        part = res.parts[0]
        if part.local:
            return _run_here(part, cmd, _interactive())
        return _run_over_ssh(part, cmd, args.ssh_option)
    finally:
        res.release()


def _run_here(part: HostLease, cmd: list[str], interactive: bool) -> int:
    env = dict(os.environ)
    env.update(part.env)
    try:
        proc = subprocess.Popen(cmd, env=env)
    except FileNotFoundError:
        print(f"gpusd: command not found: {cmd[0]}", file=sys.stderr)
        return 127
    return _wait(proc, lambda sig: proc.send_signal(sig), interactive)


def _wait(proc: subprocess.Popen[Any], send: Any, interactive: bool) -> int:
    from ..alloc.runner import wait_forwarding

    return wait_forwarding(proc, send, interactive)


def _run_over_ssh(part: HostLease, cmd: list[str], options: Sequence[str]) -> int:
    base = ssh_base(options)
    tty = os.isatty(0)
    argv = [*base, *(["-tt"] if tty else ["-T"]), "--", part.hostname, remote_script(part.env, cmd)]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, start_new_session=not tty)
    remote_pid: list[int] = []
    assert proc.stderr is not None
    err = proc.stderr

    def pump() -> None:
        first = True
        out = sys.stderr.buffer
        for line in iter(err.readline, b""):
            if first and line.startswith(REMOTE_PID.encode()):
                first = False
                try:
                    remote_pid.append(int(line.split()[1]))
                except (IndexError, ValueError):
                    pass
                continue
            out.write(line)
            out.flush()

    t = threading.Thread(target=pump, daemon=True)
    t.start()

    def send(signum: int) -> None:
        if not remote_pid:  # not started yet: end the connection
            proc.send_signal(signal.SIGTERM)
            return
        name = signal.Signals(signum).name.removeprefix("SIG")
        subprocess.Popen([*base, "-T", "--", part.hostname, f"kill -s {name} {remote_pid[0]}"],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    rc = _wait(proc, send, tty)
    t.join(2)
    return rc
