"""``gpusd hostfile``, ``gpusd launch`` and ``gpusd ray up/down``: distributed engines on a placement.

The placement (which hosts, which GPUs) comes from :func:`acquire`: a reservation of ``-n N``
GPUs across the fleet (``--per-host K``, the constraints of ``gpusd reserve``; docs/pool.md), renewed
while the engine runs and released at its end, or, for testing and for placements made by other tools,
a JSON file given with ``--placement`` (docs/engines.md).

This module parses the flags and prints; what runs where, and what gpusd remembers, is the library's:
:mod:`gpusd.engines.plan` (each engine's commands, their leases and guards), :mod:`gpusd.engines.records`
(jobs, Ray clusters, renewers), :mod:`gpusd.engines.raycluster` (Ray's nodes), :mod:`gpusd.engines.generate`
(the hostfiles).
"""

# Imports inside functions: start-up (a command's own module).
from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:

    from ..engines.launch import LaunchOptions
    from ..engines.placement import Placement
    from ..pool.client import Reservation
    from .options import Flags



def placement_for(args: argparse.Namespace) -> "Placement":
    """The placement of a command that does not reserve (``--placement FILE`` or ``$GPUSD_PLACEMENT``)."""
    from ..engines.placement import Placement, PlacementError

    path = getattr(args, "placement", None) or os.environ.get("GPUSD_PLACEMENT")
    if not path:
        raise PlacementError("no placement: give -n N to reserve GPUs across the fleet, or --placement FILE "
                             "(see docs/engines.md)")
    return Placement.load(path)


def acquire(args: argparse.Namespace, note: str, until: float | None = None, job_id: str | None = None,
            renewer: dict[str, Any] | None = None) -> tuple["Placement", "Reservation | None", int | None]:
    """The placement a command works on, and the reservation that holds it: ``-n N [--per-host K]``
    and the constraints reserve GPUs across the fleet (the pool, docs/pool.md); ``--placement FILE``
    (or ``$GPUSD_PLACEMENT`` without ``-n``) reads a ready-made placement and reserves nothing (for
    testing and for placements made by other tools).

    The reservation is renewed from the moment it is made (before discovery stops, which may take longer
    than a TTL): by a background thread of this process while it runs (``until`` None; the caller
    releases), or by a renewer process (``python -m gpusd.pool.renewer``) until ``until`` (epoch), whose
    pid is returned third; ``renewer``: its optional fields (``at_end``, ``forget``).  ``job_id``: the
    placement's (default: a new one)."""
    # wrong flags are usage errors (exit 2), as everywhere
    from ..errors import ConfigError
    from ..ids import PlacementId

    count = getattr(args, "count", None)
    if getattr(args, "placement", None) and count is not None:
        raise ConfigError("-n and --placement exclude each other: -n reserves GPUs, --placement FILE "
                          "uses the hosts and GPUs the file names")
    if count is None:
        if getattr(args, "per_host", None) is not None:
            raise ConfigError("--per-host needs -n N (the GPUs in all)")
        return placement_for(args), None, None
    from .pool import _client, _key, _reserve, _start_renewer
    from .trust import secret

    if count <= 0:
        raise ConfigError("-n wants a positive number of GPUs")
    job_id = job_id or PlacementId.new()
    key = _key(args)
    client = _client(args, key)
    got: list[Reservation] = []
    pid: int | None = None
    try:
        got.append(_reserve(args, key, f"{job_id}: {note}"[:512], client))
        if until is None:
            got[0].start_renewing()
        else:
            pid = _start_renewer(got[0], secret(args) or "", until, renewer)
        # slow (mDNS goodbyes): a Ctrl-C meanwhile must not leak the leases
        client.stop_listening()
        return got[0].to_placement(job_id), got[0], pid
    except BaseException:
        from ..engines.records import renewer_record

        _end_renewer(renewer_record(pid))
        for res in got:
            res.release()
        client.stop_listening()
        raise


