"""``gpusd hostfile``, ``gpusd launch`` and ``gpusd ray up/down``: distributed engines on a placement.

The placement (which hosts, which GPUs) comes from :func:`acquire`: a reservation of ``-n N``
GPUs across the fleet (``--per-host K``, the constraints of ``gpusd reserve``; docs/pool.md), renewed
while the engine runs and released at its end, or, for testing and for placements made by other tools,
a JSON file given with ``--placement`` (docs/engines.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from collections.abc import Coroutine

    from ..engines.generate import HostCommand
    from ..engines.launch import Failure, LaunchOptions
    from ..engines.placement import HostSlot, Placement
    from ..pool.client import Reservation
    from .options import Flags

ENGINES = ("torchrun", "deepspeed", "mpirun", "horovodrun", "command")
FORMATS = ("deepspeed", "mpi", "horovod", "horovod-discovery", "torchrun", "ray", "json")
RAY_STATE = "ray-placement.json"


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
    from ..errors import ConfigError  # wrong flags are usage errors (exit 2), as everywhere
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
        client.stop_listening()  # slow (mDNS goodbyes): a Ctrl-C meanwhile must not leak the leases
        return got[0].to_placement(job_id), got[0], pid
    except BaseException:
        _end_renewer(_renewer_record(pid))
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
        p.set_defaults(count=None)  # -n absent: --placement
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
    o.deprecated(p, "-o", ssh)  # -o is --output elsewhere (report, export)
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
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"a TCP port is 1-65535, not {text[:20]!r}")
    return port


def _prog() -> str:
    from . import prog

    return prog()


# -- gpusd hostfile --------------------------------------------------------------------------------------
HELD_DIR = "jobs"  # under gpusd's state directory: what a job holds now, for Horovod's discovery script


def _held_path(job_id: str) -> Path:
    from ..identity import state_dir

    return state_dir() / HELD_DIR / f"{job_id}.json"


def _write_held(p: "Placement", holder_pid: int, until: float | None) -> Path:
    """Record what the job holds now (read by ``--format horovod-discovery --held FILE``): the
    placement, and the holder as the kernel knows it (pid and start time: a pid alone may be reused)."""
    from ..alloc.queue import _process_start

    path = _held_path(p.job_id)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    record = {"placement": p.to_dict(), "pid": holder_pid, "pid_started": _process_start(holder_pid), "until": until}
    _write(str(path), json.dumps(record) + "\n", 0o600)
    return path


def _forget_held(p: "Placement") -> None:
    try:
        _held_path(p.job_id).unlink()
    except OSError:
        pass


def _holder_alive(pid: object, started: object) -> bool:
    """Whether the process that wrote a record still runs: the pid, and the same kernel start time
    (a pid that was reused by another process has a later one)."""
    from ..alloc.queue import _process_start

    if type(pid) is not int or pid <= 0 or not isinstance(started, (int, float)):
        return False
    now = _process_start(pid)
    return now is not None and abs(now - started) < 1.5  # btime may shift by 1 s


def held_placement(path: str) -> "Placement | None":
    """What a job holds now: the placement in ``path`` while its holder (``gpusd hostfile -- CMD``,
    or the renewer of a reservation held ``--for`` a while) lives — the same process, by pid and
    start time — and the time is not up; else None."""
    import time

    from ..engines.placement import Placement

    try:
        with open(path, "rb") as f:
            d = json.loads(f.read(1 << 20))
        until = d.get("until")
        if until is not None and time.time() >= float(until):
            return None
        if not _holder_alive(d["pid"], d.get("pid_started")):
            return None
        return Placement.from_dict(d["placement"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _discovery_source(args: argparse.Namespace, p: "Placement", held: Path | None) -> list[str]:
    """The command a Horovod discovery script runs: what gpusd holds for the job now (the reservation's
    record while it is held), or the ``--placement`` file."""
    if held is not None:
        return [sys.executable, "-m", "gpusd", "hostfile", "--format", "horovod-discovery", "--held", str(held)]
    path = getattr(args, "placement", None) or os.environ.get("GPUSD_PLACEMENT", "")
    return [sys.executable, "-m", "gpusd", "hostfile", "--format", "horovod-discovery",
            "--placement", str(Path(path).resolve())]


def _write(path: str, text: str, mode: int = 0o644) -> None:
    """Write a new file (never through an existing symlink: O_EXCL after removing our own old file)."""
    p = Path(path)
    if p.is_symlink():
        raise SystemExit(f"{_prog()}: {path} is a symbolic link; not writing through it")
    tmp = p.with_name(f".{p.name}.gpusd-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, p)


def hostfile(args: argparse.Namespace) -> int:
    """Write what an engine reads.  With ``-n``: reserve first; with ``-- CMD``, hold the reservation
    (renewed) while CMD runs here and release it at its end; without, hand it to a background renewer
    for ``--for`` (``gpusd release ID`` ends it earlier), as ``gpusd reserve`` does."""
    if args.args and args.args[0] == "--":
        args.args = args.args[1:]
    if getattr(args, "held", None):  # Horovod's discovery script: what the job holds now
        if args.format != "horovod-discovery":
            raise SystemExit(f"{_prog()}: --held goes with --format horovod-discovery")
        held = held_placement(args.held)
        if held is not None:
            from ..engines.generate import horovod_discovery_lines

            sys.stdout.write(horovod_discovery_lines(held))
        return 0
    from ..ids import PlacementId

    cmd = list(args.args) if args.args else []
    until = _until(args) if args.count is not None and not cmd else None
    job_id = PlacementId.new()
    # the renewer (no CMD) removes the job's record when the reservation ends: gpusd release ID,
    # --for over, a lease lost
    p, res, pid = acquire(args, f"gpusd hostfile --format {args.format}" + (f" -- {shlex.join(cmd)}" if cmd else ""),
                          until, job_id, {"forget": [str(_held_path(job_id))]} if until is not None else None)
    if res is None:
        return _hostfile_output(args, p, None, cmd)
    if not cmd:
        assert pid is not None and until is not None
        return _hand_over(args, p, res, pid, until)
    import time

    try:
        held_file = _write_held(p, os.getpid(), None)
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
        _forget_held(p)
        res.release()


def _hand_over(args: argparse.Namespace, p: "Placement", res: "Reservation", pid: int, until: float) -> int:
    """Keep the reservation after this command: its renewer (``pid``) holds it until ``--for`` is up."""
    from ..sanitize import for_terminal
    from ..units import format_clock
    from .pool import release_command

    try:
        held_file = _write_held(p, pid, until)
        status = _hostfile_output(args, p, held_file, [])
    except BaseException:
        _end_renewer(_renewer_record(pid))
        res.release()
        raise
    print(f"# held until {format_clock(until)} (--for {for_terminal(args.duration, 16)}) "
          f"by renewer pid {pid}; end it earlier with: "
          + "; ".join(release_command(args, part.lease_id) for part in res.parts), file=sys.stderr)
    return status


def _run_here(cmd: list[str], extra_env: dict[str, str]) -> int:
    import subprocess

    from ..alloc.runner import _interactive
    from .pool import _wait

    try:
        proc = subprocess.Popen(cmd, env={**os.environ, **extra_env})
    except FileNotFoundError:
        print(f"{_prog()}: command not found: {cmd[0]}", file=sys.stderr)
        return 127
    return _wait(proc, proc.send_signal, _interactive())


def _hostfile_output(args: argparse.Namespace, p: "Placement", held: Path | None, cmd: list[str]) -> int:
    from ..engines import generate as g

    fmt = args.format
    out = args.output
    port = getattr(args, "port", None)
    if fmt == "json":
        text = json.dumps(g.json_view(p), indent=2) + "\n"
    elif fmt == "deepspeed":
        text = g.deepspeed_hostfile(p)
    elif fmt == "mpi":
        text = g.mpi_hostfile(p)
    elif fmt == "horovod":
        text = g.horovod_discovery_script(_discovery_source(args, p, held)) if out else g.horovod_hosts(p) + "\n"
    elif fmt == "horovod-discovery":
        text = g.horovod_discovery_lines(p)
    elif fmt == "torchrun":
        text = "".join(f"{c.slot.hostname}: {c.shell()}\n"
                       for c in g.torchrun_commands(p, cmd or ["train.py"], port=port or g.RDZV_PORT))
    else:  # ray
        text = "".join(f"{c.slot.hostname}: {c.shell()}\n" for c in g.ray_commands(p, port=port or g.RAY_PORT))
    if not out:
        sys.stdout.write(text)
        return 0
    _write(out, text, 0o755 if fmt == "horovod" else 0o644)
    # Say how to use what was written.
    rest = cmd or ["train.py"]
    if fmt == "deepspeed":
        line = g.deepspeed_argv(p, out, rest, master_port=port or g.DS_MASTER_PORT)
        print(f"# every node needs {g.deepspeed_env_file(p).strip()} (NVML's GPU order): put it in .deepspeed_env")
    elif fmt == "mpi":
        print("# every rank needs: " + " ".join(f"{k}={shlex.quote(v)}" for k, v in g.mpi_env(p).items()))
        line = ["env", *[f"{k}={v}" for k, v in g.mpi_env(p).items()], *g.mpirun_argv(p, out, rest)]
    elif fmt == "horovod":
        line = ["horovodrun", "-np", str(p.total_gpus), "--host-discovery-script", str(Path(out).resolve()),
                *g.rank_wrapper(), *rest]
        line = ["env", f"{g.RANK_GPUS_VAR}={g.rank_gpus(p)}", *line]
    else:
        return 0
    print(" ".join(shlex.quote(w) for w in line))
    return 0


# -- gpusd launch ------------------------------------------------------------------------------------------
def commands_for(engine: str, p: "Placement", rest: Sequence[str], args: argparse.Namespace) -> list["HostCommand"]:
    from ..engines import generate as g

    bind = bool(getattr(args, "bind_cpus", False))
    if engine in ("torchrun", "deepspeed", "command"):
        if engine == "torchrun":
            cmds = g.torchrun_commands(p, rest, port=args.port or g.RDZV_PORT)
        elif engine == "deepspeed":
            cmds = g.deepspeed_commands(p, rest, master_port=args.port or g.DS_MASTER_PORT)
        else:
            cmds = g.plain_commands(p, rest)
        # these start their ranks themselves on each host: the host's launcher is bound, the ranks inherit
        return g.bound(cmds, python=args.python) if bind else cmds
    # mpirun and horovodrun start the ranks themselves: one command, on the head; gpusd's per-rank
    # wrapper binds each rank (GPUSD_RANK_CPUS)
    env = g.mpi_env(p, bind)
    rsh = _rsh_agent(args)
    if engine == "mpirun":
        hosts = g.mpi_hostfile(p)
        extra = [w for name in _env_pairs(args.env) for w in ("-x", name)]
        argv = g.mpirun_argv(p, f"{g.FILES}/hostfile", rest, python=args.python, extra=extra, bind_cpus=bind)
        if rsh:  # Open MPI's own ssh gets the same config and options as gpusd's
            env["OMPI_MCA_plm_rsh_agent"] = rsh
        return [g.HostCommand(p.head, 0, argv, env, {"hostfile": hosts})]
    # horovodrun has no ssh command option: it reads the user's ~/.ssh/config (and --ssh-port,
    # --ssh-identity-file, which can follow ENGINE's arguments).
    return [g.HostCommand(p.head, 0, g.horovodrun_argv(p, rest, python=args.python), env)]


def _rsh_agent(args: argparse.Namespace) -> str | None:
    """``ssh -F $GPUSD_SSH_CONFIG -o ...`` for engines that ssh by themselves, when gpusd's ssh has
    settings of its own (else the engine's default ssh already reads the user's config)."""
    config = os.environ.get("GPUSD_SSH_CONFIG")
    options = list(getattr(args, "ssh_option", []) or [])
    if not config and not options:
        return None
    words = ["ssh", *(["-F", config] if config else []), *[w for o in options for w in ("-o", o)]]
    return " ".join(shlex.quote(w) for w in words)


def launch(args: argparse.Namespace) -> int:
    rest = list(args.args)
    if rest and rest[0] == "--":
        rest = rest[1:]
    if not rest:
        print(f"{_prog()}: launch needs the program to run after ENGINE: gpusd launch -n 4 torchrun -- train.py",
              file=sys.stderr)
        return 2
    p, res, _ = acquire(args, f"gpusd launch {args.engine} -- {shlex.join(rest)}")
    try:  # from here on, every way out releases (a failure, Ctrl-C, the end)
        if getattr(args, "bind_cpus", False):
            _say_binding(args.engine, p)
        chdir = None if args.no_chdir else (args.chdir or os.getcwd())
        opts = _options(args, chdir=chdir, env=_env_pairs(args.env), silence=_silence(res), python=args.python)
        return asyncio_run(run_holding(with_leases(commands_for(args.engine, p, rest, args), res), opts, res))
    finally:
        _release(res)


def with_leases(cmds: Sequence["HostCommand"], res: "Reservation | None") -> list["HostCommand"]:
    """Each host's command with ``GPUSD_LEASE`` set to the lease its host's daemon holds for it: the
    daemon knows the job's processes by it (they and their descendants), and when the lease ends
    without a release (the launcher killed, cut off) it stops them before granting the GPUs again."""
    from dataclasses import replace

    if res is None:
        return list(cmds)
    return [replace(c, env={**c.env, "GPUSD_LEASE": res.parts[c.rank].lease_id}) for c in cmds]


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


def _silence(res: "Reservation | None") -> float:
    """How long a remote rank runs on without hearing from gpusd (a cut link) before it is stopped: a
    quarter of the leases' TTL (2-10 s), so that with the default --grace it is gone before the lease
    can end (TTL - TTL/3 after the last renewal at the earliest); 10 s without a reservation."""
    if res is None:
        return 10.0
    return max(2.0, min(10.0, min(part.ttl for part in res.parts) / 4))


def asyncio_run(coro: "Coroutine[Any, Any, int]") -> int:
    import asyncio

    return asyncio.run(coro)


async def run_holding(commands: Sequence["HostCommand"], opts: "LaunchOptions", res: "Reservation | None") -> int:
    """Run ``commands`` while ``res`` is renewed beside them; stop every host if a lease is lost
    (expired, its daemon restarted): the GPUs are no longer ours."""
    import asyncio

    from ..engines.launch import Launch

    job = Launch(commands, opts)
    lost = False

    async def watch() -> None:
        nonlocal lost
        assert res is not None
        while not res.lost.is_set():
            await asyncio.sleep(0.5)
        lost = True
        job.stderr.write("gpusd: the reservation was lost (expired, or a daemon restarted): stopping every host\n")
        job.stderr.flush()
        job.stop()

    watcher = asyncio.ensure_future(watch()) if res is not None else None
    try:
        status = await job.run()
    finally:
        if watcher is not None:
            watcher.cancel()
    return (status or 1) if lost else status


# -- gpusd ray up / down -----------------------------------------------------------------------------------
RAY_DIR = "ray"  # under the state directory: one record per cluster, ray/ID.json


def _ray_state(args: argparse.Namespace) -> Path:
    from ..identity import state_dir

    return Path(args.state_dir) if getattr(args, "state_dir", None) else state_dir()


def _clusters(args: argparse.Namespace) -> dict[str, tuple[Path, dict[str, Any]]]:
    """The clusters gpusd started and remembers here: id -> (record file, record).  An unreadable
    record is skipped with a line; the single record of gpusd 0.2 (``ray-placement.json``) counts too."""
    from ..engines.placement import Placement, PlacementError

    state = _ray_state(args)
    paths = sorted((state / RAY_DIR).glob("*.json")) if (state / RAY_DIR).is_dir() else []
    if (state / RAY_STATE).is_file():
        paths.append(state / RAY_STATE)
    out: dict[str, tuple[Path, dict[str, Any]]] = {}
    for path in paths[:256]:
        try:
            if path.is_symlink():
                raise ValueError("a symbolic link")
            with open(path, "rb") as f:
                record = json.loads(f.read(1 << 20))
            p = Placement.from_dict(record["placement"])
        except (OSError, ValueError, KeyError, TypeError, PlacementError) as exc:
            print(f"{_prog()}: skipping the unreadable cluster record {path}: {exc}", file=sys.stderr)
            continue
        record["id"] = p.job_id  # the id is the placement's job id (checked by Placement)
        out[p.job_id] = (path, record)
    return out


def _guard_margin(res: "Reservation") -> tuple[float, float]:
    """How long before a lease's end its host stops the engine, and the SIGTERM-to-SIGKILL grace."""
    margin = max(1.0, min(part.ttl for part in res.parts) / 4)
    return round(margin, 2), round(margin / 2, 2)


