"""Per-rank GPU wrapper for MPI and Horovod: ``python3 -m gpusd.engines.rank_gpu -- CMD ARGS``.

``mpirun -x VAR`` gives every rank the same value, so one ``CUDA_VISIBLE_DEVICES`` cannot give each
rank its own GPU.  Every rank gets ``GPUSD_RANK_GPUS`` (``node-1=0,2;node-2=1``: each host's GPUs, in
placement order) instead, and this wrapper picks its own: the host is the one Horovod names
(``HOROVOD_HOSTNAME``), or for Open MPI the one that world rank ``OMPI_COMM_WORLD_RANK`` falls on when
ranks fill the hosts in order (``--map-by slot``, which gpusd's command line sets; the local rank
``OMPI_COMM_WORLD_LOCAL_RANK`` must agree, else the mapping was changed and the wrapper refuses).  The
GPU is that host's entry number LOCAL_RANK.  It sets that GPU's visibility variables (NVIDIA:
``CUDA_DEVICE_ORDER=PCI_BUS_ID`` and ``CUDA_VISIBLE_DEVICES``) and execs the command (exit 2 with a
message on bad input, 127 if the command is not found, 126 if it cannot be executed).  An AMD or Intel
host's entries carry their vendor (``mi300=amd:GPU-...,amd:GPU-...``): the rank then gets that vendor's
variables (``ROCR_VISIBLE_DEVICES``, ``ZE_AFFINITY_MASK``; docs/inventory.md "Vendors").  The entries'
form and each vendor's variables are :mod:`gpusd.inventory.vendors`' (``rank_entry``,
``rank_entry_env``), imported once the rank's entry is found; at module level the wrapper imports the
standard library only, since it starts once per rank.

``gpusd launch --bind-cpus`` (docs/engines.md): with ``GPUSD_RANK_CPUS`` (``node-1=0-3/4-7;node-2=?``:
each GPU's local CPUs as its host's daemon claimed them, ``/`` between GPUs, ``?`` unknown, in the
order of ``GPUSD_RANK_GPUS``) the rank binds itself (``sched_setaffinity``) to its GPU's local CPUs
that it may use here, before the exec.  ``--bind-cpus LIST --for GPUS -- CMD`` binds to ``LIST`` the
same way and execs CMD without choosing a GPU: the per-host launchers (torchrun, DeepSpeed, a plain
command), whose ranks inherit it.  Each says on stderr what it did; a CPU list that does not parse,
or that names no CPU usable here, binds nothing (and says so).

With ``GPUSD_RANK_LEASES`` (each host's lease, ``;`` between them, in the order of ``GPUSD_RANK_GPUS``)
the rank also gets ``GPUSD_LEASE``, its own host's lease: that host's daemon knows the rank by it
(fencing, docs/pool.md), as it knows the ranks of engines gpusd starts on every host itself.
"""

# Imports inside functions: start-up (a command's own module).
from __future__ import annotations

import os
import sys
from typing import Mapping, Sequence

VAR = "GPUSD_RANK_GPUS"
CPUS_VAR = "GPUSD_RANK_CPUS"
LEASES_VAR = "GPUSD_RANK_LEASES"
UNKNOWN = "?"
MAX_LEN = 1 << 16


class RankError(Exception):
    pass


def parse(text: str) -> list[tuple[str, list[str]]]:
    if not text or len(text) > MAX_LEN:
        raise RankError(f"${VAR} is missing or too long (set by gpusd's mpirun/horovodrun command line)")
    hosts = []
    for part in text.split(";"):
        name, eq, devices = part.partition("=")
        items = [d for d in devices.split(",") if d]
        if not eq or not name or not items:
            raise RankError(f"${VAR} is malformed near {part[:60]!r}")
        hosts.append((name, items))
    return hosts


def _int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value is None:
        return None
    if not value.isdigit():
        raise RankError(f"${name} is not a rank: {value[:20]!r}")
    return int(value)


def choose(env: Mapping[str, str]) -> str:
    """The device (NVML index or UUID) for the rank described by ``env``."""
    hosts = parse(env.get(VAR, ""))
    at, local = locate(env, hosts)
    return hosts[at][1][local]


def lease_for(env: Mapping[str, str]) -> str | None:
    """The lease of the rank's host (``GPUSD_RANK_LEASES``), None without the variable; RankError when
    it does not match ``GPUSD_RANK_GPUS`` or names something that is not a lease id."""
    raw = env.get(LEASES_VAR)
    if raw is None:
        return None
    hosts = parse(env.get(VAR, ""))
    leases = raw[:MAX_LEN].split(";")
    if len(leases) != len(hosts):
        raise RankError(f"{LEASES_VAR} names {len(leases)} leases for {len(hosts)} hosts")
    lease = leases[locate(env, hosts)[0]]
    if not (0 < len(lease) <= 64 and all(c.isascii() and (c.isalnum() or c in "-_") for c in lease)):
        raise RankError(f"{LEASES_VAR}: not a lease id: {lease[:40]!r}")
    return lease


def rank_cpus(env: Mapping[str, str]) -> str | None:
    """The local CPUs (a CPU list, as claimed) of the rank's GPU from ``GPUSD_RANK_CPUS``; None when
    unknown.  RankError when the map does not match ``GPUSD_RANK_GPUS``."""
    hosts = parse(env.get(VAR, ""))
    at, local = locate(env, hosts)
    text = env.get(CPUS_VAR, "")
    if len(text) > MAX_LEN:
        raise RankError(f"${CPUS_VAR} is too long")
    cpus = [(name, lists.split("/")) for name, _, lists in (part.partition("=") for part in text.split(";"))]
    if [(n, len(c)) for n, c in cpus] != [(n, len(d)) for n, d in hosts]:
        raise RankError(f"${CPUS_VAR} does not match ${VAR} (set together by gpusd launch --bind-cpus)")
    value = cpus[at][1][local]
    return None if value == UNKNOWN else value