def _until(args: argparse.Namespace) -> float:
    """The end of ``--for`` (epoch)."""
    import time

    from ..units import parse_duration

    try:
        return time.time() + parse_duration(args.duration)
    except ValueError as exc:
        raise SystemExit(f"{_prog()}: --for: {exc}") from None


def _release(res: "Reservation | None") -> None:
    if res is not None:
        res.release()


def placement_parents(with_count: bool = True) -> "list[Flags]":
    """The shared flag groups of a command that reserves its placement (with ``with_count``): the
    constraints, ``--wait``/``--timeout``, ``--host``/``--model``, ``--ttl`` and the fleet flags of
    ``gpusd reserve``."""
    from . import options as o

    if not with_count:
        return []
    return [o.constraints("what to reserve across the fleet (docs/pool.md)"), o.host_filter(), o.ttl(), *o.fleet()]


def add_placement_flags(p: argparse.ArgumentParser, with_count: bool = True, hold: str | None = None) -> None:
    """``--per-host`` (with ``with_count``: p has :func:`placement_parents`) and ``--placement FILE``;
    ``hold``: the default of ``--for`` (how long a reservation outlives the command that made it)."""
    from .options import duration_text

    if with_count:
        g = next(g for g in p._action_groups if g.title == "what to reserve across the fleet (docs/pool.md)")
        g.add_argument("--per-host", type=int, metavar="K", help="K GPUs on each of N/K hosts (default: all on one)")
        if hold:
            g.add_argument("--for", dest="duration", metavar="DURATION", default=hold, type=duration_text,
                           help=f"without a command to wait for: hold the GPUs this long at most (default {hold}), "
                           "renewed in the background")
        # -n absent: --placement
        p.set_defaults(count=None)
        for action in p._actions:
            if action.dest == "count":
                action.help = "reserve N GPUs in all across the fleet (or give --placement FILE)"
    p.add_argument("--placement", metavar="FILE",
                   help="testing/advanced: use the hosts and GPUs this JSON file names instead of reserving "
                   "(docs/engines.md; $GPUSD_PLACEMENT); excludes -n")


def add_ssh_flags(p: argparse.ArgumentParser) -> None:
    from . import options as o

    ssh = p.add_argument("--ssh-option", action="append", default=[], metavar="OPTION",
                         help="passed to ssh as -o OPTION (repeatable); ssh also reads $GPUSD_SSH_CONFIG as -F")
    # -o is --output elsewhere (report, export)
    o.deprecated(p, "-o", ssh)
    p.add_argument("--grace", type=o.grace, default=10.0, metavar="S",
                   help="seconds between SIGTERM and SIGKILL when stopping (default 10)")


def _options(args: argparse.Namespace, **kw: object) -> "LaunchOptions":
    from ..engines.launch import LaunchOptions

    return LaunchOptions(ssh_options=list(args.ssh_option), grace=args.grace, **kw)  # type: ignore[arg-type]


def _env_pairs(items: Sequence[str]) -> dict[str, str]:
    out = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not name.isidentifier():
            raise SystemExit(f"{_prog()}: --env wants NAME or NAME=VALUE, not {item!r}")
        if not eq:
            if name not in os.environ:
                continue
            value = os.environ[name]
        out[name] = value
    return out


def _port(text: str) -> int:
    """A TCP port (1-65535) for argparse."""
    from .options import whole_number

    return whole_number(text, 1, 65535, f"a TCP port is 1-65535, not {text[:20]!r}")


def _prog() -> str:
    from . import prog

    return prog()


