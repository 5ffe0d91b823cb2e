"""``gpusd select``, ``gpusd env``, ``gpusd run`` and ``gpusd leases``."""

# Imports inside functions: start-up (quick commands import this module).
from __future__ import annotations

import argparse

from ..errors import ConfigError

# typing is not imported at run time: start-up time
TYPE_CHECKING = False

if TYPE_CHECKING:  # pragma: no cover
    from typing import Callable

    from ..alloc.api import Selection


def _allocate(args: argparse.Namespace, command: str | None = None) -> "Selection":
    from ..alloc.api import LeaseRequest, allocate
    from ..alloc.handle import Holder
    from .options import to_constraints, wait_timeout

    timeout = wait_timeout(args)
    sel = allocate(LeaseRequest(to_constraints(args), lease=args.lease, wait=args.wait, timeout=timeout,
                                simulate=args.simulate, holder=Holder(command=command)))
    sel.use_uuid = args.uuid
    return sel


def select(args: argparse.Namespace) -> int:
    sel = _allocate(args)
    if args.json:
        from ..sanitize import dumps

        out = sel.to_dict()
        # select takes no lease (gpusd run does): no key that suggests one
        out.pop("lease", None)
        print(dumps(out, indent=2))
    else:
        from ..inventory.vendors import DEVICE_VARIABLE

        variables = sel.env()
        # the device list of each vendor chosen (CUDA_VISIBLE_DEVICES, ROCR_VISIBLE_DEVICES, ...)
        print(" ".join(variables[v] for v in DEVICE_VARIABLE.values() if v in variables)
              or variables.get("CUDA_VISIBLE_DEVICES", ""))
        if getattr(args, "explain", False) and sel.pick is not None:
            from ..sanitize import for_terminal

            for line in sel.pick.lines():
                print(for_terminal(line, 400))
    return 0


def fail_closed_lines() -> list[str]:
    """What ``gpusd env`` prints on stdout when it fails, so that ``eval "$(gpusd env ...)"`` fails
    closed: no GPU of any vendor visible (each runtime's own hide-all value: an empty
    ``CUDA_VISIBLE_DEVICES`` hides every NVIDIA GPU, but an empty ``HIP_VISIBLE_DEVICES`` or
    ``ZE_AFFINITY_MASK`` is no mask at all; :func:`gpusd.inventory.vendors.hide_all`) and eval's
    status non-zero (that of its last command).  The error itself goes to stderr as always
    (docs/cli.md)."""
    from ..inventory.vendors import hide_all

    return [*(f"export {k}={_quote(v)}" for k, v in hide_all().items()), "unset GPUSD_LEASE", "false"]


def env_failing_closed(run: Callable[[], int]) -> int:
    """Run ``gpusd env`` (``run``); on any failure (an error, bad usage, an exception, SIGTERM or
    SIGHUP: ``timeout 60 gpusd env --wait``) print :func:`fail_closed_lines` on stdout before giving the
    failure back.  (SIGKILL leaves nothing to print: eval then sees no output.)"""
    import signal
    import sys

    def stopped(signum: int, _frame: object) -> None:
        # the shell's status for a signal, after the fail-closed lines
        raise SystemExit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stopped)

    def closed() -> None:
        try:
            sys.stdout.flush()
        except OSError:
            pass
        print("\n".join(fail_closed_lines()), flush=True)

    try:
        rc = run()
    except SystemExit as exc:
        # argparse: bad usage (2); --help is 0
        if exc.code not in (0, None):
            closed()
        raise
    except BaseException:
        closed()
        raise
    if rc != 0:
        closed()
    return rc


def env(args: argparse.Namespace) -> int:
    from ..inventory.vendors import cleared

    sel = _allocate(args)
    variables = sel.env()
    # what would mask again after the vendor's own variable (HIP_VISIBLE_DEVICES beside ROCR_...)
    for key in sorted(cleared({d.vendor for d in sel.visible}) - set(variables)):
        print(f"unset {key}")
    for key, value in variables.items():
        if key in ("GPUSD_LEASE", "GPUSD_LEASE_EPOCH"):
            # the lease ends with this process: do not pretend otherwise
            continue
        print(f"export {key}={_quote(value)}")
    return 0


