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
    from ..engines.launch import LaunchOptions
    from ..engines.placement import Placement
    from ..pool.client import Reservation

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


def acquire(args: argparse.Namespace, note: str, until: float | None = None
            ) -> tuple["Placement", "Reservation | None", int | None]:
    """The placement a command works on, and the reservation that holds it: ``-n N [--per-host K]``
    and the constraints reserve GPUs across the fleet (the pool, docs/pool.md); ``--placement FILE``
    (or ``$GPUSD_PLACEMENT`` without ``-n``) reads a ready-made placement and reserves nothing (for
    testing and for placements made by other tools).

    The reservation is renewed from the moment it is made (before discovery stops, which may take longer
    than a TTL): by a background thread of this process while it runs (``until`` None; the caller
    releases), or by a renewer process (``python -m gpusd.pool.renewer``) until ``until`` (epoch), whose
    pid is returned third."""
    from ..engines.placement import new_job_id
    from ..errors import ConfigError  # wrong flags are usage errors (exit 2), as everywhere

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
    job_id = new_job_id()
    key = _key(args)
    client = _client(args, key)
    got: list[Reservation] = []
    pid: int | None = None
    try:
        got.append(_reserve(args, key, f"{job_id}: {note}"[:512], client))
        if until is None:
            got[0].start_renewing()
        else:
            pid = _start_renewer(got[0], secret(args) or "", until)
        client.stop_listening()  # slow (mDNS goodbyes): a Ctrl-C meanwhile must not leak the leases
        return got[0].to_placement(job_id), got[0], pid
    except BaseException:
        _end_renewer({"renewer_pid": pid})
        for res in got:
            res.release()
        client.stop_listening()
        raise


def _until(args: argparse.Namespace) -> float:
    """The end of ``--for`` (epoch)."""
    import time

    from ..usage.query import parse_duration

    try:
        return time.time() + parse_duration(args.duration)
    except ValueError as exc:
        raise SystemExit(f"{_prog()}: --for: {exc}") from None


def _release(res: "Reservation | None") -> None:
    if res is not None:
        res.release()


def add_placement_flags(p: argparse.ArgumentParser, with_count: bool = True, hold: str | None = None) -> None:
    """``-n``/``--per-host``, the constraints and the fleet flags of ``gpusd reserve`` (with
    ``with_count``), and ``--placement FILE``; ``hold``: the default of ``--for`` (how long a
    reservation outlives the command that made it)."""
    from . import _duration_text, _fleet_flags, _positive_seconds, _seconds, _Skipped

    if isinstance(p, _Skipped):
        return
    if with_count:
        from ..alloc.select import add_constraint_flags

        g = p.add_argument_group("what to reserve across the fleet (docs/pool.md)")
        add_constraint_flags(g)  # -n/--count and every constraint of gpusd reserve
        g.add_argument("--per-host", type=int, metavar="K", help="K GPUs on each of N/K hosts (default: all on one)")
        g.add_argument("--wait", action="store_true", help="wait (woken by the fleet's events) until GPUs qualify")
        g.add_argument("--timeout", type=_seconds, metavar="S", help="with --wait: give up after S seconds (exit 5)")
        g.add_argument("--host", metavar="GLOB", help="only hosts whose name matches")
        g.add_argument("--model", metavar="GLOB", help="only GPUs whose name matches (glob or substring)")
        g.add_argument("--ttl", type=_positive_seconds, default=30.0, metavar="S",
                       help="the leases end S seconds after their last renewal (default 30)")
        if hold:
            g.add_argument("--for", dest="duration", metavar="DURATION", default=hold, type=_duration_text,
                           help=f"without a command to wait for: hold the GPUs this long at most (default {hold}), "
                           "renewed in the background")
        p.set_defaults(count=None)  # -n absent: --placement
        for action in p._actions:
            if action.dest == "count":
                action.help = "reserve N GPUs in all across the fleet (or give --placement FILE)"
        _fleet_flags(p)
    p.add_argument("--placement", metavar="FILE",
                   help="testing/advanced: use the hosts and GPUs this JSON file names instead of reserving "
                   "(docs/engines.md; $GPUSD_PLACEMENT); excludes -n")


