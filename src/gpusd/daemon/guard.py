"""Connection limits for the daemon's HTTP server: a header timeout and a cap on open connections.

aiohttp closes a connection that stays idle between requests (``keepalive_timeout``), but nothing
of its own bounds how many connections are open, and a client that sends half a request head
holds its connection (and a file descriptor) for as long as that timeout.  ~1,100 such clients
were enough to exhaust a 1024-descriptor daemon and take its API down (issue 9, finding 7).

:class:`ConnectionGuard` sits between the listening socket and aiohttp's protocol:

* **Header timeout**: a connection whose first request head (request line and headers, up to the
  blank line) is not complete ``header_timeout`` seconds after it was accepted is closed.  Later
  requests on a kept-alive connection are bounded by aiohttp's ``keepalive_timeout``.
* **Connection cap**: at most ``max_connections`` connections are open.  A new connection beyond
  the cap first evicts the oldest connection still waiting for its first request head (the
  slowloris kind: a real client sends its request at once); when there is none, the new
  connection is closed at once.

:class:`GuardedSite` is an aiohttp site (like ``web.TCPSite``) whose connections go through a guard.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

if TYPE_CHECKING:  # pragma: no cover
    import ssl

log = logging.getLogger(__name__)

WARN_EVERY = 60.0  # seconds between warnings about the same kind of pressure


class _GuardedProtocol(asyncio.Protocol):
    """Passes everything on to aiohttp's protocol; watches for the end of the first request head."""

    __slots__ = ("_made", "_tail", "_timer", "closed", "guard", "head_done", "inner", "transport")

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol) -> None:
        self.guard = guard
        self.inner = inner
        self.transport: asyncio.Transport | None = None
        self.head_done = False
        self.closed = False
        self._tail = b""
        self._timer: asyncio.TimerHandle | None = None
        self._made = False

    # asyncio.Protocol ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if not self.guard._admit(self):
            self.closed = True
            transport.abort()  # type: ignore[attr-defined]
            return
        self._made = True
        self._timer = asyncio.get_running_loop().call_later(self.guard.header_timeout, self._header_deadline)
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self._made:
            return
        if not self.head_done:
            buf = self._tail + data
            if b"\r\n\r\n" in buf or b"\n\n" in buf:
                self._head_complete()
            else:
                self._tail = buf[-3:]
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self._made else None

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        self.guard._forget(self)
        if self._made:
            self._made = False
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._made:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self._made:
            self.inner.resume_writing()

    # the guard's side ------------------------------------------------------------------------
    def _head_complete(self) -> None:
        self.head_done = True
        self._tail = b""
        self._cancel_timer()
        self.guard._head_complete(self)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _header_deadline(self) -> None:
        self._timer = None
        if self.head_done or self.closed:
            return
        self.guard.header_timeouts += 1
        self.guard._warn("header", "closing HTTP connections that did not send a request head within %g s "
                         "(slow or half-open clients); %d so far", self.guard.header_timeout,
                         self.guard.header_timeouts)
        self.abort()

    def abort(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.guard._forget(self)
        if self.transport is not None:
            self.transport.abort()  # frees the descriptor now; connection_lost follows


class ConnectionGuard:
    """Counts the daemon's HTTP connections and applies the header timeout and the cap."""

    def __init__(self, max_connections: int, header_timeout: float) -> None:
        self.max_connections = max(1, int(max_connections))
        self.header_timeout = float(header_timeout)
        # every open connection, oldest first; those still waiting for their first request head
        self._open: dict[_GuardedProtocol, None] = {}
        self._waiting: dict[_GuardedProtocol, None] = {}
        self.accepted = 0
        self.refused = 0  # closed at once: the cap was reached and nothing could be evicted
        self.evicted = 0  # closed to make room: waiting for their first request head
        self.header_timeouts = 0
        self._warned: dict[str, float] = {}

    @property
    def count(self) -> int:
        """Connections open now."""
        return len(self._open)

    @property
    def waiting(self) -> int:
        """Open connections that have not completed their first request head yet."""
        return len(self._waiting)

    def factory(self, inner: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """A protocol factory for ``loop.create_server`` wrapping ``inner`` (aiohttp's server)."""
        def make() -> asyncio.Protocol:
            return _GuardedProtocol(self, inner())

        return make

    def _admit(self, conn: _GuardedProtocol) -> bool:
        if len(self._open) >= self.max_connections:
            victim = next(iter(self._waiting), None)
            if victim is None:
                self.refused += 1
                self._warn("refused", "HTTP connection limit (%d) reached with every connection busy: "
                           "refusing new ones; %d refused so far", self.max_connections, self.refused)
                return False
            self.evicted += 1
            self._warn("evicted", "HTTP connection limit (%d) reached: closing connections still waiting for "
                       "their request head; %d closed so far", self.max_connections, self.evicted)
            victim.abort()
        self.accepted += 1
        self._open[conn] = None
        self._waiting[conn] = None
        return True

    def _head_complete(self, conn: _GuardedProtocol) -> None:
        self._waiting.pop(conn, None)

    def _forget(self, conn: _GuardedProtocol) -> None:
        self._open.pop(conn, None)
        self._waiting.pop(conn, None)

    def _warn(self, kind: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._warned.get(kind, -WARN_EVERY) >= WARN_EVERY:
            self._warned[kind] = now
            log.warning(msg, *args)
        else:
            log.debug(msg, *args)

    def to_dict(self) -> dict[str, Any]:
        return {"open": self.count, "waiting_for_head": self.waiting, "max_connections": self.max_connections,
                "header_timeout": self.header_timeout, "accepted": self.accepted, "refused": self.refused,
                "evicted": self.evicted, "header_timeouts": self.header_timeouts}


class GuardedSite(web.BaseSite):
    """A TCP site (``web.TCPSite``'s arguments) whose connections pass through ``guard``."""

    def __init__(self, runner: web.BaseRunner, guard: ConnectionGuard, host: str | None = None, port: int = 0, *,
                 ssl_context: ssl.SSLContext | None = None, backlog: int = 128,
                 reuse_address: bool | None = None) -> None:
        super().__init__(runner, ssl_context=ssl_context, backlog=backlog)
        self.guard = guard
        self._host = host
        self._port = port
        self._reuse_address = reuse_address
        self.bound_port: int | None = None

    @property
    def name(self) -> str:
        scheme = "https" if self._ssl_context else "http"
        return f"{scheme}://{self._host or '0.0.0.0'}:{self.bound_port or self._port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None
        extra: dict[str, Any] = {}
        if self._ssl_context is not None:  # a TLS handshake is bounded like a request head
            extra["ssl_handshake_timeout"] = self.guard.header_timeout
        self._server = await loop.create_server(
            self.guard.factory(server), self._host, self._port, ssl=self._ssl_context, backlog=self._backlog,
            reuse_address=self._reuse_address, **extra)
        sockets = self._server.sockets
        self.bound_port = sockets[0].getsockname()[1] if sockets else self._port
