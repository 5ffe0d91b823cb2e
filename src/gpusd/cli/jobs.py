"""``gpusd jobs``, ``gpusd grow``, ``gpusd shrink`` and the job flags of ``gpusd run`` (docs/jobs.md)."""

# Imports inside functions: start-up (quick commands import this module).
from __future__ import annotations

import argparse
import os
import signal

from ..errors import ConfigError, GpusdError

# typing is not imported at run time: start-up time
TYPE_CHECKING = False

if TYPE_CHECKING:  # pragma: no cover
    from ..jobs.record import JobRecord

PRIORITY_NAMES = ("low", "normal", "high", "urgent")


def _signal(text: str) -> int:
    name = text.upper()
    if not name.startswith("SIG"):
        name = "SIG" + name
    try:
        return int(signal.Signals[name])
    except KeyError:
        try:
            return int(signal.Signals(int(text)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a signal: {text!r}") from None


def add_run_flags(p: argparse.ArgumentParser) -> None:
    from . import options as o

    g = p.add_argument_group("job")
    g.add_argument("--priority", choices=PRIORITY_NAMES, default="normal",
                   help="low, normal (default), high or urgent (root, or whom the priority policy names): orders the "
                   "--wait queue, and a waiting job may preempt --preemptible jobs of lower priority (docs/jobs.md)")
    g.add_argument("--preemptible", action="store_true",
                   help="this job may be stopped (SIGTERM, --grace, SIGKILL) and restarted later for a job of higher "
                   "priority, or moved off an overloaded GPU")
    g.add_argument("--pausable", action="store_true", help="may be paused (SIGSTOP) while its GPU is too hot")
    g.add_argument("--grace", type=o.grace, default=30.0, metavar="S",
                   help="seconds between SIGTERM and SIGKILL when preempted or moved (default 30)")
    g.add_argument("--time", type=o.positive_seconds, default=None, metavar="DUR",
                   help="stop the job when DUR (90s, 15m, 6h, 2d) has run out since it got its GPUs: SIGTERM to its "
                   "process group, SIGKILL after --grace; gpusd run then exits 124 and the history marks it timed "
                   "out.  A job with a limit may use GPUs booked for later (gpusd reserve --at) if it ends before "
                   "the booking starts.  The policy may set a default and a maximum per priority class")
    g.add_argument("--notify-signal", type=_signal, default=int(signal.SIGUSR1), metavar="SIG",
                   help="the signal that tells the job its GPUs changed (default SIGUSR1)")
    g.add_argument("--on-change", choices=("signal", "restart", "file"), default="signal",
                   help="how the command learns of a grow or shrink (the job file is rewritten first): signal "
                   "(default: --notify-signal), restart (stop it like a move: SIGTERM to its process group, --grace, "
                   "SIGKILL; start it again at once on the new GPUs, same lease: for torchrun, ray start, any "
                   "program that does not speak the protocol), or file (nothing: it polls the job file, as elastic "
                   "Horovod's discovery script does)")
    g.add_argument("--bind-cpus", action="store_true",
                   help="run the command on the CPUs local to its GPUs (NVML's CPU affinity, within the CPUs gpusd "
                   "may use; sched_setaffinity), and say which; off by default")
    g.add_argument("--cuda-checkpoint", action="store_true",
                   help="when NVIDIA's cuda-checkpoint is on PATH and can restore onto another GPU (driver r580+), "
                   "move this job by checkpointing its CUDA state and restoring it on the new GPU, without a "
                   "restart; otherwise, or if the tool fails, moves use the job protocol (docs/jobs.md)")
    g.add_argument("--follow-container", action="store_true",
                   help="with a detached container run (docker/podman/nerdctl run -d): wait for the container "
                   "(<runtime> wait) and end the lease when it exits (docs/allocation.md, \"Containers\")")


def _visible(records: list["JobRecord"], all_users: bool) -> list["JobRecord"]:
    if all_users:
        return records
    me = os.geteuid()
    return [r for r in records if r.uid == me]


def jobs(args: argparse.Namespace) -> int:
    import time

    from ..alloc.priority import priority_name
    from ..jobs.record import list_jobs
    from ..sanitize import dumps, for_terminal
    from ..units import format_duration
    from .table import render_table

    records = _visible(list_jobs(cleanup=True), args.all)
    if args.json:
        print(dumps({"jobs": [r.to_dict() for r in records]}, indent=2))
        return 0
    now = time.time()

    def cell(text: str | None, limit: int = 40) -> str:
        return for_terminal(text, limit) or "-"

    def gpus(r: "JobRecord") -> str:
        """How many GPUs, then which: ``2 (0,1)``; an index alone reads like a count."""
        names = list(r.labels) or [str(i) for i in r.indices]
        return f"{len(names)} ({cell(','.join(names), 64)})" if names else "0"

    rows = [[r.job, cell(r.user, 32), cell(r.state, 12), priority_name(r.priority) + ("*" if r.preemptible else ""),
             gpus(r), str(r.restarts), format_duration(now - r.started) if r.started else "-",
             format_duration(r.ends - now) if r.ends is not None else "-", cell(r.command)] for r in records]
    if not rows:
        print("no jobs" + ("" if args.all else " of yours (--all: every user's)"))
        return 0
    print(render_table(["JOB", "USER", "STATE", "PRIORITY", "GPUS", "RESTARTS", "AGE", "LEFT", "COMMAND"], rows))
    if any(r.preemptible for r in records):
        print("* preemptible")
    return 0


def _find(job: str) -> "JobRecord":
    from ..jobs.record import list_jobs

    prefix = job.strip().lower()
    found = [r for r in list_jobs() if prefix and r.job.startswith(prefix)]
    if not found:
        raise GpusdError(f"no running job {job!r} (gpusd jobs --all lists them)")
    if len(found) > 1:
        raise ConfigError(f"{job!r} names {len(found)} jobs: give more of the id")
    return found[0]


def _count(text: str | None, sign: str) -> int | None:
    if text is None:
        return None
    raw = text[1:] if text[:1] in "+-" else text
    if text[:1] in "+-" and text[:1] != sign:
        raise ConfigError(f"expected {sign}N, not {text!r}")
    try:
        n = int(raw)
    except ValueError:
        raise ConfigError(f"expected {sign}N (a number of GPUs), not {text!r}") from None
    if not 0 < n <= 64:
        raise ConfigError("a number of GPUs from 1 to 64")
    return n


def _ask(job: str, message: dict[str, object], timeout: float = 30.0) -> int:
    from ..jobs.control import refused, request

    rec = _find(job)
    # gpusd run --fleet: its lease is a daemon's, there is no supervisor to ask
    if rec.host is not None:
        from ..sanitize import for_terminal

        raise GpusdError(f"job {rec.job} is a fleet run (asked from {for_terminal(rec.host, 64)}): its GPUs are "
                         "a remote lease of the host's daemon, which grow and shrink cannot change")
    me = os.geteuid()
    if me not in (0, rec.uid):
        raise GpusdError(f"job {rec.job} belongs to {rec.user}: only its owner or root may change it")
    answer = request(rec.job, rec.uid, message, timeout=timeout)
    # docs/errors.md: the refusal's code
    failed = refused(answer, f"job {rec.job}: ")
    if failed is not None:
        raise failed
    devices = str(answer.get("devices") or "")
    holds = f"GPU{'s' if ',' in devices else ''} {devices}" if devices else "no GPU"
    told = str(answer.get("message") or "")
    told = told.split("; ", 1)[1] if told.startswith(f"job {rec.job} now holds") and "; " in told else told
    print(f"job {rec.job} now holds {holds}" + (f" ({told})" if told and " now holds " not in told else ""))
    return 0


def grow(args: argparse.Namespace) -> int:
    from .options import wait_timeout

    timeout = wait_timeout(args)
    n = _count(args.count, "+") or 1
    limit = 30.0 + (timeout if timeout is not None else (86400.0 if args.wait else 0.0))
    return _ask(args.job, {"op": "grow", "count": n, "wait": args.wait, "timeout": timeout}, timeout=limit)


def shrink(args: argparse.Namespace) -> int:
    if args.release is not None and args.count is not None:
        raise ConfigError("give -N or --release GPU, not both")
    n = _count(args.count, "-")
    return _ask(args.job, {"op": "shrink", "count": n, "release": args.release})


TOLD = ("The job file ($GPUSD_JOB_FILE) is rewritten, then the job is told as its --on-change says. With the "
        "default (signal) only a command that catches the notify signal (SIGUSR1 unless --notify-signal) is "
        "sent it; an unaware command (sleep, a script without a handler) is not signalled, keeps running on "
        "the GPUs it started with and sees the change only in the job file. The output says how it was told.")


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]", name: str) -> None:
    """The parsers of ``gpusd jobs``, ``grow`` and ``shrink``."""
    from . import options as o

    if name == "jobs":
        p = o.command(sub, name, "gpusd.cli.jobs:jobs", "list the jobs gpusd run started on this machine",
                      parents=[o.json_output()])
        p.add_argument("--all", action="store_true", help="every user's jobs (default: yours)")
    elif name == "grow":
        p = o.command(sub, name, "gpusd.cli.jobs:grow", "give a running job more GPUs: gpusd grow JOB +2", epilog=TOLD,
                      parents=[o.wait()])
        p.add_argument("job", help="the job id (a unique prefix is enough)")
        p.add_argument("count", nargs="?", default="+1", help="+N more GPUs (default +1)")
    else:
        p = o.command(sub, name, "gpusd.cli.jobs:shrink", "take GPUs back from a running job: gpusd shrink JOB -1",
                      epilog=TOLD)
        p.add_argument("job", help="the job id (a unique prefix is enough)")
        p.add_argument("count", nargs="?", default=None, help="-N GPUs fewer (default -1)")
        p.add_argument("--release", metavar="GPU", help="give back this GPU (index or UUID)")
