"""One lease-socket connection, read line by line with the uid of whoever wrote each line.

Part of the lease authority (:mod:`gpusd.daemon.leasesock`): the kernel attaches the writer's
credentials to every message (``SO_PASSCRED``/``SCM_CREDENTIALS``), so a process of another user that
got hold of a client's connection is known for what it is.  Bounds: lines of at most
:data:`MAX_REQUEST` bytes, at most :data:`MAX_AHEAD` requests kept while one is served, at most
:data:`MAX_WRITERS` writers' unfinished lines, answers sent within :data:`SEND_TIMEOUT` seconds.
"""

from __future__ import annotations

import array
import asyncio
import json
import logging
import os
import socket
import struct
from collections import deque
from typing import Any, Sequence

log = logging.getLogger("gpusd.daemon.leasesock")

MAX_REQUEST = 16384
SEND_TIMEOUT = 10.0
# further requests read (and kept) while one is served
MAX_AHEAD = 8
# processes sharing a connection whose unfinished lines are kept apart
MAX_WRITERS = 16
_CRED = struct.Struct("3i")
_ANCILLARY = socket.CMSG_SPACE(_CRED.size) + socket.CMSG_SPACE(16 * 4)


class Conn:
    """One client connection, read line by line with the uid of whoever wrote each line.

    The kernel attaches the writer's credentials to every message (``SO_PASSCRED``) and never glues
    two writers' bytes into one read, so each writer's bytes are gathered into lines of their own: a
    process that shares the connection cannot corrupt the holder's requests with half a line.  A
    writer is ``None`` for bytes without credentials (where SO_PASSCRED could not be set)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        sock.setblocking(False)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        except OSError:
            # then no line has credentials, and none after the first request is believed
            pass
        # writer (pid, uid) -> its unfinished line
        self.partial: dict[tuple[int, int] | None, bytearray] = {}
        # writers inside an over-long line
        self.skipping: set[tuple[int, int] | None] = set()
        # (line or None: too long, writer's uid)
        self.lines: deque[tuple[bytes | None, int | None]] = deque()
        self.eof = False
        # an answer could not be sent: the client does not read; answer no more
        self.deaf = False
        self.closed = False
        # The loop watching the socket for input, and the future that the watch resolves.
        self.watched: tuple[asyncio.AbstractEventLoop, asyncio.Future[None]] | None = None

    async def _recv(self) -> bool:
        """Read what is there (waiting for it); False at the end of the connection."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                data, ancillary, _flags, _addr = self.sock.recvmsg(65536, _ANCILLARY)
                break
            except (BlockingIOError, InterruptedError):
                ready: asyncio.Future[None] = loop.create_future()
                loop.add_reader(self.sock.fileno(), _resolve, ready)
                self.watched = loop, ready
                try:
                    await ready
                finally:
                    # unless that was done already (and the socket watched anew)
                    self._unwatch(ready)
            except OSError:
                data, ancillary = b"", []
                break
        writer: tuple[int, int] | None = None
        for level, kind, payload in ancillary:
            if level != socket.SOL_SOCKET:
                continue
            if kind == socket.SCM_CREDENTIALS and len(payload) >= _CRED.size:
                # The pid is 0 for a writer in a pid namespace we cannot see; the uid is always the
                # writer's as the kernel maps it to ours (65534 when unmapped or unknown, never root).
                pid, uid, _gid = _CRED.unpack(payload[:_CRED.size])
                writer = (pid, uid)
            elif kind == socket.SCM_RIGHTS:
                # nobody passes us descriptors: close what came
                fds = array.array("i")
                fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
                for fd in fds:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
        if not data:
            self.eof = True
            return False
        self._gather(data, writer)
        return True

    def _gather(self, data: bytes, writer: tuple[int, int] | None) -> None:
        uid = writer[1] if writer is not None else None
        while data:
            at = data.find(b"\n")
            if writer in self.skipping:
                if at < 0:
                    return
                self.skipping.discard(writer)
                data = data[at + 1:]
                continue
            buf = self.partial.get(writer)
            if buf is None:
                # bounded: the oldest unfinished line goes
                if len(self.partial) >= MAX_WRITERS:
                    oldest = next(iter(self.partial))
                    del self.partial[oldest]
                    self.skipping.add(oldest)
                buf = self.partial[writer] = bytearray()
            if at < 0:
                buf += data
                if len(buf) > MAX_REQUEST:
                    del self.partial[writer]
                    self.skipping.add(writer)
                    self.lines.append((None, uid))
                return
            buf += data[:at + 1]
            data = data[at + 1:]
            del self.partial[writer]
            self.lines.append((bytes(buf) if len(buf) <= MAX_REQUEST + 1 else None, uid))

    async def readline(self) -> tuple[bytes | None, int | None] | None:
        """The next line (None: it was over :data:`MAX_REQUEST` bytes) and its writer's uid; None at
        the end of the connection."""
        while not self.lines:
            if self.eof or not await self._recv():
                return None
        return self.lines.popleft()

    def pending(self) -> bool:
        return bool(self.lines) or any(self.partial.values())

    def gone(self) -> bool:
        """Whether the client closed its end before anything was granted: a request read from a
        connection that has ended (its client gave up while the daemon could not answer, a stopped
        daemon) is dropped unanswered, never granted for a moment to nobody."""
        if self.eof:
            return True
        try:
            data = self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True
        if not data and not self.pending():
            self.eof = True
            return True
        return False

    async def watch(self, fut: asyncio.Future[Any], any_data_ends: bool) -> bool:
        """Wait for ``fut``; True when the client left meanwhile (or, with ``any_data_ends``, sent
        anything: protocol 1's "abandon").  Requests that arrive are kept for later, at most
        :data:`MAX_AHEAD` of them (more are dropped, logged: the end of the connection must still be
        seen)."""
        while not fut.done():
            if self.eof or (any_data_ends and self.pending()):
                return True
            while len(self.lines) > MAX_AHEAD:
                self.lines.pop()
                log.warning("lease socket: more than %d requests sent ahead of an answer: one dropped", MAX_AHEAD)
            reading = asyncio.ensure_future(self._recv())
            try:
                await asyncio.wait({fut, reading}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not reading.done():
                    reading.cancel()
                    # now, not when the cancelled read next runs
                    self._unwatch()
            if not reading.done() or reading.cancelled():
                break
            if not reading.result():
                return True
        return self.eof or (any_data_ends and self.pending())

    async def send(self, obj: dict[str, Any], fds: Sequence[int] = ()) -> bool:
        """Send one answer line; ``fds`` go with its first bytes (``SCM_RIGHTS``: the client then
        holds copies of the lease's descriptors).  False when it could not be sent (the client is
        deaf from then on)."""
        if self.deaf or self.closed:
            return False
        loop = asyncio.get_running_loop()
        try:
            data = json.dumps(obj, allow_nan=False).encode() + b"\n"
            if fds:
                sent = await asyncio.wait_for(send_with_rights(loop, self.sock, data, fds), SEND_TIMEOUT)
                data = data[sent:]
            if data:
                await asyncio.wait_for(loop.sock_sendall(self.sock, data), SEND_TIMEOUT)
        except (OSError, ValueError, asyncio.TimeoutError):
            # it does not read: its lease stays, its answers stop
            self.deaf = True
            return False
        return True

    def _unwatch(self, ready: asyncio.Future[None] | None = None) -> None:
        """Stop watching the socket (before it is closed: its number may be reused at once); with
        ``ready``, only that watch."""
        if self.watched is None or (ready is not None and self.watched[1] is not ready):
            return
        loop, self.watched = self.watched[0], None
        loop.remove_reader(self.sock.fileno())

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._unwatch()
            self.sock.close()


async def send_with_rights(loop: asyncio.AbstractEventLoop, sock: socket.socket, data: bytes,
                           fds: Sequence[int]) -> int:
    """Send ``data`` with ``fds`` attached (``SCM_RIGHTS``) on the non-blocking ``sock``, waiting
    (awaited, never blocking the loop) until it can be written; how many bytes went (the
    descriptors went with the first of them: the caller sends the rest)."""
    rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
    while True:
        try:
            return sock.sendmsg([data], rights)
        except (BlockingIOError, InterruptedError):
            if not await writable(loop, sock, SEND_TIMEOUT):
                raise TimeoutError("the client does not read") from None


async def writable(loop: asyncio.AbstractEventLoop, sock: socket.socket, timeout: float) -> bool:
    """Whether ``sock`` can be written to within ``timeout`` seconds (awaited, not blocking)."""
    if timeout <= 0:
        return False
    ready: asyncio.Future[None] = loop.create_future()
    fd = sock.fileno()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_writer(fd, wake)
    try:
        await asyncio.wait_for(ready, timeout)
        return True
    except asyncio.TimeoutError:
        return False
    finally:
        loop.remove_writer(fd)


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
