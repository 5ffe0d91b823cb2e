"""Whether this host's own daemon runs, and where it serves: read-only, from its state directory.

The daemon (:mod:`gpusd.daemon.process`) writes two files in its state directory
(:func:`gpusd.identity.state_dir`): ``gpusd.pid``, which it holds locked (``flock LOCK_EX``) for its whole
life, so a file left by a crashed daemon reads as not running; and ``gpusd.json``, where it serves (port,
addresses, interfaces, session, node id), written once it is ready.  Every reader asks here: ``gpusd
status``, ``gpusd doctor``, and the choice of the daemon's fleet view over a browse
(:mod:`gpusd.discovery.fleetsource`) by ``gpusd list`` and the discovery clients.  ``gpusd.json`` is another
process's file: it is read bounded (:func:`gpusd.sanitize.json_object`), a damaged one as none; what a
reader takes from it is checked by that reader.

The standard library and the core only: the discovery clients import it (the layer map), and ``gpusd
list`` reads it on its quick path.
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

from .sanitize import json_object

TYPE_CHECKING = False  # typing is not imported at run time: start-up time
if TYPE_CHECKING:  # pragma: no cover
    from typing import Any

PID_FILE = "gpusd.pid"
INFO_FILE = "gpusd.json"


@dataclass
class DaemonStatus:
    running: bool
    pid: int | None
    state_dir: Path
    info: dict[str, Any]


def read_pid(path: Path) -> int | None:
    """The pid a pid file names (None: none, or not a number)."""
    try:
        text = path.read_text().strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None


def locked(path: Path) -> bool:
    """Whether a live daemon holds the pid file ``path``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def status(state_dir: Path) -> DaemonStatus:
    """Whether the daemon of ``state_dir`` runs, its pid, and its ``gpusd.json`` (empty where it does not
    run, or the file is damaged)."""
    pid_path = state_dir / PID_FILE
    running = locked(pid_path)
    pid = read_pid(pid_path) if running else None
    info: dict[str, Any] = {}
    if running:
        try:
            info = json_object((state_dir / INFO_FILE).read_bytes())
        except (OSError, ValueError):  # a damaged file: as good as none
            info = {}
    return DaemonStatus(running=running, pid=pid, state_dir=state_dir, info=info)


def may_run(state_dir: Path | None = None) -> bool:
    """False where no daemon can be running with ``state_dir`` (default: this user's): it has not written
    ``gpusd.json``.  One ``stat``, for a caller deciding at once whether to ask it (:func:`status` says
    whether it does)."""
    if state_dir is None:
        from .identity import state_dir as default

        state_dir = default()
    return (state_dir / INFO_FILE).exists()


__all__ = ["INFO_FILE", "PID_FILE", "DaemonStatus", "locked", "may_run", "read_pid", "status"]