def run_command(args: argparse.Namespace) -> int:
    from .options import after_dashes

    cmd = after_dashes(args.cmd)
    if not cmd:
        raise ConfigError("no command given: gpusd run [options] -- CMD [ARGS...]")
    if getattr(args, "on_change", "signal") != "signal" and (getattr(args, "fleet", False) or not args.lease):
        raise ConfigError("--on-change is for local jobs, which grow and shrink: not with --fleet (fleet jobs keep "
                          "their GPUs) or --no-lease")
    if getattr(args, "bind_cpus", False) and getattr(args, "fleet", False):
        raise ConfigError("--bind-cpus is for local runs: not with --fleet (yet)")
    if getattr(args, "time", None) is not None and (getattr(args, "fleet", False) or not args.lease):
        raise ConfigError("--time is for local leased jobs: not with --fleet (yet) or --no-lease")
    if getattr(args, "fleet", False):
        from ..jobs.containers import parse

        # the remote side would not rewrite it
        if args.lease and parse(cmd, follow=True) is not None:
            raise ConfigError("a container run gets its leased GPUs on this machine only: not with --fleet (yet); "
                              "run it on the host with gpusd run, or with --no-lease")
        from .pool import run_fleet

        return run_fleet(args, cmd)
    # every leased run is a job (docs/jobs.md): its spec made here, run by the library
    if args.lease:
        from ..jobs.containers import parse
        from ..jobs.supervisor import run_job
        from .options import job_spec

        # a container run gets exactly the leased GPUs; what would bypass the lease is refused before one
        container = parse(cmd, follow=getattr(args, "follow_container", False))
        return run_job(job_spec(args, cmd, _join(cmd)[:512], container=container),
                       cuda_checkpoint=args.cuda_checkpoint)
    if getattr(args, "follow_container", False):
        raise ConfigError("--follow-container follows a leased container: not with --no-lease")
    from ..alloc.runner import run_with

    sel = _allocate(args, command=_join(cmd)[:512])
    return run_with(sel, cmd, bind_cpus=getattr(args, "bind_cpus", False))


def _quote(value: str) -> str:
    # here: select prints no shell words
    import shlex

    return shlex.quote(value)


def _join(cmd: list[str]) -> str:
    import shlex

    return shlex.join(cmd)


def _cell(text: str | None, limit: int = 40) -> str:
    """A table cell from another user's file: sanitised (gpusd.sanitize), bounded."""
    from ..sanitize import for_terminal

    return for_terminal(text, limit) or "-"


def _gpu_labels() -> dict[str, str]:
    """UUID -> the GPU's number as users choose it (``3``; a MIG slice ``3:1``), from this host's GPUs;
    empty where they cannot be read here (the lease list still names each device by UUID)."""
    from ..errors import GpusdError

    try:
        from ..alloc.api import shared_backend

        snap = shared_backend().snapshot(detail=False)
    except (GpusdError, OSError):
        return {}
    out = {g.uuid: str(g.index) for g in snap.gpus}
    out.update({m.uuid: f"{g.index}:{m.index}" for g in snap.gpus for m in g.mig_instances})
    return out


def _age(since: float | None, now: float) -> str:
    return f"{max(0.0, now - since):.0f}s" if since else "-"


def mutex_note(store: object, mutex: list[tuple[int, int | None]]) -> str:
    """One line naming who holds the selection mutex (``LeaseStore.mutex_holders``)."""
    from ..alloc.lockdir import holder_name

    path = getattr(store, "dir", "?")
    return (f"the selection mutex {path}/select.lock is held by {', '.join(holder_name(pid) for pid, _ in mutex)}: "
            "allocation in this lock directory waits for it (at most 10 s a try); stop that process, or ask an "
            "administrator")


