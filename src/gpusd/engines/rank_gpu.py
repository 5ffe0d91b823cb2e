"""Per-rank GPU wrapper for MPI and Horovod: ``python3 -m gpusd.engines.rank_gpu -- CMD ARGS``.

``mpirun -x VAR`` gives every rank the same value, so one ``CUDA_VISIBLE_DEVICES`` cannot give each
rank its own GPU.  Every rank gets ``GPUSD_RANK_GPUS`` (``node-1=0,2;node-2=1``: each host's GPUs, in
placement order) instead, and this wrapper picks its own: the host is the one Horovod names
(``HOROVOD_HOSTNAME``), or for Open MPI the one that world rank ``OMPI_COMM_WORLD_RANK`` falls on when
ranks fill the hosts in order (``--map-by slot``, which gpusd's command line sets; the local rank
``OMPI_COMM_WORLD_LOCAL_RANK`` must agree, else the mapping was changed and the wrapper refuses).  The
GPU is that host's entry number LOCAL_RANK.  It sets ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` and
``CUDA_VISIBLE_DEVICES`` and execs the command (exit 2 with a message on bad input, 127 if the command
cannot be run).  An AMD or Intel host's entries carry their vendor (``mi300=amd:GPU-...,amd:GPU-...``):
the rank then gets that vendor's variables (``ROCR_VISIBLE_DEVICES``, ``ZE_AFFINITY_MASK``;
docs/inventory.md "Vendors").  Imports nothing but the standard library for NVIDIA ranks: it runs once
per rank.
"""

from __future__ import annotations

import os
import sys
from typing import Mapping, Sequence

VAR = "GPUSD_RANK_GPUS"
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
    local = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK")
    if local is None:
        local = _int(env, "HOROVOD_LOCAL_RANK")
    if local is None:
        raise RankError("no local rank: run under Open MPI's mpirun or horovodrun "
                        "(OMPI_COMM_WORLD_LOCAL_RANK / HOROVOD_LOCAL_RANK)")
    hostname = env.get("HOROVOD_HOSTNAME")
    if hostname is not None:
        found = [d for name, d in hosts if name == hostname]
        if not found:
            raise RankError(f"host {hostname[:60]!r} is not in the placement")
        devices = found[0]
    else:
        world = _int(env, "OMPI_COMM_WORLD_RANK")
        if world is None:
            raise RankError("no world rank (OMPI_COMM_WORLD_RANK)")
        first = 0
        for _name, d in hosts:
            if world < first + len(d):
                if world - first != local:
                    raise RankError(f"rank {world} has local rank {local}, not {world - first}: ranks were not "
                                    "mapped by slot in hostfile order (keep mpirun's --map-by slot)")
                devices = d
                break
            first += len(d)
        else:
            raise RankError(f"rank {world} is beyond the {first} GPUs of the placement")
    if local >= len(devices):
        raise RankError(f"local rank {local} but only {len(devices)} GPUs on this host")
    return devices[local]


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "--":
        args = args[1:]
    if not args:
        print("usage: python3 -m gpusd.engines.rank_gpu -- CMD [ARGS...]", file=sys.stderr)
        return 2
    try:
        device = choose(os.environ)
    except RankError as e:
        print(f"gpusd rank_gpu: {e}", file=sys.stderr)
        return 2
    vendor, _, token = device.partition(":") if device.startswith(("amd:", "intel:")) else ("nvidia", "", device)
    if vendor == "nvidia":
        os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        os.environ["CUDA_VISIBLE_DEVICES"] = device
    else:
        if not (token.isdigit() or (token.startswith("GPU-") and len(token) <= 64)):
            print(f"gpusd rank_gpu: not a GPU: {token[:40]!r}", file=sys.stderr)
            return 2
        from ..alloc.env import Visible, cleared, visible_env

        visible = Visible(vendor, int(token) if token.isdigit() else 0, None if token.isdigit() else token)
        variables = visible_env([visible])
        for name in cleared([vendor]) - set(variables):
            os.environ.pop(name, None)
        os.environ.update(variables)
    try:
        os.execvp(args[0], args)
    except OSError as e:
        print(f"gpusd rank_gpu: cannot run {args[0]!r}: {e.strerror or e}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())