# -- gpusd hostfile --------------------------------------------------------------------------------------
def _discovery_source(args: argparse.Namespace, held: Path | None) -> list[str]:
    """The command a Horovod discovery script runs: what gpusd holds for the job now (the reservation's
    record while it is held), or the ``--placement`` file."""
    if held is not None:
        return [sys.executable, "-m", "gpusd", "hostfile", "--format", "horovod-discovery", "--held", str(held)]
    path = getattr(args, "placement", None) or os.environ.get("GPUSD_PLACEMENT", "")
    return [sys.executable, "-m", "gpusd", "hostfile", "--format", "horovod-discovery",
            "--placement", str(Path(path).resolve())]


def _end_renewer(record: dict[str, Any], release: bool = True) -> None:
    from ..engines.records import end_renewer

    pid = end_renewer(record, release=release)
    if pid is not None:
        print(f"{_prog()}: the renewer (pid {pid}) did not end; the leases expire with their TTL", file=sys.stderr)


def hostfile(args: argparse.Namespace) -> int:
    """Write what an engine reads.  With ``-n``: reserve first; with ``-- CMD``, hold the reservation
    (renewed) while CMD runs here and release it at its end; without, hand it to a background renewer
    for ``--for`` (``gpusd release ID`` ends it earlier), as ``gpusd reserve`` does."""
    from .options import after_dashes

    args.args = after_dashes(args.args)
    # Horovod's discovery script: what the job holds now
    if getattr(args, "held", None):
        if args.format != "horovod-discovery":
            raise SystemExit(f"{_prog()}: --held goes with --format horovod-discovery")
        from ..engines.records import held_placement

        held = held_placement(args.held)
        if held is not None:
            from ..engines.generate import horovod_discovery_lines

            sys.stdout.write(horovod_discovery_lines(held))
        return 0
    from ..engines.records import forget_held, held_path, write_held
    from ..ids import PlacementId

    cmd = list(args.args) if args.args else []
    until = _until(args) if args.count is not None and not cmd else None
    job_id = PlacementId.new()
    # the renewer (no CMD) removes the job's record when the reservation ends: gpusd release ID,
    # --for over, a lease lost
    p, res, pid = acquire(args, f"gpusd hostfile --format {args.format}" + (f" -- {shlex.join(cmd)}" if cmd else ""),
                          until, job_id, {"forget": [str(held_path(job_id))]} if until is not None else None)
    if res is None:
        return _hostfile_output(args, p, None, cmd)
    if not cmd:
        assert pid is not None and until is not None
        return _hand_over(args, p, res, pid, until)
    import time

    try:
        held_file = write_held(p, os.getpid(), None)
        status = _hostfile_output(args, p, held_file, cmd)
        if status != 0:
            return status
        sys.stdout.flush()
        env = {"GPUSD_JOB_ID": p.job_id}
        if args.output:
            env["GPUSD_HOSTFILE"] = str(Path(args.output).resolve())
        started = time.monotonic()
        rc = _run_here(cmd, env)
        if res.lost.is_set():
            print(f"{_prog()}: the reservation was lost after {time.monotonic() - started:.0f}s (expired, or a "
                  "daemon restarted)", file=sys.stderr)
            return rc or 1
        return rc
    finally:
        forget_held(p.job_id)
        res.release()


def _hand_over(args: argparse.Namespace, p: "Placement", res: "Reservation", pid: int, until: float) -> int:
    """Keep the reservation after this command: its renewer (``pid``) holds it until ``--for`` is up."""
    from ..engines.records import renewer_record, write_held
    from ..sanitize import for_terminal
    from ..units import format_clock
    from .pool import release_command

    try:
        held_file = write_held(p, pid, until)
        status = _hostfile_output(args, p, held_file, [])
    except BaseException:
        _end_renewer(renewer_record(pid))
        res.release()
        raise
    print(f"# held until {format_clock(until)} (--for {for_terminal(args.duration, 16)}) "
          f"by renewer pid {pid}; end it earlier with: "
          + "; ".join(release_command(args, part.lease_id) for part in res.parts), file=sys.stderr)
    return status