def guarded(cmds: Sequence["HostCommand"], leases: Sequence[str], python: str | None, margin: float,
            grace: float) -> list["HostCommand"]:
    """Each host's command under that host's guard (gpusd.engines.hold), watching the lease its daemon
    holds for it: the engine is stopped on that host before the lease can end.  ``python``: the one
    with gpusd on the hosts (None: ``python3`` there, this very Python on this machine)."""
    from ..engines.generate import HostCommand

    return [HostCommand(c.slot, c.rank, [*_guard(c.slot, python), "--lease", lease, "--margin", f"{margin:g}",
                                         "--grace", f"{grace:g}", "--", *c.argv],
                        # the host's daemon knows the ranks by it: a lease ended without a release
                        # stops them there before its GPUs are granted again (daemon.fence)
                        {**c.env, "GPUSD_LEASE": lease}, c.files)
            for c, lease in zip(cmds, leases)]


def _guard(slot: "HostSlot", python: str | None) -> list[str]:
    """``PYTHON -m gpusd.engines.hold`` for ``slot``: ``python``, else this very Python on this
    machine, and on the others the one ``gpusd launch`` finds (this machine's interpreter where the
    same path is there and safe, else the ``gpusd`` on the host's PATH)."""
    from ..engines.generate import python_module
    from ..engines.launch import LaunchOptions, is_local

    if python is None and is_local(slot, LaunchOptions()):
        python = sys.executable
    return python_module("gpusd.engines.hold", python, what="gpusd ray up")


