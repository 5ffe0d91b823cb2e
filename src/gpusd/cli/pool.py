"""``gpusd reserve``, ``gpusd release``, ``gpusd reservations`` and ``gpusd run --fleet`` (docs/pool.md)."""

# Imports inside functions: start-up (a command's own module).
from __future__ import annotations

import argparse
import os
import re
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
    from .trust import MAKE_ONE, fleet_key

    key = fleet_key(args)
    if key is None:
        raise ConfigError("the fleet pool needs the fleet secret (--token-file FILE, $GPUSD_TOKEN_FILE or "
                          f"$GPUSD_TOKEN), and none was given; {MAKE_ONE}")
    return key


def _client(args: argparse.Namespace, key: FleetKey, pace: float | None = None) -> Client:
    """The discovery client of a pool command: mDNS on the link, plus --peer & co. beyond it
    (``pace``: what it asks of each host's event stream, docs/wire-format.md)."""
    from ..discovery.sync import Client
    from .discover import beyond_args

    return Client(args.session, interfaces=args.interfaces, key=key, pace=pace, **beyond_args(args))


def say_unverified(hosts: Sequence[RemoteHost]) -> None:
    """Once per command, how many hosts the pool left out because they did not prove they hold
    the fleet secret (``-v`` logs each one)."""
    from ..sanitize import for_terminal

    names = sorted({for_terminal(h.hostname, 64) for h in hosts if h.verified is False})
    if names:
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        print(f"gpusd: left out {len(names)} host(s) that did not prove they hold the fleet secret: {shown}",
              file=sys.stderr)


def _hosts(args: argparse.Namespace, key: FleetKey) -> list[RemoteHost]:
    client = _client(args, key)
    try:
        client.wait_settled(3.0)
        say_unverified(client.hosts)
        return client.hosts
    finally:
        client.stop_listening()


def _reserve(args: argparse.Namespace, key: FleetKey, note: str | None, client: Client | None = None,
             job: str | None = None) -> Reservation:
    from ..pool.client import reserve
    from .options import to_constraints, wait_timeout

    c = to_constraints(args)
    per = getattr(args, "per_host", None)
    timeout = wait_timeout(args)
    try:
        return reserve(c.count, per_host=per, constraints=c, host=args.host, model=args.model,
                       session=args.session, interfaces=args.interfaces, ttl=args.ttl, note=note, wait=args.wait,
                       timeout=timeout, key=key, client=client, job=job)
    finally:
        if client is not None:
            say_unverified(client.hosts)


def fleet_selectors(args: argparse.Namespace) -> list[str]:
    """The options of this command that say where it looked and with which secret (--token-file,
    --session, --interface, --peer, --peers-file, --dns-sd-domain, --dns-server), as given: a hint
    that names another command names them too, so that it acts on what this one acted on."""
    from pathlib import Path

    out: list[str] = []
    token_file = getattr(args, "token_file", None) or os.environ.get("GPUSD_TOKEN_FILE")
    if token_file:
        out += ["--token-file", str(Path(token_file).resolve())]
    if getattr(args, "session", "default") != "default":
        out += ["--session", str(args.session)]
    for iface in getattr(args, "interfaces", None) or []:
        out += ["--interface", str(iface)]
    for peer in getattr(args, "peers", None) or []:
        out += ["--peer", str(peer)]
    for flag, name in (("--peers-file", "peers_file"), ("--dns-sd-domain", "dns_sd_domain"),
                       ("--dns-server", "dns_server")):
        value = getattr(args, name, None)
        if value:
            out += [flag, str(Path(value).resolve()) if name == "peers_file" else str(value)]
    return out


def release_command(args: argparse.Namespace, lease_id: str) -> str:
    """``gpusd release ID`` with :func:`fleet_selectors` (for hints), safe to paste and to show."""
    from ..sanitize import for_terminal
    from . import prog

    return for_terminal(shlex.join([prog(), "release", lease_id, *fleet_selectors(args)]), 2000)


def _exports(env: dict[str, str]) -> list[str]:
    return [f"export {k}={shlex.quote(v)}" for k, v in env.items()]


