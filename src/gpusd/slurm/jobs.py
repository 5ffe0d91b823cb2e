"""The Slurm side of "one authority per GPU": what ``gpusd slurm prolog`` and ``epilog`` send to the
local daemon's lease socket (docs/slurm.md; the daemon's side is :mod:`gpusd.daemon.slurmjobs`).

Slurm runs its Prolog and Epilog as root with the job in the environment: ``SLURM_JOB_ID``,
``SLURM_JOB_UID``, and the job's GPUs in ``SLURM_JOB_GPUS`` (positions in the node's gres.conf, not
NVML indices: the daemon maps them to the GPUs it wrote there) or ``CUDA_VISIBLE_DEVICES``.  The lease
is recorded through the daemon, never by writing lock files.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Mapping

from ..alloc.authority import _check, connect
from ..errors import ConfigError, GpusdError, NoDaemon
from ..ids import GpuUuid, SlurmJobId


def job_id(env: Mapping[str, str], given: str | None = None) -> str:
    job = given or env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or ""
    if not SlurmJobId.is_valid(job):
        raise ConfigError("no Slurm job id: run as Slurm's Prolog/Epilog ($SLURM_JOB_ID) or give --job ID")
    return job


def job_gpus(env: Mapping[str, str]) -> list[str]:
    """The job's GPUs from the prolog's environment (``SLURM_JOB_GPUS``, else ``CUDA_VISIBLE_DEVICES``);
    [] when the job has none."""
    raw = env.get("SLURM_JOB_GPUS") or env.get("SLURM_STEP_GPUS") or env.get("CUDA_VISIBLE_DEVICES") or ""
    out = [d.strip() for d in raw.split(",") if d.strip()]
    bad = [d for d in out if not (re.fullmatch(r"[0-9]{1,4}", d) or GpuUuid.is_valid(d))]
    if bad or len(out) > 64:
        raise ConfigError(f"cannot read the job's GPUs from {raw[:80]!r}")
    return out


def job_uid(env: Mapping[str, str]) -> int:
    raw = env.get("SLURM_JOB_UID") or env.get("SLURM_UID") or ""
    if not raw.isdigit() or int(raw) >= 2**32:
        raise ConfigError("no Slurm job user ($SLURM_JOB_UID)")
    return int(raw)


def ask(req: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
    """One request on the daemon's lease socket and its answer; NoDaemon when none answers."""

    sock = connect()
    if sock is None:
        raise NoDaemon("no gpusd daemon answers on the lease socket ($GPUSD_LEASE_SOCKET, default "
                       "/run/gpusd/lease.sock): start it with gpusd start --slurm")
    try:
        sock.settimeout(timeout)
        sock.sendall(json.dumps(req).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n") and len(data) < 1 << 20:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except (TimeoutError, OSError) as exc:
        raise GpusdError(f"the gpusd daemon did not answer: {exc}") from None
    finally:
        sock.close()
    try:
        reply = json.loads(data)
    except ValueError:
        raise GpusdError("the gpusd daemon's answer is not JSON (a daemon from before Slurm support?)") from None
    if not isinstance(reply, dict):
        raise GpusdError("the gpusd daemon's answer is not a JSON object")
    if reply.get("ok") is not True:
        _check(reply)
    return reply


def begin(env: Mapping[str, str], job: str | None = None, timeout: float = 10.0) -> dict[str, Any] | None:
    """The prolog: the job's GPUs become a lease held by the job (None: the job has no GPU)."""
    jid = job_id(env, job)
    devices = job_gpus(env)
    if not devices:
        return None
    return ask({"op": "slurm", "v": 2, "action": "begin", "slurm_job": jid, "uid": job_uid(env),
                "devices": devices}, timeout)


def end(env: Mapping[str, str], job: str | None = None, timeout: float = 10.0) -> dict[str, Any]:
    """The epilog: the job's lease ends."""
    return ask({"op": "slurm", "v": 2, "action": "end", "slurm_job": job_id(env, job)}, timeout)


def environ() -> Mapping[str, str]:
    return os.environ