def add_ssh_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ssh-option", "-o", action="append", default=[], metavar="OPTION",
                   help="passed to ssh as -o OPTION (repeatable); ssh also reads $GPUSD_SSH_CONFIG as -F")
    from .jobs import grace

    p.add_argument("--grace", type=grace, default=10.0, metavar="S",
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


def _prog() -> str:
    from . import prog

    return prog()


# -- gpusd hostfile --------------------------------------------------------------------------------------
HELD_DIR = "jobs"  # under gpusd's state directory: what a job holds now, for Horovod's discovery script


def _held_path(job_id: str) -> Path:
    from ..identity import state_dir

    return state_dir() / HELD_DIR / f"{job_id}.json"


def _write_held(p: "Placement", holder_pid: int, until: float | None) -> Path:
    """Record what the job holds now (read by ``--format horovod-discovery --held FILE``)."""
    path = _held_path(p.job_id)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    _write(str(path), json.dumps({"placement": p.to_dict(), "pid": holder_pid, "until": until}) + "\n", 0o600)
    return path


def _forget_held(p: "Placement") -> None:
    try:
        _held_path(p.job_id).unlink()
    except OSError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def held_placement(path: str) -> "Placement | None":
    """What a job holds now: the placement in ``path`` while its holder (``gpusd hostfile -- CMD``,
    or the renewer of a reservation held ``--for`` a while) lives and the time is not up; else None."""
    import time

    from ..engines.placement import Placement

    try:
        with open(path, "rb") as f:
            d = json.loads(f.read(1 << 20))
        until = d.get("until")
        if until is not None and time.time() >= float(until):
            return None
        if not _alive(int(d["pid"])):
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
    cmd = list(args.args) if args.args else []
    until = _until(args) if args.count is not None and not cmd else None
    p, res, pid = acquire(args, f"gpusd hostfile --format {args.format}" + (f" -- {shlex.join(cmd)}" if cmd else ""),
                          until)
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
    import time

    from ..sanitize import for_terminal
    from .pool import release_command

    try:
        held_file = _write_held(p, pid, until)
        status = _hostfile_output(args, p, held_file, [])
    except BaseException:
        _end_renewer({"renewer_pid": pid})
        res.release()
        raise
    print(f"# held until {time.strftime('%H:%M:%S', time.localtime(until))} (--for {for_terminal(args.duration, 16)}) "
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
        text = "".join(f"{c.slot.hostname}: {c.shell()}\n" for c in g.torchrun_commands(p, cmd or ["train.py"]))
    else:  # ray
        text = "".join(f"{c.slot.hostname}: {c.shell()}\n" for c in g.ray_commands(p))
    if not out:
        sys.stdout.write(text)
        return 0
    _write(out, text, 0o755 if fmt == "horovod" else 0o644)
    # Say how to use what was written.
    rest = cmd or ["train.py"]
    if fmt == "deepspeed":
        line = g.deepspeed_argv(p, out, rest)
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

    if engine == "torchrun":
        return g.torchrun_commands(p, rest, port=args.port or g.RDZV_PORT)
    if engine == "deepspeed":
        return g.deepspeed_commands(p, rest, master_port=args.port or g.DS_MASTER_PORT)
    if engine == "command":
        return g.plain_commands(p, rest)
    # mpirun and horovodrun start the ranks themselves: one command, on the head.
    env = g.mpi_env(p)
    rsh = _rsh_agent(args)
    if engine == "mpirun":
        hosts = g.mpi_hostfile(p)
        extra = [w for name in _env_pairs(args.env) for w in ("-x", name)]
        argv = g.mpirun_argv(p, f"{g.FILES}/hostfile", rest, python=args.python, extra=extra)
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
        chdir = None if args.no_chdir else (args.chdir or os.getcwd())
        opts = _options(args, chdir=chdir, env=_env_pairs(args.env))
        return asyncio_run(run_holding(commands_for(args.engine, p, rest, args), opts, res))
    finally:
        _release(res)


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
def _ray_state(args: argparse.Namespace) -> Path:
    from ..identity import state_dir

    return Path(args.state_dir) if getattr(args, "state_dir", None) else state_dir()


def ray_up(args: argparse.Namespace) -> int:
    """Reserve (``-n``), start Ray on every host, and hand the reservation to a background renewer
    (until ``--for`` is up) that ``gpusd ray down`` stops, which releases the GPUs."""
    import time

    from ..engines import generate as g
    from ..engines.launch import run_commands

    extra = list(args.ray_args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    # a renewer process holds the reservation from the start (starting Ray may take longer than a TTL)
    until = _until(args) if args.count is not None else None
    p, res, pid = acquire(args, "gpusd ray up", until)
    state = _ray_state(args)
    record: dict[str, Any] = {"placement": p.to_dict(), "port": args.port}
    if res is not None:
        record.update(renewer_pid=pid, until=until, leases=[part.to_dict() for part in res.parts])
    cmds = g.ray_commands(p, port=args.port, ray=args.ray, extra=extra)
    opts = _options(args, watchdog=False, stop_on_failure=True)
    try:
        state.mkdir(parents=True, exist_ok=True)
        _write(str(state / RAY_STATE), json.dumps(record) + "\n", 0o600)
        status = run_commands(cmds[:1], opts)  # the head first: the workers join it
        if status == 0 and len(cmds) > 1:
            status = run_commands(cmds[1:], opts)
    except BaseException:
        _end_renewer(record)
        raise
    if status != 0:
        print(f"{_prog()}: ray up failed (status {status}); `gpusd ray down` stops what started and releases "
              "the GPUs", file=sys.stderr)
        return status
    print(g.ray_address(p, args.port))
    if res is not None:
        print(f"# the GPUs are held until `gpusd ray down` (at most until "
              f"{time.strftime('%H:%M:%S', time.localtime(record['until']))}, --for)", file=sys.stderr)
    return 0


def _renewer_of(pid: object) -> int | None:
    """``pid`` if it is still a renewer of ours (``python -m gpusd.pool.renewer``): a pid from a file is
    only signalled after checking what runs under it now."""
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
    return pid


def _end_renewer(record: dict[str, Any], timeout: float = 15.0) -> None:
    """Stop the reservation's renewer (SIGTERM: it releases the leases) and wait until it is gone."""
    import signal
    import time

    pid = _renewer_of(record.get("renewer_pid"))
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except OSError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:  # our own child (ray up failed)
                return
        except ChildProcessError:
            pass
        if _renewer_of(pid) is None:
            return
        time.sleep(0.05)
    print(f"{_prog()}: the renewer (pid {pid}) did not end; the leases expire with their TTL", file=sys.stderr)


def ray_down(args: argparse.Namespace) -> int:
    from ..engines import generate as g
    from ..engines.launch import run_commands
    from ..engines.placement import Placement

    record: dict[str, Any] = {}
    if getattr(args, "placement", None):
        p = placement_for(args)
    else:
        path = _ray_state(args) / RAY_STATE
        try:
            record = json.loads(path.read_text())
            p = Placement.from_dict(record["placement"])
        except (OSError, ValueError, KeyError, TypeError):
            if os.environ.get("GPUSD_PLACEMENT"):
                p = placement_for(args)
            else:
                print(f"{_prog()}: no Ray cluster started by gpusd here ({path}); give --placement FILE",
                      file=sys.stderr)
                return 1
    status = run_commands(g.ray_stop_commands(p, ray=args.ray), _options(args, watchdog=False, stop_on_failure=False))
    _end_renewer(record)  # Ray stopped (or not reachable): the GPUs go back to the pool
    try:
        (_ray_state(args) / RAY_STATE).unlink()
    except OSError:
        pass
    return status