def bind(claimed: str | None, what: str, gpus: str) -> str:
    """Bind this process to the CPUs of ``claimed`` (a CPU list: the CPUs local to ``gpus``, as their
    host's daemon said) that it may use (its affinity now: a cgroup's cpuset, taskset, mpirun's
    binding); the line that says what was done."""
    head = f"gpusd: --bind-cpus: {what}"
    if claimed is None:
        return f"{head}: the CPUs local to GPU(s) {gpus} are unknown; not bound"
    from ..topology import format_cpulist, parse_cpulist

    try:
        if len(claimed) > 4096:
            raise ValueError("too long")
        wanted = parse_cpulist(claimed)
    except ValueError:
        return f"{head}: not a CPU list for GPU(s) {gpus}: {claimed[:40]!r}; not bound"
    try:
        allowed = frozenset(os.sched_getaffinity(0))
        chosen = wanted & allowed
        if not chosen:
            return (f"{head}: none of the CPUs local to GPU(s) {gpus} ({format_cpulist(wanted)}) may be used "
                    f"here ({format_cpulist(allowed)}); not bound")
        os.sched_setaffinity(0, chosen)
    except OSError as exc:
        return f"{head}: cannot set the CPU affinity ({exc.strerror or exc}); not bound"
    return f"{head}: bound to CPUs {format_cpulist(chosen)} (local to GPU(s) {gpus})"


def locate(env: Mapping[str, str], hosts: Sequence[tuple[str, Sequence[str]]]) -> tuple[int, int]:
    """Which host of ``hosts`` (its position) and which of its GPUs (the local rank) the rank of
    ``env`` is."""
    local = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK")
    if local is None:
        local = _int(env, "HOROVOD_LOCAL_RANK")
    if local is None:
        raise RankError("no local rank: run under Open MPI's mpirun or horovodrun "
                        "(OMPI_COMM_WORLD_LOCAL_RANK / HOROVOD_LOCAL_RANK)")
    hostname = env.get("HOROVOD_HOSTNAME")
    if hostname is not None:
        found = [i for i, (name, _d) in enumerate(hosts) if name == hostname]
        if not found:
            raise RankError(f"host {hostname[:60]!r} is not in the placement")
        at = found[0]
        devices = hosts[at][1]
    else:
        world = _int(env, "OMPI_COMM_WORLD_RANK")
        if world is None:
            raise RankError("no world rank (OMPI_COMM_WORLD_RANK)")
        first = 0
        for i, (_name, d) in enumerate(hosts):
            if world < first + len(d):
                if world - first != local:
                    raise RankError(f"rank {world} has local rank {local}, not {world - first}: ranks were not "
                                    "mapped by slot in hostfile order (keep mpirun's --map-by slot)")
                at, devices = i, d
                break
            first += len(d)
        else:
            raise RankError(f"rank {world} is beyond the {first} GPUs of the placement")
    if local >= len(devices):
        raise RankError(f"local rank {local} but only {len(devices)} GPUs on this host")
    return at, local


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "--":
        args = args[1:]
    if len(args) >= 5 and args[0] == "--bind-cpus" and args[2] == "--for" and args[4] == "--":
        # a per-host launcher (torchrun, DeepSpeed, a plain command): bind it, choose no GPU
        claimed, gpus, cmd = args[1], args[3], args[5:]
        if not cmd:
            print("usage: python3 -m gpusd.engines.rank_gpu --bind-cpus LIST --for GPUS -- CMD [ARGS...]",
                  file=sys.stderr)
            return 2
        print(bind(None if claimed == UNKNOWN else claimed, f"{os.path.basename(cmd[0])[:40]} and what it starts",
                   gpus[:200]), file=sys.stderr, flush=True)
        return _exec(cmd)
    if not args:
        print("usage: python3 -m gpusd.engines.rank_gpu -- CMD [ARGS...]", file=sys.stderr)
        return 2
    try:
        device = choose(os.environ)
        cpus = rank_cpus(os.environ) if CPUS_VAR in os.environ else None
        lease = lease_for(os.environ)
    except RankError as e:
        print(f"gpusd rank_gpu: {e}", file=sys.stderr)
        return 2
    if lease is not None:
        os.environ["GPUSD_LEASE"] = lease
    if CPUS_VAR in os.environ:
        rank = os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("HOROVOD_RANK") or "?"
        print(bind(cpus, f"rank {rank[:12]} (GPU {device})", device), file=sys.stderr, flush=True)
    # imported here, not at module level: the --bind-cpus path and a rank refused above never need them
    from ..inventory.vendors import rank_entry_env

    try:
        variables, inherited = rank_entry_env(device)
    except ValueError as e:
        print(f"gpusd rank_gpu: {e}", file=sys.stderr)
        return 2
    for name in inherited:
        os.environ.pop(name, None)
    os.environ.update(variables)
    return _exec(args)


def _exec(args: Sequence[str]) -> int:
    try:
        os.execvp(args[0], list(args))
    except OSError as e:
        from ..errors import exec_failure

        print(f"gpusd rank_gpu: cannot run {args[0]!r}: {e.strerror or e}", file=sys.stderr)
        return exec_failure(e, args[0])[0]


if __name__ == "__main__":
    sys.exit(main())
