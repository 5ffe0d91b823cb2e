"""What runs where for ``gpusd launch`` and ``gpusd ray up``: each engine's per-host commands, the leases
they carry, the guards they run under, and how long a host waits before it stops on its own.

The CLI parses the flags and prints; everything decided from a placement and its reservation is here:

* :func:`commands_for` — one command per host (torchrun, DeepSpeed, a plain command) or one on the head
  (mpirun, horovodrun), CPU binding and Open MPI's ssh included;
* :func:`with_leases` — each host's command carries ``GPUSD_LEASE`` of its host's lease, so that host's
  daemon knows the job's processes (fencing, docs/pool.md);
* :func:`silence` and :func:`guard_margin` — from the leases' TTL: when a cut-off host stops its ranks,
  and when a Ray node's guard stops before its lease can end;
* :func:`guarded` — each Ray node's ``ray start`` under its host's guard (:mod:`.hold`);
* :func:`run_holding` — run a launch while its reservation is renewed, stopping every host if it is lost.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import sys
import threading
from dataclasses import replace
from typing import Sequence

from . import generate as g
from .generate import HostCommand
from .launch import Launch, LaunchOptions, is_local
from .placement import HostSlot, Placement

ENGINES = ("torchrun", "deepspeed", "mpirun", "horovodrun", "command")
HOLD_MODULE = "gpusd.engines.hold"
# read by gpusd.engines.rank_gpu
RANK_LEASES_VAR = "GPUSD_RANK_LEASES"


def rsh_agent(ssh_options: Sequence[str]) -> str | None:
    """``ssh -F $GPUSD_SSH_CONFIG -o ...`` for engines that ssh by themselves, when gpusd's ssh has
    settings of its own (else the engine's default ssh already reads the user's config)."""
    config = os.environ.get("GPUSD_SSH_CONFIG")
    options = list(ssh_options)
    if not config and not options:
        return None
    words = ["ssh", *(["-F", config] if config else []), *[w for o in options for w in ("-o", o)]]
    return " ".join(shlex.quote(w) for w in words)


def commands_for(engine: str, p: Placement, rest: Sequence[str], *, port: int | None = None,
                 python: str | None = None, bind_cpus: bool = False, env_names: Sequence[str] = (),
                 ssh_options: Sequence[str] = (), leases: Sequence[str] | None = None) -> list[HostCommand]:
    """The commands of ``gpusd launch ENGINE -- REST`` on placement ``p``.  ``port``: torchrun's
    rendezvous or DeepSpeed's master port (default theirs); ``python``: the Python with gpusd on the
    hosts (None: found there); ``env_names``: the ``--env`` names (passed to MPI's ranks with ``-x``);
    ``leases``: each host's lease, in placement order (MPI's and Horovod's ranks on the other hosts get
    their host's through the rank wrapper, ``GPUSD_RANK_LEASES``)."""
    if engine in ("torchrun", "deepspeed", "command"):
        if engine == "torchrun":
            cmds = g.torchrun_commands(p, rest, port=port or g.RDZV_PORT)
        elif engine == "deepspeed":
            cmds = g.deepspeed_commands(p, rest, master_port=port or g.DS_MASTER_PORT)
        else:
            cmds = g.plain_commands(p, rest)
        # these start their ranks themselves on each host: the host's launcher is bound, the ranks inherit
        return g.bound(cmds, python=python) if bind_cpus else cmds
    # mpirun and horovodrun start the ranks themselves: one command, on the head; gpusd's per-rank
    # wrapper binds each rank (GPUSD_RANK_CPUS)
    env = g.mpi_env(p, bind_cpus)
    names = list(env_names)
    if leases is not None:
        env[RANK_LEASES_VAR] = ";".join(leases)
        names.append(RANK_LEASES_VAR)
    if engine == "mpirun":
        hosts = g.mpi_hostfile(p)
        extra = [w for name in names for w in ("-x", name)]
        argv = g.mpirun_argv(p, f"{g.FILES}/hostfile", rest, python=python, extra=extra, bind_cpus=bind_cpus)
        rsh = rsh_agent(ssh_options)
        # Open MPI's own ssh gets the same config and options as gpusd's
        if rsh:
            env["OMPI_MCA_plm_rsh_agent"] = rsh
        return [HostCommand(p.head, 0, argv, env, {"hostfile": hosts})]
    # horovodrun has no ssh command option: it reads the user's ~/.ssh/config (and --ssh-port,
    # --ssh-identity-file, which can follow ENGINE's arguments).
    return [HostCommand(p.head, 0, g.horovodrun_argv(p, rest, python=python), env)]


def with_leases(cmds: Sequence[HostCommand], leases: Sequence[str] | None) -> list[HostCommand]:
    """Each host's command with ``GPUSD_LEASE`` set to the lease its host's daemon holds for it
    (``leases``: in placement order; None: no reservation): the daemon knows the job's processes by it
    (they and their descendants), and when the lease ends without a release (the launcher killed, cut
    off) it stops them before granting the GPUs again."""
    if leases is None:
        return list(cmds)
    return [replace(c, env={**c.env, "GPUSD_LEASE": leases[c.rank]}) for c in cmds]


def silence(ttls: Sequence[float] | None) -> float:
    """How long a remote rank runs on without hearing from gpusd (a cut link) before it is stopped: a
    quarter of the leases' TTL (2-10 s), so that with the default --grace it is gone before the lease
    can end (TTL - TTL/3 after the last renewal at the earliest); 10 s without a reservation."""
    if not ttls:
        return 10.0
    return max(2.0, min(10.0, min(ttls) / 4))


def guard_margin(ttls: Sequence[float]) -> tuple[float, float]:
    """How long before a lease's end its host stops the engine, and the SIGTERM-to-SIGKILL grace."""
    margin = max(1.0, min(ttls) / 4)
    return round(margin, 2), round(margin / 2, 2)


def guard_argv(slot: HostSlot, python: str | None) -> list[str]:
    """``PYTHON -m gpusd.engines.hold`` for ``slot``: ``python``, else this very Python on this
    machine, and on the others the one ``gpusd launch`` finds (this machine's interpreter where the
    same path is there and safe, else the ``gpusd`` on the host's PATH)."""
    if python is None and is_local(slot, LaunchOptions()):
        python = sys.executable
    return g.python_module(HOLD_MODULE, python, what="gpusd ray up")


def guarded(cmds: Sequence[HostCommand], leases: Sequence[str], python: str | None, margin: float,
            grace: float) -> list[HostCommand]:
    """Each host's command under that host's guard (gpusd.engines.hold), watching the lease its daemon
    holds for it: the engine is stopped on that host before the lease can end.  ``python``: the one
    with gpusd on the hosts (None: found there, this very Python on this machine)."""
    return [HostCommand(c.slot, c.rank, [*guard_argv(c.slot, python), "--lease", lease, "--margin", f"{margin:g}",
                                         "--grace", f"{grace:g}", "--", *c.argv],
                        # the host's daemon knows the ranks by it: a lease ended without a release
                        # stops them there before its GPUs are granted again (daemon.fence)
                        {**c.env, "GPUSD_LEASE": lease}, c.files)
            for c, lease in zip(cmds, leases)]


async def run_holding(commands: Sequence[HostCommand], opts: LaunchOptions, lost: threading.Event | None) -> int:
    """Run ``commands`` while their reservation is renewed beside them (``lost``: set when a lease is
    lost — expired, its daemon restarted); stop every host then: the GPUs are no longer ours."""
    job = Launch(commands, opts)
    was_lost = False

    async def watch() -> None:
        nonlocal was_lost
        assert lost is not None
        while not lost.is_set():
            await asyncio.sleep(0.5)
        was_lost = True
        job.stderr.write("gpusd: the reservation was lost (expired, or a daemon restarted): stopping every host\n")
        job.stderr.flush()
        job.stop()

    watcher = asyncio.ensure_future(watch()) if lost is not None else None
    try:
        status = await job.run()
    finally:
        if watcher is not None:
            watcher.cancel()
    return (status or 1) if was_lost else status