def _run_here(cmd: list[str], extra_env: dict[str, str]) -> int:
    import subprocess

    from ..alloc.runner import _interactive
    from ..errors import exec_failure
    from .pool import _wait

    try:
        proc = subprocess.Popen(cmd, env={**os.environ, **extra_env})
    except OSError as exc:
        status, says = exec_failure(exc, cmd[0])
        print(f"{_prog()}: {says}", file=sys.stderr)
        return status
    return _wait(proc, proc.send_signal, _interactive())


def _hostfile_output(args: argparse.Namespace, p: "Placement", held: Path | None, cmd: list[str]) -> int:
    from ..engines import generate as g
    from ..engines.records import write_new

    out = args.output
    program = cmd or ["train.py"]
    port = getattr(args, "port", None)
    discovery = _discovery_source(args, held) if out and args.format == "horovod" else None
    text = g.hostfile_text(args.format, p, program, port, discovery)
    if not out:
        sys.stdout.write(text)
        return 0
    write_new(out, text, 0o755 if args.format == "horovod" else 0o644)
    # how to use what was written
    for line in g.hostfile_usage(args.format, p, out, program, port):
        print(line)
    return 0


# -- gpusd launch ------------------------------------------------------------------------------------------
def launch(args: argparse.Namespace) -> int:
    import asyncio

    from ..engines.plan import commands_for, run_holding, silence, with_leases
    from .options import after_dashes

    rest = after_dashes(args.args)
    if not rest:
        print(f"{_prog()}: launch needs the program to run after ENGINE: gpusd launch -n 4 torchrun -- train.py",
              file=sys.stderr)
        return 2
    p, res, _ = acquire(args, f"gpusd launch {args.engine} -- {shlex.join(rest)}")
    # from here on, every way out releases (a failure, Ctrl-C, the end)
    try:
        if getattr(args, "bind_cpus", False):
            _say_binding(args.engine, p)
        chdir = None if args.no_chdir else (args.chdir or os.getcwd())
        env = _env_pairs(args.env)
        opts = _options(args, chdir=chdir, env=env, python=args.python,
                        silence=silence([part.ttl for part in res.parts] if res is not None else None))
        leases = [part.lease_id for part in res.parts] if res is not None else None
        cmds = commands_for(args.engine, p, rest, port=args.port, python=args.python,
                            bind_cpus=bool(getattr(args, "bind_cpus", False)), env_names=list(env),
                            ssh_options=args.ssh_option, leases=leases)
        return asyncio.run(run_holding(with_leases(cmds, leases), opts, res.lost if res is not None else None))
    finally:
        _release(res)


def _say_binding(engine: str, p: "Placement") -> None:
    """``launch --bind-cpus``: what will be bound on each host (each host then says what it did, in
    its own output: its CPUs may be fewer where the command may not use them all)."""
    from ..engines.generate import host_cpus
    from ..sanitize import for_terminal

    per_rank = engine in ("mpirun", "horovodrun")
    for h in p.hosts:
        name = for_terminal(h.hostname, 80)
        gpus = ",".join(str(g) for g in h.gpus)
        if per_rank:
            cpus = ", ".join(f"GPU {g}: {c or 'unknown'}" for g, c in zip(h.gpus, h.local_cpus or [None] * h.slots))
            print(f"{_prog()}: --bind-cpus: {name}: each rank on the CPUs local to its GPU ({cpus}), by gpusd's "
                  "rank wrapper there", file=sys.stderr)
            continue
        union = host_cpus(h)
        if union is None:
            print(f"{_prog()}: --bind-cpus: {name}: not bound: the CPUs local to GPU(s) {gpus} are unknown (its "
                  "daemon did not say, or the placement file has no local_cpus)", file=sys.stderr)
        else:
            print(f"{_prog()}: --bind-cpus: {name}: {engine} and its ranks on CPUs {union} (local to GPU(s) "
                  f"{gpus}), as far as the command may use them there", file=sys.stderr)
    sys.stderr.flush()


