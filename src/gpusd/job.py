"""The job side of the gpusd job protocol (docs/jobs.md), for Python jobs; stdlib only.

>>> from gpusd.job import Job, RESTART_ME
>>> job = Job(on_change=lambda j: print("now on GPUs", j.cuda_visible_devices))
>>> while not job.should_stop:            # SIGTERM: preempted, moved, or stopped
...     train_one_step()
>>> save_checkpoint(); job.restart()      # exit status 75: gpusd runs the command again, same lease

From a shell or a launcher (stdlib only, fast)::

    python -m gpusd.job --count                  # the job's GPU count now, from the job file
    python -m gpusd.job --horovod-discovery      # "HOST:N": elastic Horovod's --host-discovery-script

Under ``gpusd run`` the environment names the job file (``GPUSD_JOB_FILE``: JSON, rewritten
atomically) and the signal that announces a change (``GPUSD_NOTIFY_SIGNAL``, default SIGUSR1);
``GPUSD_RESTART_COUNT`` says how many times the command was restarted.  Outside ``gpusd run`` a
:class:`Job` describes no job (``active`` is False) and never calls back.
"""

# Imports inside functions: start-up (a command's own module).
from __future__ import annotations

import json
import os
import re
import signal
import sys
from typing import Any, Callable, NoReturn

# the exit status that asks gpusd run to start the command again, keeping the lease
RESTART_ME = 75
MAX_FILE = 65536


def read_job_file(path: str | None = None) -> dict[str, Any] | None:
    """The job file's contents (None outside a gpusd job or when it cannot be read)."""
    path = path or os.environ.get("GPUSD_JOB_FILE")
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            d = json.loads(f.read(MAX_FILE))
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


class Job:
    """This process's job: its GPUs, told of changes by signal (docs/jobs.md)."""

    def __init__(self, on_change: Callable[[Job], None] | None = None, *, install: bool = True,
                 path: str | None = None) -> None:
        self.path = path or os.environ.get("GPUSD_JOB_FILE")
        self.on_change = on_change
        self.stop_requested = False
        self.data: dict[str, Any] = read_job_file(self.path) or {}
        self.restarts = int(os.environ.get("GPUSD_RESTART_COUNT") or 0)
        if install and self.active:
            name = os.environ.get("GPUSD_NOTIFY_SIGNAL") or "SIGUSR1"
            sig = getattr(signal, name, signal.SIGUSR1)
            signal.signal(sig, self._changed)
            signal.signal(signal.SIGTERM, self._stop)

    @property
    def active(self) -> bool:
        return bool(self.path)

    @property
    def id(self) -> str | None:
        return os.environ.get("GPUSD_JOB_ID")

    @property
    def generation(self) -> int:
        return int(self.data.get("generation") or 0)

    @property
    def state(self) -> str:
        return str(self.data.get("state") or "running")

    @property
    def cuda_visible_devices(self) -> str:
        return str(self.data.get("cuda_visible_devices") or os.environ.get("CUDA_VISIBLE_DEVICES") or "")

    @property
    def env(self) -> dict[str, str]:
        """The variables that make the job's GPUs visible now (each vendor's: docs/inventory.md)."""
        raw = self.data.get("env")
        if isinstance(raw, dict):
            return {str(k): str(v) for k, v in raw.items() if isinstance(v, str)}
        return {"CUDA_VISIBLE_DEVICES": self.cuda_visible_devices} if self.cuda_visible_devices else {}

    @property
    def devices(self) -> list[str]:
        """The job's GPUs now, as CUDA_VISIBLE_DEVICES entries (indices, or UUIDs)."""
        return [x for x in self.cuda_visible_devices.split(",") if x]

    @property
    def should_stop(self) -> bool:
        """SIGTERM arrived (preempted, moved, or stopped): save a checkpoint and exit."""
        return self.stop_requested

    def refresh(self) -> bool:
        """Read the file again; True when it changed."""
        d = read_job_file(self.path)
        if d is None or d.get("generation") == self.data.get("generation"):
            return False
        self.data = d
        return True

    def _changed(self, _signum: int, _frame: object) -> None:
        if self.refresh() and self.on_change is not None:
            self.on_change(self)

    def _stop(self, _signum: int, _frame: object) -> None:
        self.stop_requested = True

    def restart(self) -> NoReturn:
        """Exit with :data:`RESTART_ME`: gpusd starts the command again on the job's GPUs now."""
        sys.stdout.flush()
        sys.exit(RESTART_ME)


def current(on_change: Callable[[Job], None] | None = None) -> Job:
    return Job(on_change)


def gpu_count(path: str | None = None) -> int | None:
    """How many GPUs the job has now (the job file's ``devices``); None outside a gpusd job, or when
    the file cannot be read."""
    d = read_job_file(path)
    devices = d.get("devices") if d is not None else None
    return len(devices) if isinstance(devices, list) else None


def main(argv: list[str] | None = None) -> int:
    """``python -m gpusd.job --count | --horovod-discovery [--host NAME]`` (docs/jobs.md)."""
    import argparse
    import socket

    p = argparse.ArgumentParser(prog="python -m gpusd.job",
                                description="the current GPUs of the gpusd job this runs in (GPUSD_JOB_FILE)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--count", action="store_true", help="print the job's GPU count now")
    what.add_argument("--horovod-discovery", action="store_true",
                      help="print HOST:COUNT, as elastic Horovod's --host-discovery-script does; Horovod polls it")
    p.add_argument("--host", help="the host name to print (default: this machine's)")
    p.add_argument("--file", help="the job file (default: $GPUSD_JOB_FILE)")
    args = p.parse_args(argv)
    path = args.file or os.environ.get("GPUSD_JOB_FILE")
    if not path:
        print("gpusd.job: not in a gpusd job (GPUSD_JOB_FILE is not set): run this under gpusd run",
              file=sys.stderr)
        return 1
    n = gpu_count(path)
    if n is None:
        print(f"gpusd.job: cannot read the job file {path!r}, or it names no devices (has the job ended?)",
              file=sys.stderr)
        return 1
    if args.count:
        print(n)
        return 0
    host = args.host or socket.gethostname()
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}", host):
        print(f"gpusd.job: not a host name: {host[:64]!r}", file=sys.stderr)
        return 2
    print(f"{host}:{n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