def ray_up(args: argparse.Namespace) -> int:
    """Reserve (``-n``), start Ray on every host — each node under a guard that stops it before that
    host's lease can end — and hand the reservation to a background renewer (until ``--for`` is up,
    then the leases run out) that ``gpusd ray down`` stops, which releases the GPUs."""
    import time

    from ..engines import generate as g
    from ..ids import PlacementId
    from ..units import format_clock

    extra = list(args.ray_args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    head_extra = [*extra, *args.head_option]
    worker_extra = [*extra, *args.worker_option]
    # a renewer process holds the reservation from the start (starting Ray may take longer than a TTL);
    # at the end of --for it lets the leases expire, so that every host's guard stops Ray first
    until = _until(args) if args.count is not None else None
    p, res, pid = acquire(args, "gpusd ray up", until, PlacementId.new(), {"at_end": "expire"})
    record: dict[str, Any] = {"id": p.job_id, "placement": p.to_dict(), "port": args.port, "python": args.python,
                              "address": g.ray_address(p, args.port), "started": time.time()}
    if res is not None:
        record.update(_renewer_record(pid), until=until, leases=[part.to_dict() for part in res.parts])
    cmds = g.ray_commands(p, port=args.port, ray=args.ray, extra=head_extra, worker_extra=worker_extra)
    if res is not None:
        margin, grace = _guard_margin(res)
        cmds = guarded(cmds, [part.lease_id for part in res.parts], args.python, margin, grace)
    opts = _options(args, watchdog=False, stop_on_failure=True)
    path = _ray_state(args) / RAY_DIR / f"{p.job_id}.json"
    if res is None and p.job_id in _clusters(args):  # a --placement file's job id: the same cluster twice
        raise SystemExit(f"{_prog()}: a Ray cluster {p.job_id} is already up (gpusd ray down {p.job_id}), "
                         "or give the placement another job_id")
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        _write(str(path), json.dumps(record) + "\n", 0o600)
        # the head first: the workers join it; what the hosts say goes to stderr (stdout: the address)
        status, failures = _start_ray(cmds[:1], opts)
        if status == 0 and len(cmds) > 1:
            status, failures = _start_ray(cmds[1:], opts)
    except BaseException:
        if res is not None and path.exists():  # stop what started before the GPUs go back
            _stop_cluster(args, record)
        _end_renewer(record)
        _forget_cluster(path)
        raise
    if status != 0:
        _say_ray_failed(failures, status)
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


def _start_ray(cmds: Sequence["HostCommand"], opts: "LaunchOptions") -> tuple[int, list["Failure"]]:
    """Run ``ray start`` on these hosts, their output on stderr; the status and the hosts that failed."""
    from ..engines.launch import Launch

    job = Launch(cmds, opts, stdout=sys.stderr)
    status = asyncio_run(job.run())
    return status, job.failures


def _say_ray_failed(failures: Sequence["Failure"], status: int) -> None:
    """Why ``ray up`` failed, host by host: the last lines of what ``ray start`` (or ssh, or the guard)
    said there — the real cause, whatever it is."""
    from ..sanitize import for_terminal

    if not failures:
        print(f"{_prog()}: ray up failed (status {status})", file=sys.stderr)
    for f in failures:
        what = "ssh failed" if f.status == 255 else f"status {f.status}"
        said = "; ".join(for_terminal(line, 300) for line in f.tail[-3:]) or "no output"
        print(f"{_prog()}: ray up failed on {for_terminal(f.label, 80)} ({what}): {said}", file=sys.stderr)


def _forget_cluster(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def _stop_cluster(args: argparse.Namespace, record: dict[str, Any]) -> int:
    """Stop Ray on every host of a cluster: its guards (which stop that node's processes, and only
    those, and return once they are gone) where gpusd reserved the GPUs, else ``ray stop --force``."""
    from ..engines import generate as g
    from ..engines.launch import run_commands
    from ..engines.placement import Placement
    from ..ids import LeaseId

    p = Placement.from_dict(record["placement"])
    leases = [d["lease_id"] for d in record.get("leases") or []
              if isinstance(d, dict) and LeaseId.is_valid(d.get("lease_id"))]
    opts = _options(args, watchdog=False, stop_on_failure=False)
    if leases and len(leases) == len(p.hosts):
        python = getattr(args, "python", None) or record.get("python")
        python = python if isinstance(python, str) and python else None
        # exit 3: no guard of that lease runs there (it stopped the node when the lease ended)
        cmds = [g.HostCommand(h, i, ["sh", "-c", '"$@" || [ $? -eq 3 ]', "gpusd-ray-down", *_guard(h, python),
                                     "--stop", "--lease", lease])
                for (i, h), lease in zip(enumerate(p.hosts), leases)]
        return run_commands(cmds, opts)
    return run_commands(g.ray_stop_commands(p, ray=args.ray), opts)


def _renewer_record(pid: int | None) -> dict[str, Any]:
    """What a record keeps of a renewer we just started (``pid``, our child, not yet waited for, so
    the pid is still its own): the pid and the kernel's start time of the process."""
    from ..alloc.queue import _process_start

    return {"renewer_pid": pid, "renewer_started": _process_start(pid) if pid is not None else None}


def _renewer_of(pid: object, started: object) -> int | None:
    """``pid`` if it is still the renewer that a record names: a process of ours running
    ``python -m gpusd.pool.renewer`` that started when the record says (``started``: the kernel's start
    time recorded with the pid; another renewer of the same user that reused the pid started later).
    A pid from a file is only signalled after checking what runs under it now."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 1:
        return None
    try:
        st = os.stat(f"/proc/{pid}")
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read(4096).split(b"\0")
    except OSError:
        return None
    if st.st_uid != os.getuid() or b"gpusd.pool.renewer" not in cmdline:
        return None
    if not _holder_alive(pid, started):  # a record without a start time (gpusd 0.2) is never acted on
        return None
    return pid


def _end_renewer(record: dict[str, Any], timeout: float = 15.0, release: bool = True) -> None:
    """Stop the reservation's renewer (SIGTERM: it releases the leases; without ``release``, SIGUSR1:
    they end with their TTL) and wait until it is gone."""
    import signal
    import time

    started = record.get("renewer_started")
    pid = _renewer_of(record.get("renewer_pid"), started)
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGTERM if release else signal.SIGUSR1)
    except OSError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:  # our own child (ray up failed)
                return
        except ChildProcessError:
            pass
        if _renewer_of(pid, started) is None:
            return
        time.sleep(0.05)
    print(f"{_prog()}: the renewer (pid {pid}) did not end; the leases expire with their TTL", file=sys.stderr)


def ray_down(args: argparse.Namespace) -> int:
    """Stop one cluster gpusd started (``ID``; the only one when there is one), or ``--all``: Ray first
    on every host, then the renewer, which releases the GPUs."""
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
            print(f"  {cid}  {_describe(record)}", file=sys.stderr)
        return 2
    else:
        chosen = sorted(clusters)
    status = 0
    for cid in chosen:
        path, record = clusters[cid]
        print(f"{_prog()}: stopping Ray cluster {cid} ({_describe(record)})", file=sys.stderr)
        sys.stderr.flush()
        stopped = _stop_cluster(args, record)
        status = stopped or status
        if stopped == 0:
            _end_renewer(record)  # Ray stopped on every host: the GPUs go back to the pool at once
        else:  # a host not reached: its guard stops Ray there before the lease runs out, then it is free
            _end_renewer(record, release=False)
            print(f"{_prog()}: not every host of {cid} could be reached: its leases are no longer renewed and end "
                  "within their TTL (each host's guard stops Ray there first)", file=sys.stderr)
        _forget_cluster(path)
    return status


def _describe(record: dict[str, Any]) -> str:
    """``10.0.0.1:6379, 2 hosts, held until 2026-12-02 19:10:48`` for a cluster record."""
    from ..sanitize import for_terminal
    from ..units import format_clock

    hosts = record.get("placement", {}).get("hosts") or []
    words = [for_terminal(str(record.get("address") or "?"), 80), f"{len(hosts)} host{'s' if len(hosts) != 1 else ''}"]
    until = record.get("until")
    if isinstance(until, (int, float)):
        words.append(f"held until {format_clock(until)}")
    return ", ".join(words)


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]", name: str) -> None:
    """The parsers of ``gpusd hostfile``, ``launch`` and ``ray up|down``."""
    from .options import command

    if name == "hostfile":
        p = command(sub, name, "gpusd.cli.engines:hostfile", "write what a distributed engine reads (DeepSpeed/MPI "
                    "hostfile, Horovod -H, torchrun lines, JSON)", parents=placement_parents())
        add_placement_flags(p, hold="2h")
        p.add_argument("--format", "-f", choices=FORMATS, default="json", help="what to write (default json)")
        p.add_argument("--held", metavar="FILE", help=argparse.SUPPRESS)  # Horovod's discovery script
        p.add_argument("--port", type=_port, default=None,
                       help="in the command lines printed: torchrun's rendezvous port (default 29400), DeepSpeed's "
                       "master port (default 29500) or the Ray head's port (default 6379)")
        p.add_argument("--output", metavar="FILE", help="write to FILE and print the engine's command line using it")
        p.add_argument("args", nargs=argparse.REMAINDER, metavar="-- PROGRAM ...",
                       help="with -n: a command to run here while the GPUs are held (released at its end); "
                       "also the training program of the command lines shown")
    elif name == "launch":
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