# -- gpusd ray up / down -----------------------------------------------------------------------------------
def _ray_state(args: argparse.Namespace) -> Path:
    from ..identity import state_dir

    return Path(args.state_dir) if getattr(args, "state_dir", None) else state_dir()


def _clusters(args: argparse.Namespace) -> dict[str, tuple[Path, dict[str, Any]]]:
    """The clusters gpusd started and remembers here (an unreadable record is skipped with a line)."""
    from ..engines.records import clusters

    found, skipped = clusters(_ray_state(args))
    for line in skipped:
        print(f"{_prog()}: {line}", file=sys.stderr)
    return found


def ray_up(args: argparse.Namespace) -> int:
    """Reserve (``-n``), start Ray on every host — each node under a guard that stops it before that
    host's lease can end — and hand the reservation to a background renewer (until ``--for`` is up,
    then the leases run out) that ``gpusd ray down`` stops, which releases the GPUs."""
    import time

    from ..engines import generate as g
    from ..engines import raycluster
    from ..engines.plan import guard_margin, guarded
    from ..engines.records import cluster_path, forget, renewer_record, write_cluster
    from ..ids import PlacementId
    from ..units import format_clock
    from .options import after_dashes

    extra = after_dashes(args.ray_args)
    head_extra = [*extra, *args.head_option]
    worker_extra = [*extra, *args.worker_option]
    # a renewer process holds the reservation from the start (starting Ray may take longer than a TTL);
    # at the end of --for it lets the leases expire, so that every host's guard stops Ray first
    until = _until(args) if args.count is not None else None
    p, res, pid = acquire(args, "gpusd ray up", until, PlacementId.new(), {"at_end": "expire"})
    record: dict[str, Any] = {"id": p.job_id, "placement": p.to_dict(), "port": args.port, "python": args.python,
                              "address": g.ray_address(p, args.port), "started": time.time()}
    if res is not None:
        record.update(renewer_record(pid), until=until, leases=[part.to_dict() for part in res.parts])
    cmds = g.ray_commands(p, port=args.port, ray=args.ray, extra=head_extra, worker_extra=worker_extra)
    if res is not None:
        margin, grace = guard_margin([part.ttl for part in res.parts])
        cmds = guarded(cmds, [part.lease_id for part in res.parts], args.python, margin, grace)
    opts = _options(args, watchdog=False, stop_on_failure=True)
    path = cluster_path(_ray_state(args), p.job_id)
    # a --placement file's job id: the same cluster twice
    if res is None and p.job_id in _clusters(args):
        raise SystemExit(f"{_prog()}: a Ray cluster {p.job_id} is already up (gpusd ray down {p.job_id}), "
                         "or give the placement another job_id")
    try:
        write_cluster(_ray_state(args), record)
        # the head first: the workers join it; what the hosts say goes to stderr (stdout: the address)
        status, failures = raycluster.start(cmds[:1], opts)
        if status == 0 and len(cmds) > 1:
            status, failures = raycluster.start(cmds[1:], opts)
    except BaseException:
        # stop what started before the GPUs go back
        if res is not None and path.exists():
            _stop_cluster(args, record)
        _end_renewer(record)
        forget(path)
        raise
    if status != 0:
        for line in raycluster.failure_lines(failures, status):
            print(f"{_prog()}: {line}", file=sys.stderr)
        print(f"{_prog()}: `gpusd ray down {p.job_id}` stops what started and releases the GPUs", file=sys.stderr)
        return status
    print(record["address"])
    if res is not None:
        print(f"# Ray cluster {p.job_id}: the GPUs are held until `gpusd ray down {p.job_id}` (at most until "
              f"{format_clock(record['until'])}, --for); a host whose lease is not renewed stops its Ray node "
              f"{margin:g}s before the lease ends", file=sys.stderr)
    else:
        print(f"# Ray cluster {p.job_id}: stop it with `gpusd ray down {p.job_id}`", file=sys.stderr)
    return 0


