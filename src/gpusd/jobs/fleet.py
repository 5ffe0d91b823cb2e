"""Fleet runs as jobs (docs/jobs.md, "Fleet runs").

``gpusd run --fleet`` takes a lease that a host's daemon holds (docs/pool.md) and runs the command
on that host.  The run is a job on both machines, under one id chosen by the machine that asks (the
daemon's lease record names it too):

* on the machine that runs the command, ``gpusd fleet-job`` (what ``gpusd run --fleet`` runs over
  ssh; in process when the chosen host is the asking machine itself) writes the job's record — an
  ordinary record of the user the command runs as, ``host`` = the machine that asked — and runs the
  command with the job protocol's environment (``GPUSD_JOB_ID``, ``GPUSD_JOB_FILE``, ...).  A fleet
  job's GPUs never change (its lease is the daemon's: no grow, shrink, preemption or move), so its
  job file is written once per start; exit status 75 starts the command again, on the same lease.
* on the machine that asked, a record of the same id whose ``labels`` name the GPUs it runs on
  (``HOST:INDEX``); its ``indices`` are empty (none of this machine's GPUs is the job's).

Records are written by :class:`gpusd.jobs.record.RecordWriter`, as every job's.  Writing one is best
effort: a fleet run whose record cannot be written (no usable lock directory) still runs, and says so.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from ..alloc.leases import LeaseStore, current_user
from ..alloc.lockdir import replace_file
from ..alloc.runner import FORWARDED
from ..errors import ConfigError, GpusdError, exec_failure
from ..ids import JobId, LeaseId
from ..sanitize import printable
from .child import private_dir, remove_private_dir
from .record import MAX_DEVICES, JobRecord, RecordWriter, list_jobs

# the protocol's "restart me" status (docs/jobs.md)
RESTART_ME = 75
FILE_FORMAT = 1
MAX_HOST = 255


def _say(message: str) -> None:
    print(f"gpusd: {message}", file=sys.stderr, flush=True)


def clean_host(text: str) -> str:
    """A host name for the informational ``host`` field: at most 255 printable characters."""
    return printable(text, MAX_HOST)


def device(d: object) -> dict[str, Any]:
    """One GPU of a fleet lease (``{"index", "uuid", "label"}``: what the daemon's answer and
    ``gpusd fleet-job --devices`` carry), typed and bounded; ValueError when it is not one."""
    index = d.get("index") if isinstance(d, dict) else None
    uuid = d.get("uuid") if isinstance(d, dict) else None
    if type(index) is not int or not 0 <= index < 4096:
        raise ValueError("each GPU needs an index from 0 to 4095")
    if not isinstance(uuid, str) or not 0 < len(uuid) <= 128 or not uuid.isprintable():
        raise ValueError("each GPU needs a UUID of 1 to 128 printable characters")
    label = d.get("label") if isinstance(d, dict) else None
    label = label if isinstance(label, str) and 0 < len(label) <= 64 and label.isprintable() else str(index)
    # 0.4: the grant's fencing token, when given
    epoch = d.get("epoch") if isinstance(d, dict) else None
    return {"index": index, "uuid": uuid, "label": label,
            **({"epoch": epoch} if type(epoch) is int and 0 < epoch < 2**63 else {})}


def valid_devices(devices: Sequence[object]) -> list[dict[str, Any]]:
    """The well-formed GPUs of ``devices`` (at most 64); the others are left out."""
    out = []
    for d in list(devices)[:MAX_DEVICES]:
        try:
            out.append(device(d))
        except ValueError:
            continue
    return out


def parse_devices(text: str) -> list[dict[str, Any]]:
    """``gpusd fleet-job --devices``: a JSON list of 1 to 64 GPUs; ConfigError when it is not one."""
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError):
        raise ConfigError("--devices: not JSON") from None
    if not isinstance(raw, list) or not 0 < len(raw) <= MAX_DEVICES:
        raise ConfigError(f"--devices: a list of 1 to {MAX_DEVICES} GPUs")
    try:
        return [device(d) for d in raw]
    except ValueError as exc:
        raise ConfigError(f"--devices: {exc}") from None


class FleetJob:
    """The job record of a fleet run on this machine (either side), and, where the command runs
    here, the command under the job protocol."""

    def __init__(self, job_id: str, command: str, host: str | None, store: LeaseStore | None = None) -> None:
        # IdError (a ConfigError): not a job id
        JobId.parse(job_id)
        self.store = store or LeaseStore()
        self.job_id = job_id
        self.writer: RecordWriter | None = None
        self.private: Path | None = None
        self.restarts = 0
        self.generation = 0
        try:
            # a 48-bit id met twice: keep both
            if any(r.job == job_id for r in list_jobs(self.store)):
                self.job_id = JobId.new()
                _say(f"a job {job_id} already runs here: this one is job {self.job_id}")
            writer = RecordWriter(self.store, JobRecord(
                job=self.job_id, pid=os.getpid(), user=current_user(), command=command, state="queued",
                started=time.time(), host=clean_host(host) if host else None))
            try:
                writer.write()
            except BaseException:
                writer.close()
                raise
            self.writer = writer
        except (GpusdError, OSError) as exc:
            _say(f"no job record for this fleet run (gpusd jobs will not list it): {exc}")

    def placed(self, devices: Sequence[dict[str, Any]], lease: str | None, remote: str | None = None) -> None:
        """The GPUs are leased: the record says which (``remote``: the host they are on, when it is not
        this machine) and that the job runs."""
        if self.writer is None:
            return
        good = valid_devices(devices)
        uuids, indices = [d["uuid"] for d in good], [d["index"] for d in good]
        labels = [f"{clean_host(remote)}:{i}" for i in indices] if remote is not None else []
        self.writer.write(state="running", devices=uuids, indices=[] if remote is not None else indices,
                          labels=labels, lease=LeaseId.optional(lease))

    def _write_job_file(self, devices: Sequence[dict[str, Any]], visible: str, epoch: str | None = None) -> Path:
        if self.private is None:
            self.private = Path(private_dir(self.job_id))  # mode 0700
        self.generation += 1
        path = self.private / "gpus.json"

        replace_file(path, self.private / f".gpus.{self.generation}.tmp", json.dumps({
            "format": FILE_FORMAT, "job": self.job_id, "generation": self.generation, "state": "running",
            "reason": None, "restarts": self.restarts, "cuda_visible_devices": visible,
            "devices": [{"index": d["index"], "uuid": d["uuid"], "label": d.get("label", str(d["index"])),
                         **({"epoch": d["epoch"]} if "epoch" in d else {})} for d in devices],
            # 0.4, additive: the lease's fencing token (GPUSD_LEASE_EPOCH, gpusd.alloc.epoch)
            **({"epoch": int(epoch)} if epoch is not None and epoch.isdigit() and len(epoch) <= 19 else {})}).encode())
        return path

    def run(self, cmd: Sequence[str], env: dict[str, str], devices: Sequence[dict[str, Any]],
            interactive: bool) -> int:
        """Run ``cmd`` (``env`` over this process's environment, plus the job protocol's variables)
        until it exits with anything but 75; signals to this process are passed on to it (not
        SIGINT/SIGQUIT at a terminal, which sent them to the command too).  Its exit status, or
        128 + the signal that ended it; 127/126 when it cannot be started."""
        proc: subprocess.Popen[bytes] | None = None
        stop = False

        def forward(signum: int, _frame: object) -> None:
            nonlocal stop
            if signum != signal.SIGUSR1:
                # a 75 after this ends the job: it was told to stop
                stop = True
            if signum in (signal.SIGINT, signal.SIGQUIT) and interactive:
                return
            if proc is not None and proc.poll() is None:
                try:
                    proc.send_signal(signum)
                except OSError:
                    pass

        previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
        try:
            while True:
                full = dict(os.environ)
                full.update(env)
                visible = full.get("CUDA_VISIBLE_DEVICES", "")
                full.update({"GPUSD_JOB_ID": self.job_id, "GPUSD_NOTIFY_SIGNAL": "SIGUSR1",
                             "GPUSD_RESTART_COUNT": str(self.restarts), "GPUSD_RESTART_STATUS": str(RESTART_ME)})
                try:
                    full["GPUSD_JOB_FILE"] = str(self._write_job_file(devices, visible, full.get("GPUSD_LEASE_EPOCH")))
                except OSError as exc:
                    # the protocol's file is a convenience: run without it
                    _say(f"cannot write the job file: {exc}")
                lease = full.get("GPUSD_LEASE")
                # cut off (a split) until its lease had ended
                if lease and lease_held(lease) is False:
                    _say(f"the lease {lease[:32]} ended before the command could start here (it expired: its "
                         "holder was cut off): not started")
                    return LEASE_GONE
                try:
                    proc = subprocess.Popen(list(cmd), env=full)
                except (FileNotFoundError, PermissionError) as exc:
                    status, why = exec_failure(exc, cmd[0])
                    _say(why)
                    return status
                # it ended as the command started: never run on
                if lease and lease_held(lease) is False:
                    _say(f"the lease {lease[:32]} ended as the command started: stopped")
                    _stop(proc)
                    return LEASE_GONE
                if self.writer is not None:
                    self.writer.write(child=proc.pid, restarts=self.restarts)
                rc = proc.wait()
                if rc == RESTART_ME and not stop:
                    self.restarts += 1
                    continue
                return rc if rc >= 0 else 128 - rc
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.private is not None:
            remove_private_dir(self.private)
            self.private = None


# the command did not run: its lease had ended (docs/pool.md, "Fencing")
LEASE_GONE = 1


def lease_held(lease_id: str) -> bool | None:
    """Whether this host's lease stores still show lease ``lease_id`` (the daemon's record of a remote
    lease goes when the lease ends, after its processes here were stopped); None where they cannot be
    read.  A fleet job's command starts only under a lease that is still held: one cut off from its
    holder until the lease expired would otherwise run on GPUs granted again."""
    try:
        return any(le.lease_id == lease_id for le in LeaseStore().leases())
    except Exception:  # noqa: BLE001 - unreadable stores: the daemon's fence still guards the GPUs
        return None


def _stop(proc: subprocess.Popen[bytes], grace: float = 5.0) -> None:
    """SIGTERM, SIGKILL after ``grace`` seconds; reaped."""
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
