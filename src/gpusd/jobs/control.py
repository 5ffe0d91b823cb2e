"""The control socket of a job: ``job-<ID>.sock`` in the lock directory.

``gpusd grow``, ``gpusd shrink``, a waiting job that preempts and the daemon's rebalancer talk to a
job's supervisor through it, one JSON object per line each way::

    client -> {"op": "grow", "count": 2, "wait": false, "timeout": null}
    job    -> {"ok": true, "devices": [...], "message": "..."}
           or {"ok": false, "code": "no_gpu", "error": "no_gpu", "message": "..."}

A refusal carries its error's ``code`` (docs/errors.md; :func:`encode` adds it to the supervisor's
answers) and, for older clients, the 0.2 kind in ``error``; the client rebuilds the error with
:func:`gpusd.errors.from_wire`, which also reads a 0.2 supervisor's refusal (no ``code``).

Who asks is learnt from the kernel (``SO_PEERCRED``), never from the request: the supervisor obeys
only its own user and root (:class:`ControlServer`, one thread per request, answering with the
supervisor's ``dispatch``).  The client, in turn, talks only to a socket whose answering process
runs as the uid that owns the job's record (or root), so a fake socket cannot collect requests.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import threading
from pathlib import Path

from ..alloc.leases import LeaseStore
from ..errors import GpusdError, from_wire, to_wire
from ..sanitize import json_object

# typing is not imported at run time: start-up time
TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from typing import Any, Callable

    # dispatch(request, uid of the asker, cancelled: whether the asker went away) -> the answer
    Dispatch = Callable[[dict[str, Any], int | None, Callable[[], bool]], dict[str, Any]]

MAX_LINE = 65536
_CRED = struct.Struct("3i")


def socket_name(job_id: str) -> str:
    return f"job-{job_id}.sock"


def peer_uid(conn: socket.socket) -> int:
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
    _pid, uid, _gid = _CRED.unpack(raw)
    return int(uid)


def read_line(conn: socket.socket, limit: int = MAX_LINE, within: float | None = None) -> dict[str, Any]:
    """One JSON object line; with ``within``, the whole line must come within that many seconds
    (a peer that sends a byte now and then cannot keep us waiting: socket.timeout)."""
    import time

    deadline = time.monotonic() + within if within is not None else None
    buf = b""
    while b"\n" not in buf:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no whole request or answer in time")
            conn.settimeout(left)
        chunk = conn.recv(4096)
        if not chunk:
            break
        buf += chunk
        if len(buf) > limit:
            raise ValueError("request too long")
    return json_object(buf.split(b"\n", 1)[0] or b"null")


def encode(answer: dict[str, Any]) -> bytes:
    """One answer line; a refusal (``ok`` not true) without a ``code`` gets the one its ``error`` kind
    names (code ``error`` without one), and the 0.2 kind beside it."""
    if answer.get("ok") is not True and "code" not in answer:
        answer = {**to_wire(from_wire(answer)), **answer}
    return json.dumps(answer).encode() + b"\n"


def refused(answer: dict[str, Any], prefix: str = "") -> GpusdError | None:
    """The error a supervisor's answer stands for (None when it did what was asked)."""
    return None if answer.get("ok") is True else from_wire(answer, prefix)


def bind(store: LeaseStore, job_id: str) -> socket.socket:
    """The listening socket of a job (connectable by every user: the kernel tells us who connects)."""
    path = store.dir / socket_name(job_id)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    # rw for everyone: a socket's mode only decides who may connect
    old = os.umask(0o111)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    sock.listen(16)
    return sock


class ControlServer:
    """The control socket of job ``job_id``, served: :meth:`start` accepts in a thread of its own,
    each request gets a thread (a ``grow --wait`` may wait long) and one answer line from
    ``dispatch``; a request from a user other than ours or root is refused, and a bad request never
    stops the job."""

    def __init__(self, store: LeaseStore, job_id: str, dispatch: Dispatch) -> None:
        self.job_id, self.dispatch = job_id, dispatch
        self.path = store.dir / socket_name(job_id)
        self.sock = bind(store, job_id)
        self.closing = False

    def start(self) -> None:
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.closing:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(10)
            uid = peer_uid(conn)
            # read first: the refusal is an answer, not a broken pipe
            req = read_line(conn, within=10)
            if uid not in (0, os.geteuid()):
                answer: dict[str, Any] = {"ok": False, "message": f"job {self.job_id} belongs to another user: only "
                                          "its owner or root may change it"}
                print(f"gpusd: job {self.job_id}: refused a request of uid {uid}", file=sys.stderr, flush=True)
            else:
                answer = self.dispatch(req, uid, lambda: hung_up(conn))
            conn.sendall(encode(answer))
        except Exception as exc:
            # a bad request never stops the job
            try:
                conn.sendall(encode({"ok": False, "message": f"bad request: {exc}"[:300]}))
            except OSError:
                pass
        finally:
            conn.close()

    def close(self) -> None:
        self.closing = True
        try:
            self.sock.close()
            os.unlink(self.path)
        except OSError:
            pass


def hung_up(conn: socket.socket) -> bool:
    """Whether the asker on the control socket went away (``gpusd grow --wait`` stopped with Ctrl-C)."""
    import select

    try:
        readable, _, _ = select.select([conn], [], [], 0)
        return bool(readable) and conn.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def request(job_id: str, uid: int | None, message: dict[str, Any], timeout: float = 30.0,
            store: LeaseStore | None = None) -> dict[str, Any]:
    """Send ``message`` to the supervisor of ``job_id``, whose record belongs to ``uid``."""
    store = store or LeaseStore()
    path: Path = store.dir / socket_name(job_id)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout)
    try:
        try:
            sock.connect(str(path))
        except OSError as exc:
            raise GpusdError(f"cannot reach job {job_id}: {exc.strerror or exc}") from None
        server = peer_uid(sock)
        if server not in (0, uid):
            raise GpusdError(f"refusing the control socket of job {job_id}: it is served by uid {server}, "
                             f"not by the job's owner")
        sock.sendall(json.dumps(message).encode() + b"\n")
        try:
            return read_line(sock, within=timeout)
        except (ValueError, OSError) as exc:
            raise GpusdError(f"job {job_id} gave no valid answer: {exc}") from None
    finally:
        sock.close()