def reserve(args: argparse.Namespace) -> int:
    from ..sanitize import dumps, for_terminal
    from ..units import parse_duration

    try:
        duration = parse_duration(args.duration)
    except ValueError as exc:
        raise ConfigError(f"--for: {exc}") from None
    from ..units import format_clock
    from .trust import secret

    if getattr(args, "at", None) is not None:
        return book(args, duration)
    key = _key(args)
    client = _client(args, key)
    try:
        res = _reserve(args, key, args.note, client)
        until = time.time() + duration
        # before anything slow: the TTL runs
        pid = _start_renewer(res, secret(args) or "", until)
    finally:
        client.stop_listening()
    if args.json:
        print(dumps({**res.to_dict(), "until": until, "renewer_pid": pid}, indent=2))
    else:
        for p in res.parts:
            where = "this machine" if p.local else for_terminal(p.hostname, 64)
            print(f"reserved {len(p.devices)} GPU(s) on {where}: lease {p.lease_id} until "
                  f"{format_clock(until)} (renewed by pid {pid}; "
                  f"{release_command(args, p.lease_id)} to end it)")
            for line in _exports({k: v for k, v in p.env.items()}):
                print("  " + line)
    sys.stdout.flush()
    return 0


def book(args: argparse.Namespace, duration: float) -> int:
    """``gpusd reserve --at WHEN --for DUR``: book GPUs of one host ahead (docs/pool.md, "Time"); its
    daemon holds them for us from WHEN to WHEN + DUR, nothing of ours needs to run meanwhile."""
    from ..pool.client import book as book_on
    from ..sanitize import dumps, for_terminal
    from ..units import format_clock, parse_when

    now = time.time()
    try:
        start = parse_when(args.at, now)
    except ValueError as exc:
        raise ConfigError(f"--at: {exc}") from None
    if start <= now:
        raise ConfigError(f"--at {args.at}: WHEN is in the past ({format_clock(start)}): a booking starts later")
    from .options import to_constraints

    c = to_constraints(args)
    key = _key(args)
    include = [str(x) for x in c.include] if c.include else None
    d = book_on(c.count, start, duration, _hosts(args, key), key, host=args.host, note=args.note, include=include)
    if args.json:
        print(dumps({"booking": d}, indent=2))
        return 0
    bid = for_terminal(str(d.get("booking_id")), 16)
    gpus = ",".join(str(i) for i in d.get("indices") or [])
    print(f"booked GPU {gpus} on {for_terminal(str(d.get('host')), 64)} from {format_clock(float(d['start']))} to "
          f"{format_clock(float(d['end']))}: booking {bid} (the host holds them for you from then on: gpusd "
          f"reservations shows the lease; {release_command(args, bid)} cancels it)")
    return 0


