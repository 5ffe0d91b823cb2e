"""What gpusd remembers of the engines' jobs in its state directory, and of the processes that hold them.

* a job's **held record** (``jobs/JOB_ID.json``, mode 600): the placement a reservation holds now and
  its holder (``gpusd hostfile -- CMD``, or the renewer of a reservation held ``--for`` a while) by pid
  *and* the kernel's start time of that process, read by Horovod's discovery script
  (``gpusd hostfile --format horovod-discovery --held FILE``);
* a **Ray cluster's record** (``ray/ID.json``, mode 600; gpusd 0.2 kept one ``ray-placement.json``):
  its placement, leases, address and renewer;
* a **renewer** (``python -m gpusd.pool.renewer``) named by a record: signalled only while that pid is
  still a renewer of this user that started when the record says.

Files are written new (:func:`write_new`: never through a symbolic link) and read bounded; a record
that cannot be read is skipped, never fatal.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from ..alloc.lockdir import process_start
from ..errors import GpusdError
from ..identity import state_dir
from ..sanitize import for_terminal
from ..units import format_clock
from .placement import Placement, PlacementError

# under gpusd's state directory: what a job holds now, for Horovod's discovery script
HELD_DIR = "jobs"
# under the state directory: one record per cluster, ray/ID.json
RAY_DIR = "ray"
# gpusd 0.2's single cluster record
RAY_STATE = "ray-placement.json"
# bytes of a record read at most
MAX_RECORD = 1 << 20
# cluster records read at most
MAX_CLUSTERS = 256


def write_new(path: str, text: str, mode: int = 0o644) -> None:
    """Write a new file (never through an existing symlink: O_EXCL after removing our own old file)."""
    p = Path(path)
    if p.is_symlink():
        raise GpusdError(f"{path} is a symbolic link; not writing through it")
    tmp = p.with_name(f".{p.name}.gpusd-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, p)


# -- a job's held record ------------------------------------------------------------------------------------
def held_path(job_id: str) -> Path:
    return state_dir() / HELD_DIR / f"{job_id}.json"


def write_held(p: Placement, holder_pid: int, until: float | None) -> Path:
    """Record what the job holds now (read by ``--format horovod-discovery --held FILE``): the
    placement, and the holder as the kernel knows it (pid and start time: a pid alone may be reused)."""
    path = held_path(p.job_id)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    record = {"placement": p.to_dict(), "pid": holder_pid, "pid_started": process_start(holder_pid), "until": until}
    write_new(str(path), json.dumps(record) + "\n", 0o600)
    return path


def forget_held(job_id: str) -> None:
    try:
        held_path(job_id).unlink()
    except OSError:
        pass


def holder_alive(pid: object, started: object) -> bool:
    """Whether the process that wrote a record still runs: the pid, and the same kernel start time
    (a pid that was reused by another process has a later one)."""
    if type(pid) is not int or pid <= 0 or not isinstance(started, (int, float)):
        return False
    now = process_start(pid)
    # btime may shift by 1 s
    return now is not None and abs(now - started) < 1.5


def held_placement(path: str) -> Placement | None:
    """What a job holds now: the placement in ``path`` while its holder (``gpusd hostfile -- CMD``,
    or the renewer of a reservation held ``--for`` a while) lives — the same process, by pid and
    start time — and the time is not up; else None."""
    try:
        with open(path, "rb") as f:
            d = json.loads(f.read(MAX_RECORD))
        until = d.get("until")
        if until is not None and time.time() >= float(until):
            return None
        if not holder_alive(d["pid"], d.get("pid_started")):
            return None
        return Placement.from_dict(d["placement"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


# -- Ray clusters --------------------------------------------------------------------------------------------
def cluster_path(state: Path, cluster_id: str) -> Path:
    return state / RAY_DIR / f"{cluster_id}.json"


def write_cluster(state: Path, record: dict[str, Any]) -> Path:
    path = cluster_path(state, record["id"])
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_new(str(path), json.dumps(record) + "\n", 0o600)
    return path


def clusters(state: Path) -> tuple[dict[str, tuple[Path, dict[str, Any]]], list[str]]:
    """The clusters gpusd started and remembers in ``state``: id -> (record file, record), and a line
    for each record that could not be read (skipped); the single record of gpusd 0.2
    (``ray-placement.json``) counts too."""
    paths = sorted((state / RAY_DIR).glob("*.json")) if (state / RAY_DIR).is_dir() else []
    if (state / RAY_STATE).is_file():
        paths.append(state / RAY_STATE)
    out: dict[str, tuple[Path, dict[str, Any]]] = {}
    skipped = []
    for path in paths[:MAX_CLUSTERS]:
        try:
            if path.is_symlink():
                raise ValueError("a symbolic link")
            with open(path, "rb") as f:
                record = json.loads(f.read(MAX_RECORD))
            p = Placement.from_dict(record["placement"])
        except (OSError, ValueError, KeyError, TypeError, PlacementError) as exc:
            skipped.append(f"skipping the unreadable cluster record {path}: {exc}")
            continue
        # the id is the placement's job id (checked by Placement)
        record["id"] = p.job_id
        out[p.job_id] = (path, record)
    return out, skipped


def forget(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def describe(record: dict[str, Any]) -> str:
    """``10.0.0.1:6379, 2 hosts, held until 2026-12-02 19:10:48`` for a cluster record."""

    hosts = record.get("placement", {}).get("hosts") or []
    words = [for_terminal(str(record.get("address") or "?"), 80), f"{len(hosts)} host{'s' if len(hosts) != 1 else ''}"]
    until = record.get("until")
    if isinstance(until, (int, float)):
        words.append(f"held until {format_clock(until)}")
    return ", ".join(words)


# -- renewers ------------------------------------------------------------------------------------------------
def renewer_record(pid: int | None) -> dict[str, Any]:
    """What a record keeps of a renewer we just started (``pid``, our child, not yet waited for, so
    the pid is still its own): the pid and the kernel's start time of the process."""
    return {"renewer_pid": pid, "renewer_started": process_start(pid) if pid is not None else None}


def renewer_of(pid: object, started: object) -> int | None:
    """``pid`` if it is still the renewer that a record names: a process of ours running
    ``python -m gpusd.pool.renewer`` that started when the record says (``started``: the kernel's start
    time recorded with the pid; another renewer of the same user that reused the pid started later).
    A pid from a file is only signalled after checking what runs under it now."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 1:
        return None
    try:
        st = os.stat(f"/proc/{pid}")
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read(4096).split(b"\0")
    except OSError:
        return None
    if st.st_uid != os.getuid() or b"gpusd.pool.renewer" not in cmdline:
        return None
    # a record without a start time (gpusd 0.2) is never acted on
    if not holder_alive(pid, started):
        return None
    return pid


def end_renewer(record: dict[str, Any], timeout: float = 15.0, release: bool = True) -> int | None:
    """Stop the reservation's renewer (SIGTERM: it releases the leases; without ``release``, SIGUSR1:
    they end with their TTL) and wait until it is gone.  The renewer's pid when it did not end within
    ``timeout`` (the leases then expire with their TTL), else None."""
    started = record.get("renewer_started")
    pid = renewer_of(record.get("renewer_pid"), started)
    if pid is None:
        return None
    try:
        os.kill(pid, signal.SIGTERM if release else signal.SIGUSR1)
    except OSError:
        return None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            # our own child (ray up failed)
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return None
        except ChildProcessError:
            pass
        if renewer_of(pid, started) is None:
            return None
        time.sleep(0.05)
    return pid
