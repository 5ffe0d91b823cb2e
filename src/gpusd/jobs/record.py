"""Job records: ``job-<ID>.json`` in the lock directory, beside the leases.

A record is written by the job's supervisor (``gpusd run``) with the same hardening as a lease
record (:mod:`gpusd.alloc.leases`): created with ``O_EXCL | O_NOFOLLOW`` under a temporary name,
locked (``LOCK_EX``) before it is renamed into place, rewritten the same way on every change.  A
record whose lock nobody holds belongs to a dead supervisor and is ignored (removed when possible).
Another user may write such a file: it is read bounded, typed field by field, and attributed to the
uid that owns the file (only root's records, the daemon's, may name another user).

A fleet run (``gpusd run --fleet``) registers the same record on the machine that runs it; ``host``
then names the machine that asked (informational only; the owner is still the file's uid).  The
machine that asked keeps a record of the same id too, whose ``labels`` name the GPUs it runs on
(``HOST:INDEX``: not this machine's GPUs, so its ``indices`` are empty) (:mod:`gpusd.jobs.fleet`).
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import time

from ..alloc.leases import LeaseStore
from ..alloc.lockdir import create_exclusive, read_live, user_name, write_new
from ..alloc.priority import PRIORITIES, priority_name
from ..ids import ContainerId, JobId, LeaseId
from ..record import field, fields, record
from ..sanitize import json_object

# typing is not imported at run time: start-up time
TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from typing import Any

JOB_FORMAT = 1
MAX_JOB_BYTES = 16384
MAX_JOB_FILES = 4096
MAX_DEVICES = 64
# a host name (255) and a GPU index
MAX_LABEL = 300

STATES = ("queued", "running", "preempted", "paused", "moving", "done", "failed")


@record
class JobRecord:
    """What a job is (the fields of ``job-<ID>.json``)."""

    job: str
    # the supervisor (gpusd run)
    pid: int
    user: str | None = None
    # from the file's owner, never from its contents
    uid: int | None = None
    command: str | None = None
    # UUIDs currently given to the job
    devices: list[str] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)
    priority: int = PRIORITIES["normal"]
    preemptible: bool = False
    pausable: bool = False
    state: str = "queued"
    restarts: int = 0
    lease: str | None = None
    started: float | None = None
    # the command's pid (its process group, when it has its own)
    child: int | None = None
    # fleet runs: the machine that asked
    host: str | None = None
    # why the last change of state happened
    reason: str | None = None
    # fleet runs, where they were asked: HOST:INDEX
    labels: list[str] = field(default_factory=list)
    # the id of the container it started (gpusd.jobs.containers), hex
    container: str | None = None
    # gpusd run --time: seconds the command may run
    time_limit: float | None = None
    # when that limit runs out (wall-clock, for display; enforced on the monotonic clock)
    ends: float | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: _copy(getattr(self, f.name)) for f in fields(self)}
        d["priority_name"] = priority_name(self.priority)
        return d


def _copy(value: Any) -> Any:
    """A field's value for a dict of the record: its lists copied (as ``dataclasses.asdict`` did)."""
    return list(value) if isinstance(value, list) else value


def _text(value: object, limit: int) -> str | None:
    return value[:limit] if isinstance(value, str) else None


def parse(raw: bytes, uid: int) -> JobRecord:
    """A record from another user's file: typed and bounded (ValueError when it is not one)."""
    d = json_object(raw)
    job, pid = d.get("job"), d.get("pid")
    if not JobId.is_valid(job):
        raise ValueError("no valid job id")
    if type(pid) is not int or not 0 < pid < 2**31:
        raise ValueError("no valid pid")
    devices = d.get("devices") or []
    if (not isinstance(devices, list) or len(devices) > MAX_DEVICES
            or not all(isinstance(x, str) and 0 < len(x) <= 128 for x in devices)):
        raise ValueError("no valid device list")
    indices = d.get("indices") or []
    if not isinstance(indices, list) or not all(type(i) is int and 0 <= i < 4096 for i in indices[:MAX_DEVICES]):
        raise ValueError("no valid index list")
    priority = d.get("priority")
    if type(priority) is not int or priority not in PRIORITIES.values():
        raise ValueError("no valid priority")
    state = d.get("state")
    if state not in STATES:
        raise ValueError("no valid state")
    restarts, child, started = d.get("restarts"), d.get("child"), d.get("started")
    if type(restarts) is not int or not 0 <= restarts < 2**31:
        raise ValueError("no valid restart count")
    if child is not None and (type(child) is not int or not 0 < child < 2**31):
        raise ValueError("no valid child pid")
    if started is not None and (type(started) not in (int, float) or not math.isfinite(started)):
        raise ValueError("bad start time")
    labels = d.get("labels") or []
    if (not isinstance(labels, list) or len(labels) > MAX_DEVICES
            or not all(isinstance(x, str) and 0 < len(x) <= MAX_LABEL for x in labels)):
        raise ValueError("no valid label list")
    time_limit, ends = d.get("time_limit"), d.get("ends")
    for value in (time_limit, ends):
        if value is not None and (type(value) not in (int, float) or not math.isfinite(value) or value < 0):
            raise ValueError("bad time limit")
    user = _text(d.get("user"), 64) if uid == 0 else user_name(uid)
    return JobRecord(job=job, pid=pid, user=user, uid=uid, command=_text(d.get("command"), 1024),
                     devices=list(devices), indices=list(indices[:MAX_DEVICES]), priority=priority,
                     preemptible=d.get("preemptible") is True, pausable=d.get("pausable") is True, state=state,
                     restarts=restarts, lease=LeaseId.optional(d.get("lease")),
                     started=started, child=child, host=_text(d.get("host"), 255), reason=_text(d.get("reason"), 200),
                     container=ContainerId.optional(d.get("container")),
                     labels=list(labels), time_limit=time_limit, ends=ends)


