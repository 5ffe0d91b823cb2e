"""Who this host is: host name, state directory, and a node id stable across restarts."""

from __future__ import annotations

import os
from pathlib import Path

from .record import record


def hostname() -> str:
    return os.environ.get("GPUSD_HOSTNAME") or os.uname().nodename


def state_dir(create: bool = False) -> Path:
    """Where a daemon keeps its pid file, log and node id: ``$GPUSD_STATE_DIR``, else
    ``/var/lib/gpusd`` for root, else ``$XDG_STATE_HOME/gpusd`` (``~/.local/state/gpusd``)."""
    env = os.environ.get("GPUSD_STATE_DIR")
    if env:
        path = Path(env)
    elif os.geteuid() == 0:
        path = Path("/var/lib/gpusd")
    else:
        base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
        path = Path(base) / "gpusd"
    if create:
        path.mkdir(parents=True, exist_ok=True)
    return path


def _machine_id() -> str | None:
    for p in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            text = Path(p).read_text().strip()
        except OSError:
            continue
        if text:
            return text
    return None


def _valid(text: str) -> bool:
    return 8 <= len(text) <= 64 and all(c in "0123456789abcdef" for c in text)


def node_id(directory: Path | None = None) -> str:
    """A 16-hex-digit id, stable across restarts, kept in ``node-id`` in the state directory.

    The machine's default state directory gets an id derived from the machine id (hashed, as systemd
    recommends for apps), so it survives a wiped state directory; any other state directory
    (``$GPUSD_STATE_DIR``, ``--state-dir``) gets a random one, so that several daemons on one machine
    differ.  When the file cannot be written, the machine-derived id is used."""
    default = directory is None and "GPUSD_STATE_DIR" not in os.environ
    directory = directory if directory is not None else state_dir()
    path = directory / "node-id"
    try:
        text = path.read_text(errors="replace").strip()
        if _valid(text):
            return text
    except OSError:
        # absent or unreadable; a damaged file is replaced below
        pass
    import hashlib

    mid = _machine_id()
    if mid and default:
        new = hashlib.sha256(f"gpusd:{mid}".encode()).hexdigest()[:16]
    else:
        new = os.urandom(8).hex()
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp.write_text(new + "\n")
        os.replace(tmp, path)
    except OSError:
        # a full disk leaves no empty file behind
        try:
            tmp.unlink()
        except OSError:
            pass
        if mid:
            return hashlib.sha256(f"gpusd:{mid}".encode()).hexdigest()[:16]
    return new


@record(frozen=True, slots=True)
class HostIdentity:
    """Who a daemon says it is on the wire: what the announcer and the fleet client get instead of
    the whole daemon (see docs/architecture.md)."""

    hostname: str
    node_id: str
