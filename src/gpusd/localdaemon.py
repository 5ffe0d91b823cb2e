"""Whether this host's own daemon runs, and where it serves: read-only, from its state directory.

The daemon (:mod:`gpusd.daemon.process`) writes two files in its state directory
(:func:`gpusd.identity.state_dir`): ``gpusd.pid``, which it holds locked (``flock LOCK_EX``) for its whole
life, so a file left by a crashed daemon reads as not running; and ``gpusd.json``, where it serves (port,
addresses, interfaces, session, node id), written once it is ready.  Every reader asks here
(:func:`status`; where its API answers: :func:`api_bases`): ``gpusd status``, ``gpusd doctor``, and the
choice of the daemon's fleet view over a browse (:mod:`gpusd.discovery.fleetsource`) by ``gpusd list``
and the discovery clients.  ``gpusd.json`` is another process's file: it is read bounded
(:func:`gpusd.sanitize.json_object`), a damaged one as none, and each value taken from it is checked.

The standard library and the core only: the discovery clients import it (the layer map), and ``gpusd
list`` reads it on its quick path.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from .identity import state_dir as default_state_dir
from .sanitize import json_object

# typing is not imported at run time: start-up time
TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from typing import Any

PID_FILE = "gpusd.pid"
INFO_FILE = "gpusd.json"
# bytes of gpusd.json read at most (a daemon writes a few KiB)
INFO_MAX = 1 << 20


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
            with open(state_dir / INFO_FILE, "rb") as f:
                info = json_object(f.read(INFO_MAX + 1), INFO_MAX)
        except (OSError, ValueError):
            # a damaged file: as good as none
            info = {}
    return DaemonStatus(running=running, pid=pid, state_dir=state_dir, info=info)


def api_bases(info: dict[str, Any]) -> list[str]:
    """Where the daemon whose ``gpusd.json`` is ``info`` serves its HTTP API: ``http://ADDR:PORT/api/v1``
    for each IPv4 address it serves (loopback first where it serves every address), at most four; empty
    where the file names no usable port or address.  Every value is checked: the file is another
    process's."""
    port = info.get("port")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        return []
    hosts: list[str] = []
    # bound to every address: loopback too
    if not info.get("interfaces"):
        hosts.append("127.0.0.1")
    addresses = info.get("addresses")
    for a in addresses if isinstance(addresses, list) else []:
        # ipaddress would take the number 7 for 0.0.0.7
        if not isinstance(a, str):
            continue
        try:
            ip = ipaddress.ip_address(a)
        except (TypeError, ValueError):
            continue
        if ip.version == 4 and str(ip) not in hosts:
            hosts.append(str(ip))
    return [f"http://{h}:{port}/api/v1" for h in hosts[:4]]


def may_run(state_dir: Path | None = None) -> bool:
    """False where no daemon can be running with ``state_dir`` (default: this user's): it has not written
    ``gpusd.json``.  One ``stat``, for a caller deciding at once whether to ask it (:func:`status` says
    whether it does)."""
    if state_dir is None:
        state_dir = default_state_dir()
    return (state_dir / INFO_FILE).exists()


__all__ = ["INFO_FILE", "PID_FILE", "DaemonStatus", "api_bases", "locked", "may_run", "read_pid", "status"]
