"""Leases through the local daemon: the client side of the lease socket.

Where a gpusd daemon runs (as root), it is the lease authority of its machine: ``gpusd run`` and
``gpusd.select`` ask it over a Unix socket (``$GPUSD_LEASE_SOCKET``, default
``/run/gpusd/lease.sock``) instead of writing in the shared lock directory themselves.  The daemon
learns who asks from the kernel (``SO_PEERCRED``), takes the very same flock leases on the client's
behalf (so leases through the daemon and leases through the directory never overlap), and keeps them
while the client's connection is open: the lease ends when the last process holding the connection
exits, however it exits.  ``gpusd run`` hands the connection to its command, as it hands flock
descriptors.

The protocol (one JSON object per line, UTF-8, documented in docs/allocation.md):

    client -> {"op": "lease", "v": 1, "count": 1, "min_free": null, "memory": null, "max_util": null,
               "max_processes": null, "include": null, "exclude": null, "mig": false, "by": "load",
               "shared": false, "visible": null, "wait": false, "timeout": null, "command": "..."}
    daemon -> {"ok": true, "lease_id": "...", "devices": [{"gpu": {...}, "mig": null, "free": ...,
               "total": ..., "util": ...}]}
           or {"ok": false, "error": "no_gpu" | "timeout" | "usage" | "busy" | "error", "message": "..."}

then nothing more: the client closes the connection to release the lease.  On ``busy`` (too many
requests open) the client takes its lease in the lock directory instead.

The client uses the socket only when it is a socket owned by root or by the client's own user, and
the process answering is one of those (``SO_PEERCRED`` again); otherwise it falls back to the lock
directory.  ``GPUSD_LEASE_SOCKET=off`` disables the daemon path.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, GpusdError, NoGpuAvailable, WaitTimeout
from ..model import GpuInfo, MigInstance
from .select import Candidate, Constraints

if TYPE_CHECKING:
    import socket

DEFAULT_SOCKET = "/run/gpusd/lease.sock"
PROTOCOL = 1
MAX_LINE = 1 << 20  # the reply carries the chosen GPUs: a few KiB
CONNECT_TIMEOUT = 2.0
REPLY_SLACK = 30.0  # beyond the client's own timeout and the mutex bound
_CRED = struct.Struct("3i")


def socket_path() -> Path | None:
    """Where the daemon's lease socket is (None: the daemon path is turned off)."""
    raw = os.environ.get("GPUSD_LEASE_SOCKET")
    if raw is not None and raw.strip().lower() in ("", "off", "none", "0"):
        return None
    return Path(raw or DEFAULT_SOCKET)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end, from the kernel."""
    import socket

    pid, uid, gid = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return pid, uid, gid


def connect(path: Path | None = None) -> socket.socket | None:
    """A connection to a trustworthy lease authority, or None (no daemon: use the lock directory)."""
    path = path or socket_path()
    if path is None:
        return None
    me = os.geteuid()
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid not in (0, me):
        return None  # not the daemon's: someone else's file is never trusted with a lease
    import socket  # only where a daemon serves leases

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(CONNECT_TIMEOUT)
        sock.connect(str(path))
        _, uid, _ = peer_credentials(sock)
        if uid not in (0, me):
            raise OSError("the lease socket is served by another user")
    except OSError:
        sock.close()
        return None
    return sock


class RemoteLease:
    """A lease the daemon holds for us while :attr:`sock` is open (duck-types :class:`Lease`)."""

    def __init__(self, lease_id: str, devices: list[str], shared: bool, memory: int | None,
                 sock: socket.socket) -> None:
        self.lease_id, self.devices, self.shared, self.memory, self.sock = lease_id, devices, shared, memory, sock
        self.released = False

    @property
    def fds(self) -> list[int]:
        """What keeps the lease alive: handed to ``gpusd run``'s command like flock descriptors."""
        return [] if self.released else [self.sock.fileno()]

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.sock.close()  # the daemon sees the end of the connection and releases

    def __enter__(self) -> RemoteLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:  # a dropped Selection must not keep its GPUs
        try:
            self.release()
        except Exception:
            pass


class AuthorityBusy(Exception):
    """The daemon has too many requests open: take the lease in the lock directory instead."""


def request(c: Constraints) -> dict[str, Any]:
    """The constraints as the protocol carries them (``visible``: this process's inherited
    ``CUDA_VISIBLE_DEVICES``, which the daemon cannot see)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if c.within_visible else None
    return {"op": "lease", "v": PROTOCOL, "count": c.count, "min_free": c.min_free, "memory": c.memory,
            "max_util": c.max_util, "max_processes": c.max_processes,
            "include": list(c.include) if c.include is not None else None,
            "exclude": list(c.exclude) if c.exclude is not None else None,
            "mig": c.mig, "by": c.by, "shared": c.shared, "visible": visible}


def lease_through(sock: socket.socket, c: Constraints, *, wait: bool, timeout: float | None,
                  command: str | None) -> tuple[list[Candidate], RemoteLease]:
    """Ask the daemon for a lease; raises what a local allocation would raise."""
    from ..sanitize import for_terminal
    from .leases import mutex_timeout

    req = dict(request(c), wait=wait, timeout=timeout, command=command)
    try:
        sock.settimeout(None if (wait and timeout is None) else
                        (timeout or 0.0) + mutex_timeout() + REPLY_SLACK)
        try:
            sock.sendall(json.dumps(req).encode() + b"\n")
        except BrokenPipeError:
            pass  # answered before it read us (busy): the answer is waiting below
        line = _readline(sock)
        sock.settimeout(None)
    except OSError as exc:
        sock.close()
        raise GpusdError(f"the gpusd daemon's lease socket failed: {exc}") from None
    try:
        reply = json.loads(line)
        if not isinstance(reply, dict):
            raise ValueError("not an object")
        if reply.get("ok") is not True:
            kind = reply.get("error")
            if kind == "busy":
                sock.close()
                raise AuthorityBusy()
            message = for_terminal(str(reply.get("message") or "the daemon refused the lease"), 2000)
            sock.close()
            raise {"no_gpu": NoGpuAvailable, "timeout": WaitTimeout, "usage": ConfigError}.get(
                kind if isinstance(kind, str) else "", GpusdError)(message)
        chosen = [Candidate(GpuInfo.from_dict(d["gpu"]), MigInstance.from_dict(d["mig"]) if d.get("mig") else None,
                            _int(d.get("free")), _int(d.get("total")), _num(d.get("util")))
                  for d in reply["devices"]]
        lease_id = reply["lease_id"]
        if not isinstance(lease_id, str) or not chosen:
            raise ValueError("no lease")
    except (ValueError, KeyError, TypeError) as exc:
        sock.close()
        raise GpusdError(f"the gpusd daemon's lease socket answered something unreadable ({exc})") from None
    return chosen, RemoteLease(lease_id, [x.uuid for x in chosen], c.shared, c.memory, sock)


def _readline(sock: socket.socket) -> bytes:
    buf = bytearray()
    while not buf.endswith(b"\n"):
        chunk = sock.recv(65536)
        if not chunk:
            raise OSError("the daemon closed the connection")
        buf += chunk
        if len(buf) > MAX_LINE:
            raise OSError("reply too long")
    return bytes(buf)


def _int(v: object) -> int | None:
    return v if type(v) is int else None


def _num(v: object) -> float | None:
    return float(v) if type(v) in (int, float) else None  # type: ignore[arg-type]
