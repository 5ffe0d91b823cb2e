"""``gpusd hostfile``, ``gpusd launch`` and ``gpusd ray up/down``: distributed engines on a placement.

The placement (which hosts, which GPUs) comes from :func:`placement_for`: today a JSON file given with
``--placement`` (for testing and for placements made by other tools, see docs/engines.md); the pool's
reservation (issue 10) plugs in there, using ``-n``/``--per-host`` and the constraints.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from ..engines.generate import HostCommand
    from ..engines.launch import LaunchOptions
    from ..engines.placement import Placement

ENGINES = ("torchrun", "deepspeed", "mpirun", "horovodrun", "command")
FORMATS = ("deepspeed", "mpi", "horovod", "horovod-discovery", "torchrun", "ray", "json")
RAY_STATE = "ray-placement.json"


def placement_for(args: argparse.Namespace) -> "Placement":
    """The placement a command works on.  The pool replaces this with a reservation of ``args.count``
    GPUs (``args.per_host`` per host); for now it is read from ``--placement FILE`` (or
    ``$GPUSD_PLACEMENT``) and checked against ``-n``/``--per-host`` when they are given."""
    from ..engines.placement import Placement, PlacementError

    path = getattr(args, "placement", None) or os.environ.get("GPUSD_PLACEMENT")
    if not path:
        raise PlacementError("no placement: reserving across the fleet comes with the pool; for now give "
                             "--placement FILE (see docs/engines.md)")
    p = Placement.load(path)
    count = getattr(args, "count", None)
    if count is not None and count != p.total_gpus:
        raise PlacementError(f"-n {count}, but the placement has {p.total_gpus} GPUs")
    per_host = getattr(args, "per_host", None)
    if per_host is not None and any(h.slots != per_host for h in p.hosts):
        raise PlacementError(f"--per-host {per_host}, but the placement has "
                             f"{', '.join(f'{h.hostname}:{h.slots}' for h in p.hosts)}")
    return p


def add_placement_flags(p: argparse.ArgumentParser, with_count: bool = True) -> None:
    if with_count:
        p.add_argument("-n", "--count", type=int, metavar="N", help="GPUs in all (checked against the placement)")
        p.add_argument("--per-host", type=int, metavar="K", help="GPUs on every host")
    p.add_argument("--placement", metavar="FILE",
                   help="the hosts and GPUs to use, as JSON (docs/engines.md; $GPUSD_PLACEMENT); "
                   "for testing until the pool reserves them")


def add_ssh_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ssh-option", "-o", action="append", default=[], metavar="OPTION",
                   help="passed to ssh as -o OPTION (repeatable); ssh also reads $GPUSD_SSH_CONFIG as -F")
    p.add_argument("--grace", type=float, default=10.0, metavar="S",
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
def _discovery_source(args: argparse.Namespace) -> list[str]:
    """The command a Horovod discovery script runs: what gpusd holds now (the pool changes the source)."""
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
    from ..engines import generate as g

    p = placement_for(args)
    fmt = args.format
    out = args.output
    if args.args and args.args[0] == "--":
        args.args = args.args[1:]
    if fmt == "json":
        text = json.dumps(g.json_view(p), indent=2) + "\n"
    elif fmt == "deepspeed":
        text = g.deepspeed_hostfile(p)
    elif fmt == "mpi":
        text = g.mpi_hostfile(p)
    elif fmt == "horovod":
        text = g.horovod_discovery_script(_discovery_source(args)) if out else g.horovod_hosts(p) + "\n"
    elif fmt == "horovod-discovery":
        text = g.horovod_discovery_lines(p)
    elif fmt == "torchrun":
        text = "".join(f"{c.slot.hostname}: {c.shell()}\n" for c in g.torchrun_commands(p, args.args or ["train.py"]))
    else:  # ray
        text = "".join(f"{c.slot.hostname}: {c.shell()}\n" for c in g.ray_commands(p))
    if not out:
        sys.stdout.write(text)
        return 0
    _write(out, text, 0o755 if fmt == "horovod" else 0o644)
    # Say how to use what was written.
    rest = args.args or ["train.py"]
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
    from ..engines.launch import run_commands

    rest = list(args.args)
    if rest and rest[0] == "--":
        rest = rest[1:]
    if not rest:
        print(f"{_prog()}: launch needs the program to run after ENGINE: gpusd launch -n 4 torchrun -- train.py",
              file=sys.stderr)
        return 2
    p = placement_for(args)
    chdir = None if args.no_chdir else (args.chdir or os.getcwd())
    opts = _options(args, chdir=chdir, env=_env_pairs(args.env))
    return run_commands(commands_for(args.engine, p, rest, args), opts)


# -- gpusd ray up / down -----------------------------------------------------------------------------------
def _ray_state(args: argparse.Namespace) -> Path:
    from ..identity import state_dir

    return Path(args.state_dir) if getattr(args, "state_dir", None) else state_dir()


def ray_up(args: argparse.Namespace) -> int:
    from ..engines import generate as g
    from ..engines.launch import run_commands

    p = placement_for(args)
    extra = list(args.ray_args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    cmds = g.ray_commands(p, port=args.port, ray=args.ray, extra=extra)
    opts = _options(args, watchdog=False, stop_on_failure=True)
    status = run_commands(cmds[:1], opts)  # the head first: the workers join it
    if status == 0 and len(cmds) > 1:
        status = run_commands(cmds[1:], opts)
    state = _ray_state(args)
    state.mkdir(parents=True, exist_ok=True)
    _write(str(state / RAY_STATE), json.dumps({"placement": p.to_dict(), "port": args.port}) + "\n", 0o600)
    if status != 0:
        print(f"{_prog()}: ray up failed (status {status}); `gpusd ray down` stops what started", file=sys.stderr)
        return status
    print(g.ray_address(p, args.port))
    return 0


def ray_down(args: argparse.Namespace) -> int:
    from ..engines import generate as g
    from ..engines.launch import run_commands
    from ..engines.placement import Placement

    if getattr(args, "placement", None) or os.environ.get("GPUSD_PLACEMENT"):
        p = placement_for(args)
    else:
        path = _ray_state(args) / RAY_STATE
        try:
            p = Placement.from_dict(json.loads(path.read_text())["placement"])
        except (OSError, ValueError, KeyError, TypeError):
            print(f"{_prog()}: no Ray cluster started by gpusd here ({path}); give --placement FILE",
                  file=sys.stderr)
            return 1
    status = run_commands(g.ray_stop_commands(p, ray=args.ray), _options(args, watchdog=False, stop_on_failure=False))
    if status == 0:
        try:
            (_ray_state(args) / RAY_STATE).unlink()
        except OSError:
            pass
    return status