def _warn(message: str, *args: object) -> None:
    """A warning, with ``logging`` imported only then: a job waiting for GPUs lists the jobs whenever
    it is at the head of the queue and blocked, and needs no logging otherwise."""
    import logging

    logging.getLogger(__name__).warning(message, *args)


def list_jobs(store: LeaseStore | None = None, cleanup: bool = False) -> list[JobRecord]:
    """The live jobs of this machine (their supervisor holds the record's lock), oldest first."""
    store = store or LeaseStore()
    dfd = store.open(create=False)
    if dfd is None:
        return []
    out: list[JobRecord] = []
    try:
        names = os.listdir(dfd)
        seen = 0
        for name in names:
            if JobId.from_file_name(name) is None:
                continue
            seen += 1
            if seen > MAX_JOB_FILES:
                _warn("more than %d job files in %s: the rest are ignored", MAX_JOB_FILES, store.dir)
                break
            # a dead one's socket too
            got = read_live(dfd, name, MAX_JOB_BYTES, cleanup, (name, name[:-5] + ".sock"))
            if got is None:
                continue
            st, raw = got
            if len(raw) > MAX_JOB_BYTES:
                _warn("skipping job file %s of %s: %d bytes", name, user_name(st.st_uid), st.st_size)
                continue
            try:
                rec = parse(raw, st.st_uid)
            except (ValueError, TypeError, RecursionError) as exc:
                _warn("skipping unreadable job file %s: %s", name, exc)
                continue
            if f"job-{rec.job}.json" != name:
                continue
            out.append(rec)
    except OSError:
        pass
    finally:
        os.close(dfd)
    out.sort(key=lambda r: (r.started or 0.0, r.job))
    return out


class RecordWriter:
    """The supervisor's side: writes (and rewrites) its job's record, holding its lock."""

    def __init__(self, store: LeaseStore, record: JobRecord) -> None:
        self.store = store
        self.record = record
        self.fd = -1
        # checked: O_NOFOLLOW, owner, sticky
        dir_fd = store.open(create=True)
        assert dir_fd is not None
        self.dir_fd: int = dir_fd

    def update(self, **changes: Any) -> None:
        """Change the record's fields without writing it: the next :meth:`write` carries them."""
        for key, value in changes.items():
            setattr(self.record, key, value)

    def write(self, **changes: Any) -> None:
        self.update(**changes)
        d = self.record.to_dict()
        d.pop("uid", None)
        d["format"] = JOB_FORMAT
        final, tmp = f"job-{self.record.job}.json", f".job-{self.record.job}-{os.urandom(3).hex()}.tmp"
        fd = create_exclusive(self.dir_fd, tmp, self.store.dir)
        try:
            # locked before it is visible: never taken for stale
            fcntl.flock(fd, fcntl.LOCK_EX)
            # a full disk: DiskFull
            write_new(self.dir_fd, fd, tmp, final, json.dumps(d).encode(), self.store.dir)
        except BaseException:
            os.close(fd)
            try:
                os.unlink(tmp, dir_fd=self.dir_fd)
            except OSError:
                pass
            raise
        old, self.fd = self.fd, fd
        if old >= 0:
            os.close(old)

    def close(self) -> None:
        if self.dir_fd >= 0:
            try:
                os.unlink(f"job-{self.record.job}.json", dir_fd=self.dir_fd)
            except OSError:
                pass
        for fd in (self.fd, self.dir_fd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.fd = self.dir_fd = -1


def now() -> float:
    return time.time()