def _stop_cluster(args: argparse.Namespace, record: dict[str, Any]) -> int:
    from ..engines import raycluster

    opts = _options(args, watchdog=False, stop_on_failure=False)
    return raycluster.stop(record, opts, ray=args.ray, python=getattr(args, "python", None))


def ray_down(args: argparse.Namespace) -> int:
    """Stop one cluster gpusd started (``ID``; the only one when there is one), or ``--all``: Ray first
    on every host, then the renewer, which releases the GPUs."""
    from ..engines.records import RAY_DIR, describe, forget

    if getattr(args, "placement", None):
        record = {"placement": placement_for(args).to_dict()}
        return _stop_cluster(args, record)
    clusters = _clusters(args)
    if args.cluster:
        if args.cluster not in clusters:
            known = ", ".join(sorted(clusters)) or "none"
            print(f"{_prog()}: no Ray cluster {args.cluster!r} started by gpusd here (known: {known})",
                  file=sys.stderr)
            return 1
        chosen = [args.cluster]
    elif not clusters:
        if os.environ.get("GPUSD_PLACEMENT"):
            return _stop_cluster(args, {"placement": placement_for(args).to_dict()})
        print(f"{_prog()}: no Ray cluster started by gpusd here ({_ray_state(args) / RAY_DIR}); give --placement FILE",
              file=sys.stderr)
        return 1
    elif len(clusters) > 1 and not args.all:
        print(f"{_prog()}: {len(clusters)} Ray clusters started by gpusd here; say which: gpusd ray down ID "
              "(or --all)", file=sys.stderr)
        for cid, (_, record) in sorted(clusters.items()):
            print(f"  {cid}  {describe(record)}", file=sys.stderr)
        return 2
    else:
        chosen = sorted(clusters)
    status = 0
    for cid in chosen:
        path, record = clusters[cid]
        print(f"{_prog()}: stopping Ray cluster {cid} ({describe(record)})", file=sys.stderr)
        sys.stderr.flush()
        stopped = _stop_cluster(args, record)
        status = stopped or status
        if stopped == 0:
            # Ray stopped on every host: the GPUs go back to the pool at once
            _end_renewer(record)
        else:
            # a host not reached: its guard stops Ray there before the lease runs out, then it is free
            _end_renewer(record, release=False)
            print(f"{_prog()}: not every host of {cid} could be reached: its leases are no longer renewed and end "
                  "within their TTL (each host's guard stops Ray there first)", file=sys.stderr)
        forget(path)
    return status


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]", name: str) -> None:
    """The parsers of ``gpusd hostfile``, ``launch`` and ``ray up|down``."""
    from .options import command

    if name == "hostfile":
        from ..engines.generate import FORMATS

        p = command(sub, name, "gpusd.cli.engines:hostfile", "write what a distributed engine reads (DeepSpeed/MPI "
                    "hostfile, Horovod -H, torchrun lines, JSON)", parents=placement_parents())
        add_placement_flags(p, hold="2h")
        p.add_argument("--format", "-f", choices=FORMATS, default="json", help="what to write (default json)")
        # Horovod's discovery script
        p.add_argument("--held", metavar="FILE", help=argparse.SUPPRESS)
        p.add_argument("--port", type=_port, default=None,
                       help="in the command lines printed: torchrun's rendezvous port (default 29400), DeepSpeed's "
                       "master port (default 29500) or the Ray head's port (default 6379)")
        p.add_argument("--output", metavar="FILE", help="write to FILE and print the engine's command line using it")
        p.add_argument("args", nargs=argparse.REMAINDER, metavar="-- PROGRAM ...",
                       help="with -n: a command to run here while the GPUs are held (released at its end); "
                       "also the training program of the command lines shown")
    elif name == "launch":
        from ..engines.plan import ENGINES
        p = command(sub, name, "gpusd.cli.engines:launch", "start a distributed engine on every host of the job over "
                    "SSH: gpusd launch -n 8 --per-host 4 torchrun -- train.py", parents=placement_parents())
        add_placement_flags(p)
        add_ssh_flags(p)
        p.add_argument("--env", "-x", action="append", default=[], metavar="NAME[=VALUE]",
                       help="also set NAME on every host (its value here, or VALUE; repeatable)")
        p.add_argument("--chdir", metavar="DIR", help="working directory on every host (default: the current one)")
        p.add_argument("--no-chdir", action="store_true", help="stay in the login directory on remote hosts")
        p.add_argument("--port", type=_port, default=None,
                       help="torchrun's rendezvous port (default 29400) or DeepSpeed's master port (default 29500)")
        p.add_argument("--python", default=None, help="the Python that runs gpusd's per-rank wrapper (mpirun, "
                       "horovodrun; default: this machine's interpreter where the same path exists on the host, "
                       "else the one of the gpusd command on the host's PATH)")
        p.add_argument("--bind-cpus", action="store_true",
                       help="bind to the CPUs local to the GPUs, on each host (intersected there with the CPUs the "
                       "command may use): each rank to its GPU's (mpirun, horovodrun), the per-host launcher and "
                       "so its ranks to its GPUs' (torchrun, deepspeed, command); says what it did per host")
        p.add_argument("engine", choices=ENGINES, metavar="ENGINE",
                       help="torchrun, deepspeed, mpirun, horovodrun or command (the same command on every host)")
        p.add_argument("args", nargs=argparse.REMAINDER, metavar="-- PROGRAM ...",
                       help="the program and its arguments")
    else:
        _ray_parsers(sub)


