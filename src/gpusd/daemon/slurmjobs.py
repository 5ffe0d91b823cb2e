"""Leases the lease authority holds for Slurm jobs (docs/slurm.md, "One authority per GPU").

``gpusd slurm prolog`` (Slurm's Prolog, run as root by slurmd) sends one request on the lease socket::

    {"op": "slurm", "v": 2, "action": "begin", "slurm_job": "42", "uid": 1000, "devices": ["0", "1"]}

and ``gpusd slurm epilog`` ``{"op": "slurm", "v": 2, "action": "end", "slurm_job": "42"}``.  Only a
peer the kernel reports as root (``SO_PEERCRED``) is obeyed: Slurm's prolog runs as root, and whoever
is root could take the locks anyway.  ``begin`` takes the very same flock leases a local ``gpusd run``
takes, on exactly the GPUs Slurm gave (``devices``: Slurm's numbers -- positions in the gres.conf this
daemon wrote, :attr:`SlurmJobs.order` -- or UUIDs), through the allocation
path of every other lease (:func:`gpusd.alloc.api.allocate`, same mutex, same lock directory), with a
record naming the job's user, ``slurm job 42`` as its command and ``slurm_job``; the daemon keeps the
descriptors until ``end`` (or until it stops: see docs/slurm.md).  A GPU Slurm chose that gpusd has
leased already refuses the ``begin`` (``no_gpu``): the prolog fails, and Slurm drains the node and
requeues the job — a GPU is never given by both.  ``begin`` for a job already held answers what it holds
(a prolog run twice); ``end`` for a job not held answers ``released: []``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any, Callable

from ..errors import ConfigError
from ..ids import SlurmJobId
from .leasereq import constraints

log = logging.getLogger("gpusd.slurm")

MAX_DEVICES = 64


def parse(req: dict[str, Any]) -> tuple[str, str, int | None, list[str]]:
    """(action, slurm_job, uid, devices) of a request, checked; ConfigError when malformed."""
    action = req.get("action")
    if action not in ("begin", "end"):
        raise ConfigError("bad 'action' in the slurm request (begin or end)")
    job = req.get("slurm_job")
    if not SlurmJobId.is_valid(job):
        raise ConfigError("bad 'slurm_job' in the slurm request (a Slurm job id)")
    if action == "end":
        return action, job, None, []
    uid = req.get("uid")
    if type(uid) is not int or not 0 <= uid < 2**32:
        raise ConfigError("bad 'uid' in the slurm request")
    devices = req.get("devices")
    if (not isinstance(devices, list) or not 0 < len(devices) <= MAX_DEVICES
            or not all(isinstance(d, str) and 0 < len(d) <= 128 for d in devices)):
        raise ConfigError(f"bad 'devices' in the slurm request (1 to {MAX_DEVICES} GPU indices or UUIDs)")
    return action, job, uid, list(dict.fromkeys(devices))


class SlurmJobs:
    """The Slurm jobs' leases of one lease authority: job id -> its Selection.  With ``state`` (a
    file in the daemon's state directory), the jobs held are remembered there, so that a restarted
    daemon can take their leases again (:func:`restore`)."""

    def __init__(self, state: Path | None = None) -> None:
        self.held: dict[str, Any] = {}
        self.lock = threading.Lock()
        self.state = state
        # job -> {"uid", "devices"}: what ``state`` holds
        self.records: dict[str, dict[str, Any]] = {}
        # The UUIDs of the GPUs in the gres.conf this daemon wrote, in its order: Slurm numbers a node's
        # GPUs by their position there, so the prolog's "0" is order[0], whatever NVML calls it.  None:
        # no gres.conf written here (an admin's own): a number is then NVML's index.
        self.order: list[str] | None = None
        # jobs held again although the controller could not say they run
        self.unsure: set[str] = set()

    def _save(self) -> None:
        """Write ``records`` to ``state`` (atomically; call with ``lock`` held)."""
        if self.state is None:
            return
        tmp = self.state.with_name(f".{self.state.name}.{os.getpid()}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({"format": 1, "jobs": self.records}, f)
            os.replace(tmp, self.state)
        except OSError as exc:
            log.warning("cannot remember the Slurm jobs in %s: %s", self.state, exc)

    def remembered(self) -> dict[str, dict[str, Any]]:
        """The jobs ``state`` names (checked; a broken file is logged and read as none)."""
        if self.state is None:
            return {}
        try:
            with open(self.state, "rb") as f:
                d = json.loads(f.read(1 << 20))
            jobs = d.get("jobs") if isinstance(d, dict) else None
            if not isinstance(jobs, dict):
                raise ValueError("no jobs")
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("ignoring %s: %s", self.state, exc)
            return {}
        out: dict[str, dict[str, Any]] = {}
        for job, rec in list(jobs.items())[:4096]:
            try:
                parse({"action": "begin", "slurm_job": job, **(rec if isinstance(rec, dict) else {})})
            except ConfigError:
                continue
            out[job] = {"uid": rec["uid"], "devices": list(rec["devices"])}
        return out

    def begin(self, job: str, uid: int, devices: list[str], snapshot: Callable[[], Any],
              grant: Callable[[dict[str, Any], int, int], Any]) -> Any:
        """Lease ``devices`` for Slurm job ``job`` of ``uid`` (on the executor).  ``snapshot``: the
        daemon's GPUs; ``grant(kwargs, pid, uid)``: the authority's own grant."""
        with self.lock:
            if job in self.held:
                return self.held[job]
        snap = snapshot()
        order = self.order
        uuids: list[str] = []
        for d in devices:
            # Slurm's number: a position in the gres.conf written
            if order is not None and d.isdigit():
                if int(d) >= len(order):
                    raise ConfigError(f"Slurm job {job}: Slurm names GPU {d}, but the gres.conf gpusd wrote "
                                      f"lists {len(order)}")
                d = order[int(d)]
            gpu = next((g for g in snap.gpus if (order is None and str(g.index) == d) or g.uuid == d), None)
            if gpu is None:
                raise ConfigError(f"Slurm job {job}: this host has no GPU {d[:64]!r}")
            uuids.append(gpu.uuid)
        kwargs = constraints({"op": "lease", "count": len(uuids), "include": uuids, "topology": "any",
                              "command": f"slurm job {job}"})
        selection = grant(kwargs, os.getpid(), uid)
        with self.lock:
            # two prologs raced: keep one
            if job in self.held:
                selection.release()
                return self.held[job]
            self.held[job] = selection
            self.records[job] = {"uid": uid, "devices": list(selection.uuids)}
            self._save()
        log.info("Slurm job %s (uid %d): leased %s (lease %s)", job, uid, ",".join(selection.uuids),
                 getattr(selection.lease, "lease_id", "?"))
        return selection

    def end(self, job: str) -> list[str]:
        with self.lock:
            selection = self.held.pop(job, None)
            if self.records.pop(job, None) is not None:
                self._save()
        if selection is None:
            return []
        uuids = list(selection.uuids)
        selection.release()
        log.info("Slurm job %s ended: released %s", job, ",".join(uuids))
        return uuids

    def close(self) -> None:
        """The daemon stops: the leases end with it (the jobs stay remembered for :func:`restore`)."""
        with self.lock:
            held, self.held = self.held, {}
        for job, selection in held.items():
            log.warning("daemon stopping: the lease of Slurm job %s ends with it%s", job,
                        " (remembered: a restart takes it again while the job runs)" if self.state else "")
            selection.release()


def restore(jobs: SlurmJobs, begin: Callable[[dict[str, Any]], Any],
            running: Callable[[str], bool | None]) -> list[str]:
    """Take again the leases of the remembered jobs that still run; forget those the controller says
    have ended.  ``running(job)``: the controller's answer, None where it cannot be asked — such a job
    is held again too (a job is never taken for ended while Slurm may run it) and kept in
    ``jobs.unsure`` for :func:`recheck`.  ``begin``: the authority's answer to a ``begin`` request (as
    root).  Returns the jobs whose leases are held again."""
    back: list[str] = []
    for job, rec in jobs.remembered().items():
        state = running(job)
        if state is False:
            log.info("Slurm job %s has ended meanwhile: its lease is not taken again", job)
            continue
        reply = begin({"op": "slurm", "v": 2, "action": "begin", "slurm_job": job, "uid": rec["uid"],
                       "devices": rec["devices"]})
        if reply.get("ok") is True:
            back.append(job)
            if state is None:
                jobs.unsure.add(job)
                log.warning("Slurm job %s: the controller cannot be asked whether it still runs: its lease is "
                            "held again until the controller says it has ended or its epilog ends it", job)
            else:
                log.info("Slurm job %s still runs: its lease is held again", job)
        else:
            log.warning("Slurm job %s may still run but its GPUs cannot be leased again: %s", job,
                        reply.get("message"))
    with jobs.lock:
        jobs.records = {j: r for j, r in jobs.records.items() if j in back or j in jobs.held}
        jobs._save()
    return back


def recheck(jobs: SlurmJobs, running: Callable[[str], bool | None]) -> list[str]:
    """Ask the controller again about the jobs held without its word (:func:`restore`); end the leases
    of those it says have ended.  Returns the jobs still unsure."""
    for job in sorted(jobs.unsure):
        # its epilog came first
        if job not in jobs.held:
            jobs.unsure.discard(job)
            continue
        state = running(job)
        if state is None:
            continue
        jobs.unsure.discard(job)
        if state is False:
            log.info("Slurm job %s: the controller says it has ended: its lease ends", job)
            jobs.end(job)
        else:
            log.info("Slurm job %s: the controller says it still runs", job)
    return sorted(jobs.unsure)


def answer(req: dict[str, Any], peer_uid: int, jobs: SlurmJobs, snapshot: Callable[[], Any],
           grant: Callable[[dict[str, Any], int, int], Any]) -> dict[str, Any]:
    """The lease socket's answer to an ``{"op": "slurm", ...}`` request (on the executor)."""
    if peer_uid != 0:
        raise ConfigError("only root (Slurm's prolog and epilog) may record Slurm jobs")
    action, job, uid, devices = parse(req)
    if action == "end":
        return {"ok": True, "op": "slurm", "slurm_job": job, "released": jobs.end(job)}
    assert uid is not None
    selection = jobs.begin(job, uid, devices, snapshot, grant)
    return {"ok": True, "op": "slurm", "slurm_job": job, "lease_id": getattr(selection.lease, "lease_id", None),
            "devices": list(selection.uuids)}