def leases(args: argparse.Namespace) -> int:
    import time

    from ..alloc import queue
    from ..alloc.leases import LeaseStore
    from ..alloc.lockdir import user_name
    from ..alloc.policy import flag_over_cap, over_caps

    # lease files are other users' words: cells go through _cell
    from ..sanitize import dumps
    from .table import render_table

    store = LeaseStore()
    # a user over a cap is flagged (possible only outside the authority)
    held = flag_over_cap(store.leases())
    waiters = queue.waiters(store)
    mutex = store.mutex_holders()
    if args.json:
        print(dumps({"lock_dir": str(store.dir), "leases": [le.to_dict() for le in held],
                     "queued": [w.ticket for w in waiters],
                     "waiting": [w.to_dict() for w in waiters],
                     "mutex_holders": [{"pid": pid, "uid": uid, "user": user_name(uid) if uid is not None else None}
                                       for pid, uid in mutex]}, indent=2))
        return 0
    if mutex:
        print(mutex_note(store, mutex))
    now = time.time()
    # Lease records are files other users write: every string is made safe before it is printed.
    labels = _gpu_labels()
    rows = [[labels.get(le.device or "", "-"), _cell(le.device, 64), _cell(le.lease_id, 16),
             _cell(le.user, 32) + (" OVER CAP" if le.over_cap else ""),
             str(le.pid), "shared" if le.shared else "exclusive",
             f"{le.memory / 2**30:.1f}GiB" if le.memory else "-",
             _age(le.started, now), _cell(le.job, 16),
             ("[not through the authority] " if le.outside_authority else "") + _cell(le.command)] for le in held]
    blocked = sum(1 for le in held if le.unleased)
    outside = sum(1 for le in held if le.outside_authority)
    damaged = sum(1 for le in held if le.unreadable)
    print(f"lock directory {store.dir}: {len(held) - blocked} device lease(s), {len(waiters)} job(s) waiting"
          + (f"; {damaged} of them held with an unreadable record (see COMMAND)" if damaged else "")
          + (f"; {blocked} lock(s) held WITHOUT a lease (see COMMAND)" if blocked else "")
          + (f"; {outside} NOT through the lease authority (taken in the shared directory)" if outside else ""))
    for why in over_caps(held).values():
        print(f"over the cap: {_cell(why, 300)}")
    if rows:
        print(render_table(["GPU", "DEVICE", "LEASE", "USER", "PID", "MODE", "MEMORY", "AGE", "JOB", "COMMAND"], rows))
    if waiters:
        from ..alloc.priority import priority_name

        print("waiting (by priority, then first come, first served):")
        print(render_table(["#", "USER", "PID", "GPUS", "PRIORITY", "WAITING", "COMMAND"], [
            [str(w.position), _cell(w.user, 32), str(w.pid) if w.pid is not None else "-",
             str(w.count) if w.count is not None else "-",
             priority_name(w.priority) + (f"->{priority_name(w.level)}" if w.level != w.priority else "")
             + (" (preempted)" if w.resumed else ""), _age(w.since, now), _cell(w.command)]
            for w in waiters], right=(0, 2, 3, 5)))
    return 0


def _selection(p: argparse.ArgumentParser) -> None:
    """What ``select``, ``env`` and ``run`` add to the constraints: ``--no-lease`` and ``--uuid``."""
    g = next(g for g in p._action_groups if g.title == "constraints")
    g.add_argument("--no-lease", dest="lease", action="store_false", help="select only; take no lease")
    g.add_argument("--uuid", action="store_true", help="emit UUIDs instead of indices in CUDA_VISIBLE_DEVICES")


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]", name: str) -> None:
    """The parsers of ``gpusd select``, ``env``, ``run`` and ``leases``."""
    from . import options as o

    if name == "leases":
        o.command(sub, name, "gpusd.cli.alloc:leases", "list the GPU leases held on this machine",
                  parents=[o.json_output()])
        return
    helps = {"select": ("gpusd.cli.alloc:select",
                        "pick the least-loaded GPUs that satisfy constraints; takes no lease (gpusd run does)"),
             "env": ("gpusd.cli.alloc:env",
                     "print shell lines setting CUDA_VISIBLE_DEVICES: eval \"$(gpusd env -n 2)\""),
             "run": ("gpusd.cli.alloc:run_command", "run a command on leased GPUs: gpusd run -n 2 -- python train.py")}
    target, what = helps[name]
    parents = [o.constraints(), o.simulate()]
    if name == "select":
        parents.append(o.json_output("the selection as JSON: devices, env and explain"))
    if name == "run":
        parents += [o.host_filter(), o.ttl(), *o.fleet()]
    p = o.command(sub, name, target, what, parents=parents)
    _selection(p)
    if name == "select":
        p.add_argument("--explain", action="store_true", help="also say why these GPUs: the least-loaded set, the "
                       "links, the tolerance (docs/allocation.md)")
    if name != "run":
        p.set_defaults(lease=False)
        return
    from .jobs import add_run_flags

    g = p.add_argument_group("fleet")
    g.add_argument("--fleet", action="store_true",
                   help="run on the best verified host of the fleet, over SSH (docs/pool.md)")
    g.add_argument("--ssh-option", action="append", metavar="OPT", default=[],
                   help="with --fleet: an ssh -o option (repeatable); $GPUSD_SSH_CONFIG: an ssh -F file")
    add_run_flags(p)
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...", help="the command to run")