def _ray_parsers(sub: Any) -> None:
    from .options import command, state_dir

    what = "a Ray cluster on gpusd's GPUs: ray up / ray down"
    p = sub.add_parser("ray", help=what, description=what)
    rsub = p.add_subparsers(dest="ray_command", metavar="up|down", parser_class=type(p), required=True)
    for name, target, what in (("up", "ray_up", "start a Ray head on the first host and workers on the others, "
                                "each limited to its GPUs; prints the address"),
                               ("down", "ray_down", "stop Ray on every host of a cluster gpusd started; release it")):
        p = command(rsub, name, f"gpusd.cli.engines:{target}", what,
                    parents=[*placement_parents(with_count=name == "up"), state_dir()])
        add_placement_flags(p, with_count=name == "up", hold="24h")
        add_ssh_flags(p)
        p.add_argument("--ray", default="ray", metavar="PATH", help="the ray command on the hosts (default ray)")
        p.add_argument("--port", type=_port, default=6379, help="the head's port (default 6379)")
        p.add_argument("--python", default=None, metavar="PATH",
                       help="the Python with gpusd on the hosts, which runs each node's guard (default: found as "
                       "gpusd launch finds it; here gpusd's own; ray down: the one ray up used)")
        if name == "down":
            p.add_argument("cluster", nargs="?", metavar="ID", help="the cluster to stop (ray up prints its id; "
                           "needed when there are several)")
            p.add_argument("--all", action="store_true", help="stop every cluster gpusd started here")
        if name == "up":
            p.add_argument("--head-option", action="append", default=[], metavar="ARG",
                           help="an argument for the head's `ray start` only (repeatable; e.g. "
                           "--head-option=--dashboard-port=8266, --head-option=--include-dashboard=false)")
            p.add_argument("--worker-option", action="append", default=[], metavar="ARG",
                           help="an argument for the workers' `ray start` only (repeatable)")
            p.add_argument("ray_args", nargs=argparse.REMAINDER, metavar="-- RAY_START_ARGS",
                           help="more arguments for every `ray start` (e.g. -- --object-store-memory=1e9)")