def _start_renewer(res: Reservation, fleet_secret: str, until: float, extra: dict[str, Any] | None = None) -> int:
    """Start ``python -m gpusd.pool.renewer`` in its own session, the lease(s) and the secret on its
    stdin (never argv or the environment); returns its pid.  ``extra``: the renewer's optional fields
    (``at_end``, ``forget``: gpusd.pool.renewer)."""
    import json
    import select

    proc = subprocess.Popen([sys.executable, "-m", "gpusd.pool.renewer"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
                            close_fds=True)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps({**(extra or {}), "secret": fleet_secret, "until": until,
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

    from ..pool.client import default_holder

    # the account the host attributed the lease to (docs/security.md "Identity")
    holder = d.get("user")
    if isinstance(holder, str) and holder.split("@")[0] == getpass.getuser():
        return True
    # a lease taken without a user key: the name we declared
    return d.get("claimed") == default_holder()


def release(args: argparse.Namespace) -> int:
    from ..pool.client import HostLease, Reservation, reservations

    key = _key(args)
    if _release_remembered(args.lease_id, key):
        return 0
    hosts = _hosts(args, key)
    found = reservations(key, hosts, mine=lambda d: d.get("lease_id") == args.lease_id)
    if not found:
        return _cancel_booking(args.lease_id, key, hosts)
    for d in found:
        Reservation([HostLease.from_dict(d)], key).release()
        print(f"released {args.lease_id} on {d.get('host')}")
    return 0


def _cancel_booking(booking_id: str, key: FleetKey, hosts: list[RemoteHost]) -> int:
    """``gpusd release ID`` of a booking (gpusd reserve --at): its host cancels it (and its hold)."""
    from ..errors import GpusdError
    from ..pool.client import bookings, cancel_booking, refusal
    from ..sanitize import for_terminal

    found = bookings(key, hosts, mine=lambda d: d.get("booking_id") == booking_id)
    if not found:
        raise GpusdError(f"no reservation or booking {booking_id!r} on the fleet (released, cancelled, or over)")
    for d in found:
        reply = cancel_booking(d, key)
        where = for_terminal(str(d.get("host")), 64)
        if reply.status != 200:
            raise refusal(reply, f"{where}: cancelling booking {booking_id} failed (HTTP {reply.status})")
        print(f"cancelled booking {for_terminal(booking_id, 16)} on {where}")
    return 0


def _release_remembered(lease_id: str, key: FleetKey) -> bool:
    """Release a reservation made from this machine where it was made (its renewer's record: the
    host's address as it was when the host granted it, found by mDNS, ``--peer`` or DNS-SD alike).
    False when there is no record; an error when the host says it has no such lease or cannot be reached."""
    from ..errors import GpusdError
    from ..pool.client import HostLease, _call
    from ..pool.renewer import forget, recall
    from ..sanitize import for_terminal

    rec = recall(lease_id.strip().lower())
    if rec is None:
        return False
    try:
        part = HostLease.from_dict(rec["lease"])
    except (KeyError, TypeError, ValueError):
        return False
    where = for_terminal(part.hostname, 64)
    reply = _call("DELETE", part, f"/leases/{part.lease_id}", key)
    if reply.status == 404:
        forget(part.lease_id)
        raise GpusdError(f"no reservation {part.lease_id} on {where} any more (released, or expired)")
    if reply.status not in (200, 204):
        from ..pool.client import refusal

        raise refusal(reply, f"{where}: releasing {part.lease_id} failed (HTTP {reply.status})")
    # its renewer sees the lease gone at its next renewal and stops
    forget(part.lease_id)
    print(f"released {part.lease_id} on {where}")
    return True


def reservations(args: argparse.Namespace) -> int:
    from ..pool.client import bookings as booked
    from ..pool.client import reservations as listing
    from ..sanitize import dumps, for_terminal
    from .table import render_table

    key = _key(args)
    hosts = _hosts(args, key)
    found = listing(key, hosts, mine=None if args.all else _mine)
    ahead = sorted(booked(key, hosts, mine=None if args.all else _my_booking),
                   key=lambda d: (float(d.get("start") or 0), str(d.get("host"))))
    if getattr(args, "ics", None):
        from ..pool.calendar import write_ics

        write_ics(args.ics, [d for d in ahead if _my_booking(d)])
        print(f"wrote {len([d for d in ahead if _my_booking(d)])} booking(s) to {for_terminal(args.ics, 200)}")
        return 0
    if args.json:
        print(dumps({"reservations": found, "bookings": ahead}, indent=2))
        return 0
    from ..units import format_duration

    now = time.time()

    def ends(d: dict[str, Any]) -> str:
        """When the reservation ends: the end its holder announced (--for), else with its holder
        (a run or launch holds it while it runs; the lease ends a TTL after its last renewal)."""
        end, expires = d.get("ends"), d.get("expires")
        if isinstance(end, (int, float)) and not isinstance(end, bool):
            return "in " + format_duration(float(end) - now)
        ok = isinstance(expires, (int, float)) and not isinstance(expires, bool)
        ttl = f" (ttl {format_duration(float(expires) - now)})" if ok else ""  # type: ignore[arg-type]
        return "with its holder" + ttl

    rows = [[for_terminal(str(d.get("lease_id")), 16), for_terminal(str(d.get("host")), 32),
             ",".join(str(x.get("index")) for x in d.get("devices") or [] if isinstance(x, dict)),
             for_terminal(str(d.get("user")), 40), for_terminal(str(d.get("remote_from")), 40),
             ends(d), for_terminal(str(d.get("command") or "-"), 40)] for d in found]
    if not rows and not ahead:
        print("no reservations" + ("" if args.all else " of yours (--all: everyone's)"))
        return 0
    if rows:
        print(render_table(["LEASE", "HOST", "GPUS", "HOLDER", "FROM", "ENDS", "NOTE"], rows))
    if ahead:
        from ..units import format_clock

        print(render_table(["BOOKING", "HOST", "GPUS", "BOOKER", "START", "END", "STATE", "NOTE"], [
            [for_terminal(str(d.get("booking_id")), 16), for_terminal(str(d.get("host")), 32),
             ",".join(str(i) for i in d.get("indices") or [] if isinstance(i, int)),
             for_terminal(str(d.get("user")), 40), _clock(d.get("start"), format_clock),
             _clock(d.get("end"), format_clock), "held" if d.get("held") is True else
             "started" if _number(d.get("start")) <= now else "ahead",
             for_terminal(str(d.get("note") or "-"), 40)] for d in ahead]))
    return 0


def _number(v: object) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


def _clock(v: object, fmt: Any) -> str:
    return str(fmt(float(v))) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def _my_booking(d: dict[str, Any]) -> bool:
    """A booking of the account our signatures act as (``$GPUSD_ACCOUNT``, else our login name)."""
    from ..wire.sshsig import account_of

    return d.get("user") == account_of(None)


# -- gpusd run --fleet ----------------------------------------------------------------------------


def ssh_base(options: Sequence[str]) -> list[str]:
    argv = ["ssh"]
    config = os.environ.get("GPUSD_SSH_CONFIG")
    if config:
        argv += ["-F", config]
    for opt in options:
        argv += ["-o", opt]
    return argv


def remote_script(env: dict[str, str], cmd: Sequence[str], job: Sequence[str] = ()) -> str:
    """What the remote shell runs: say its pid (for signals), set the environment, exec CMD — under
    ``job`` (``gpusd fleet-job ... --``, which registers the job there) where the gpusd on that host's
    PATH has ``fleet-job`` (asked first: about 35 ms); the pid line then ends with ``job``."""
    exports = "; ".join(f"export {k}={shlex.quote(v)}" for k, v in env.items())
    if not job:
        return f"printf '{REMOTE_PID} %s\\n' \"$$\" >&2; {exports}; exec {shlex.join(cmd)}"
    probe = shlex.join([job[0], job[1], "--help"])
    return (f"gpusd_job=; if {probe} >/dev/null 2>&1 </dev/null; then gpusd_job=job; fi; "
            f"printf '{REMOTE_PID} %s %s\\n' \"$$\" \"$gpusd_job\" >&2; {exports}; "
            f"if [ -n \"$gpusd_job\" ]; then exec {shlex.join([*job, *cmd])}; fi; exec {shlex.join(cmd)}")


def fleet_job_argv(job_id: str, asker: str, part: HostLease) -> list[str]:
    """The remote entry point of a fleet run (``gpusd fleet-job``, docs/jobs.md), up to ``--``; empty
    (the command runs as it is) when the daemon's answer names no well-formed GPU."""
    import json

    from ..jobs.fleet import valid_devices

    # the daemon's answer: typed and bounded before it is passed on
    devices = valid_devices(part.devices)
    if not devices:
        return []
    return ["gpusd", "fleet-job", "--job", job_id, "--from", asker, "--lease", part.lease_id,
            "--devices", json.dumps(devices, separators=(",", ":")), "--"]


def run_fleet(args: argparse.Namespace, cmd: list[str]) -> int:
    from ..alloc.runner import _interactive
    from ..identity import hostname
    from ..ids import JobId
    from ..jobs.fleet import FleetJob, clean_host

    key = _key(args)
    command = shlex.join(cmd)[:512]
    asker = clean_host(hostname())
    # the run is a job here from the start (queued while it looks for GPUs); the same id names it
    # on the host that runs it, and in that host's lease record
    job = FleetJob(JobId.new(), command, asker)
    try:
        client = _client(args, key)
        try:
            res = _reserve(args, key, command, client, job=job.job_id)
            # renew from the moment the GPUs are ours: stopping discovery can outlast a short TTL
            res.start_renewing()
        finally:
            client.stop_listening()
        try:
            part = res.parts[0]
            # one machine: the command runs here, under this record
            if part.local:
                job.placed(part.devices, part.lease_id)
                return job.run(cmd, part.env, part.devices, _interactive())
            job.placed(part.devices, part.lease_id, remote=part.hostname)
            return _run_over_ssh(part, cmd, args.ssh_option, fleet_job_argv(job.job_id, asker, part))
        finally:
            res.release()
    finally:
        job.close()


def fleet_job(args: argparse.Namespace) -> int:
    """``gpusd fleet-job``: what ``gpusd run --fleet`` runs on the chosen host (over ssh): register
    the job here and run the command under it (docs/jobs.md, "Fleet runs")."""
    from ..alloc.runner import _interactive
    from ..jobs.fleet import FleetJob, parse_devices
    from .options import after_dashes

    cmd = after_dashes(args.cmd)
    if not cmd:
        raise ConfigError("no command given: gpusd fleet-job [options] -- CMD [ARGS...]")
    devices = parse_devices(args.devices)
    from ..ids import LeaseId

    if args.lease is not None:
        LeaseId.parse(args.lease, "--lease")
    job = FleetJob(args.job, shlex.join(cmd)[:512], args.asker)
    try:
        job.placed(devices, args.lease)
        return job.run(cmd, {}, devices, _interactive())
    finally:
        job.close()


def _wait(proc: subprocess.Popen[Any], send: Any, interactive: bool) -> int:
    from ..alloc.runner import wait_forwarding

    return wait_forwarding(proc, send, interactive)


# ssh -tt's goodbye, not the command's
_SSH_CLOSED = re.compile(rb"^Connection to \S+ closed\.\r?\n?$")
_SSH_UNRESOLVED = re.compile(rb"Could not resolve hostname")


def _ssh_name_hint(part: HostLease) -> str:
    """What to put in ssh's config when ssh cannot resolve the name a host announced."""
    from urllib.parse import urlsplit

    from ..sanitize import for_terminal

    name = for_terminal(part.hostname, 64)
    seen = for_terminal(urlsplit(part.url).hostname or "", 64)
    at = f" (it answered gpusd at {seen})" if seen else ""
    config = os.environ.get("GPUSD_SSH_CONFIG") or "~/.ssh/config"
    return (f"gpusd: ssh cannot resolve {name}, the name the chosen host announced{at}; tell ssh where it is "
            f"in {config}:\n    Host {name}\n        HostName ITS-ADDRESS-OR-DNS-NAME\n")


def _run_over_ssh(part: HostLease, cmd: list[str], options: Sequence[str], job: Sequence[str] = ()) -> int:
    from ..engines.placement import check_ssh_target

    # the host name its daemon signed, checked as every ssh target is (never an option, user@ or a URL)
    target = check_ssh_target(part.hostname, what="the host name its daemon signed")
    base = ssh_base(options)
    tty = os.isatty(0)
    argv = [*base, *(["-tt"] if tty else ["-T"]), "--", target, remote_script(part.env, cmd, job)]
    # at a terminal the remote pty merges the command's stderr into its output: the protocol line
    # then arrives on ssh's stdout, which is read here so that it never reaches the screen
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.PIPE if tty else None,
                            start_new_session=not tty)
    remote_pid: list[int] = []
    assert proc.stderr is not None
    err = proc.stderr
    protocol = REMOTE_PID.encode()

    def pid_line(line: bytes) -> bool:
        """Take the protocol line (``gpusd-remote-pid PID [job]``): True when ``line`` was it."""
        if remote_pid or not line.startswith(protocol):
            return False
        words = line.split()
        try:
            pid = int(words[1])
        except (IndexError, ValueError):
            pid = 0
        # seen; a pid that is not one process's (0, 1, -1: every process; absurdly large) is none to signal
        remote_pid.append(pid if 1 < pid < 1 << 22 else 0)
        if job and words[2:3] != [b"job"]:
            from ..sanitize import for_terminal

            where = for_terminal(part.hostname, 64)
            sys.stderr.buffer.write(f"gpusd: no gpusd with fleet jobs on the PATH of an ssh session on {where}: the "
                                    "command runs there without a job record (gpusd jobs there does not list it)\n"
                                    .encode())
            sys.stderr.buffer.flush()
        return True

    def pump() -> None:
        out = sys.stderr.buffer
        for line in iter(err.readline, b""):
            if pid_line(line) or (tty and _SSH_CLOSED.match(line)):
                continue
            out.write(line)
            if _SSH_UNRESOLVED.search(line):
                out.write(_ssh_name_hint(part).encode())
            out.flush()

    def pump_out() -> None:
        """The command's output at a terminal: passed on as it comes, the protocol line taken out."""
        assert proc.stdout is not None
        fd, out = proc.stdout.fileno(), sys.stdout.buffer
        pending = b""
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            if remote_pid or len(pending) > 65536:
                out.write(pending + chunk)
                pending = b""
            else:
                # until the protocol line has come (it is the first line the remote script prints)
                pending += chunk
                while b"\n" in pending and not remote_pid:
                    line, _, pending = pending.partition(b"\n")
                    if not pid_line(line + b"\n"):
                        out.write(line + b"\n")
                if remote_pid:
                    out.write(pending)
                    pending = b""
            out.flush()
        if pending:
            out.write(pending)
            out.flush()

    threads = [threading.Thread(target=pump, daemon=True)]
    if tty:
        threads.append(threading.Thread(target=pump_out, daemon=True))
    for t in threads:
        t.start()

    def send(signum: int) -> None:
        # not started yet: end the connection
        if not remote_pid or not remote_pid[0]:
            proc.send_signal(signal.SIGTERM)
            return
        name = signal.Signals(signum).name.removeprefix("SIG")
        subprocess.Popen([*base, "-T", "--", target, f"kill -s {name} {remote_pid[0]}"],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    rc = _wait(proc, send, tty)
    for t in threads:
        t.join(2)
    return rc


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]", name: str) -> None:
    """The parsers of ``gpusd reserve``, ``release``, ``reservations`` and the unlisted ``fleet-job``."""
    from . import options as o

    if name == "reserve":
        p = o.command(sub, name, "gpusd.cli.pool:reserve",
                      "hold the least-loaded GPUs of any verified host for an interactive session",
                      parents=[o.constraints(), o.host_filter(), o.ttl(), *o.fleet(),
                               o.json_output("the reservation as JSON")])
        p.add_argument("--per-host", type=int, metavar="N", help="N GPUs on each of -n/N hosts (default: all on one)")
        p.add_argument("--for", dest="duration", metavar="DURATION", default="2h", type=o.duration_text,
                       help="hold them this long at most (90s, 30m, 2h; default 2h), renewed in the background")
        p.add_argument("--note", metavar="TEXT", help="a note shown with the lease (private, like a command line)")
        p.add_argument("--at", metavar="WHEN", default=None,
                       help="book them ahead, from WHEN (+20m, 14:30 in this machine's time zone, or an ISO time "
                       "such as 2026-12-24T09:00 or ...T09:00+01:00) for --for: the host holds them for you then, "
                       "and before then lends them only to jobs with a --time that ends in time (docs/pool.md)")
    elif name == "release":
        p = o.command(sub, name, "gpusd.cli.pool:release", "end a reservation: gpusd release ID", parents=o.fleet())
        p.add_argument("lease_id", metavar="ID", help="the reservation's lease id (gpusd reservations)")
    elif name == "reservations":
        p = o.command(sub, name, "gpusd.cli.pool:reservations",
                      "the GPUs reserved on the fleet's hosts (yours, or --all)", parents=[o.json_output(), *o.fleet()])
        p.add_argument("--all", action="store_true", help="every holder's, not only yours")
        p.add_argument("--ics", metavar="FILE", default=None,
                       help="write your bookings (gpusd reserve --at) as an iCalendar file (RFC 5545) for calendars")
    else:
        # what gpusd run --fleet runs on the chosen host, over ssh (docs/jobs.md, "Fleet runs"): not listed
        p = o.command(sub, name, "gpusd.cli.pool:fleet_job", None)
        p.add_argument("--job", required=True, help="the job id the asking machine chose")
        p.add_argument("--from", dest="asker", default=None, help="the machine that asked (informational)")
        p.add_argument("--lease", default=None, help="the lease this host's daemon holds for the job")
        p.add_argument("--devices", required=True, help="the leased GPUs: a JSON list of {index, uuid, label}")
        p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...", help="the command to run")
