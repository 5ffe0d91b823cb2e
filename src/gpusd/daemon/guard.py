"""Connection limits for the daemon's HTTP server: a header timeout and a cap on open connections.

aiohttp closes a connection that stays idle between requests (``keepalive_timeout``), but nothing
of its own bounds how many connections are open, and a client that sends half a request head
holds its connection (and a file descriptor) for as long as that timeout.  ~1,100 such clients
were enough to exhaust a 1024-descriptor daemon and take its API down.

:class:`ConnectionGuard` sits between the listening socket and aiohttp's protocol:

* **Header timeout**: a connection whose first request head (request line and headers, up to the
  blank line) is not complete ``header_timeout`` seconds after it was accepted is closed.  Later
  requests on a kept-alive connection are bounded by aiohttp's ``keepalive_timeout``.
* **Connection cap**: at most ``max_connections`` connections are open.
* **Signed connections**: the access rules tell the guard when a request with a
  valid signature arrived on a connection (:func:`connection_of`); from then on the connection is a
  secret holder's: it counts against ``max_connections`` only, and it is never closed to make room.
* **A share strangers cannot take**: connections not (yet) signed — waiting for their first request
  head, or having sent only unsigned requests — hold at most ``max_connections - reserved`` places,
  and those of one peer address (:func:`gpusd.daemon.access.peer_of`: an IPv4 address, an IPv6 /64)
  at most ``per_peer``.

  The guard sees a connection before any request on it is signed.  When a new connection would go
  beyond one of these limits, the guard first makes room by closing a connection that is *not*
  signed and costs its owner little: the oldest still waiting for its first request head (the
  slowloris kind: a real client sends its request at once) — of the new connection's own peer when
  that peer is at its ``per_peer`` share, else of anyone — else the oldest *idle* one (between two
  requests of a keep-alive) of that peer, or of the peer holding the most unsigned connections.
  When every such connection is busy (event streams, requests in progress), the new connection is
  let in **on probation**, beyond the limits (at most ``reserved`` at once; beyond, the oldest
  on probation of the peer that holds the most there is closed): its first request must
  be signed, or it is answered ``503`` (``Retry-After: 5``) and closed.  A signed one is kept, and
  to bring the count back under ``max_connections`` the guard closes the oldest unsigned connection
  (waiting, else idle, else busy) of the peer holding the most.  So a secret holder's connection
  always gets in while strangers hold places, and strangers never push out each other's busy
  connections.  Without a fleet secret (``reserved`` 0: nobody can sign) a new connection finding
  every connection busy is closed at once.

:class:`GuardedSite` is an aiohttp site (like ``web.TCPSite``) whose connections go through a guard;
it serves only an app whose every route is behind the access rules
(:func:`gpusd.daemon.routes.check_routes`, run once the router is frozen).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from .access import peer_of, watched_by
from .bypeer import ByPeer
from .routes import check_routes

if TYPE_CHECKING:  # pragma: no cover
    import ssl

log = logging.getLogger(__name__)

# seconds between warnings about the same kind of pressure
WARN_EVERY = 60.0


# the open connections of every guard, by transport
_BY_TRANSPORT: dict[Any, _GuardedProtocol] = {}


def connection_of(transport: Any) -> _GuardedProtocol | None:
    """The guard's record of the connection ``transport`` (None: no guard watches it).  The access
    rules (:func:`gpusd.daemon.access.serve`) call ``record.guard._request_started(record, signed)``
    when a request starts on it -- ``signed`` when it carries a valid signature (or rides a TLS
    connection one authenticated); False: an unsigned request on a connection admitted beyond the
    limits, to be answered 503 and closed -- and take one off ``record.busy`` when it ends."""
    return _BY_TRANSPORT.get(transport)


class _GuardedProtocol(asyncio.Protocol):
    """Passes everything on to aiohttp's protocol; watches for the end of the first request head."""

    __slots__ = ("_made", "_tail", "_timer", "busy", "closed", "guard", "head_done", "inner",
                 "peer", "probation", "remote", "signed", "transport")

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol) -> None:
        self.guard = guard
        self.inner = inner
        self.transport: asyncio.Transport | None = None
        self.head_done = False
        self.closed = False
        # a verified signed request came on it: a secret holder's connection
        self.signed = False
        # requests in progress (an event stream is one for as long as it lasts)
        self.busy = 0
        # admitted beyond the limits: its first request must be signed
        self.probation = False
        self.peer = "-"
        # the peer's address, as aiohttp's request.remote gives it
        self.remote: str | None = None
        self._tail = b""
        self._timer: asyncio.TimerHandle | None = None
        self._made = False

    # asyncio.Protocol ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peername = transport.get_extra_info("peername")
        if isinstance(peername, (list, tuple)) and peername:
            self.remote = str(peername[0])
        elif peername is not None:
            self.remote = str(peername)
        self.peer = peer_of(self.remote if isinstance(peername, tuple) and peername else None)
        if not self.guard._admit(self):
            self.closed = True
            transport.abort()  # type: ignore[attr-defined]
            return
        self._made = True
        _BY_TRANSPORT[transport] = self
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
            # frees the descriptor now; connection_lost follows
            self.transport.abort()


class ConnectionGuard:
    """Counts the daemon's HTTP connections and applies the header timeout, the cap, the share kept
    for signed connections (``reserved``, at most half the cap) and the per-peer share."""

    def __init__(self, max_connections: int, header_timeout: float, per_peer: int | None = None,
                 reserved: int = 0) -> None:
        self.max_connections = max(1, int(max_connections))
        self.header_timeout = float(header_timeout)
        self.per_peer = max(1, int(per_peer)) if per_peer is not None else None
        self.reserved = min(max(0, int(reserved)), self.max_connections // 2)
        # every open connection, oldest first; those still waiting for their first request head;
        # those not signed, per peer
        self._open: dict[_GuardedProtocol, None] = {}
        self._waiting: dict[_GuardedProtocol, None] = {}
        self._unsigned: ByPeer[_GuardedProtocol] = ByPeer()
        # beyond the limits: must sign its first request
        self._probation: dict[_GuardedProtocol, None] = {}
        self.accepted = 0
        # closed at once: nothing could make room (every connection busy or signed)
        self.refused = 0
        # closed to make room: waiting for their first request head
        self.evicted = 0
        # closed to make room: idle or busy, not signed
        self.evicted_unsigned = 0
        self.header_timeouts = 0
        self._warned: dict[str, float] = {}
        # the access rules find each request's connection record here
        watched_by(connection_of)

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

    @property
    def unsigned(self) -> int:
        """Open connections not signed (waiting for their first request head, or unsigned)."""
        return len(self._unsigned)

    @property
    def on_probation(self) -> int:
        """Connections admitted beyond the limits, whose first request must be signed."""
        return len(self._probation)

    def _over(self) -> bool:
        return len(self._open) >= self.max_connections or self.unsigned >= self.max_connections - self.reserved

    def _admit(self, conn: _GuardedProtocol) -> bool:
        peer = conn.peer
        mine = self._unsigned.of(peer)
        if self.per_peer is not None and len(mine) >= self.per_peer:
            # this peer is at its share: it makes room among its own connections
            victim = self._victim(mine, busy=False)
            if victim is None:
                return self._on_probation(conn)
            self._make_room(victim, "peer")
        while self._over():
            victim = next((c for c in self._waiting), None)
            if victim is None:
                victim = self._idle_of_heaviest()
            if victim is None:
                return self._on_probation(conn)
            self._make_room(victim, "cap")
        self.accepted += 1
        self._open[conn] = None
        self._waiting[conn] = None
        self._unsigned.add(peer, conn)
        return True

    def _on_probation(self, conn: _GuardedProtocol) -> bool:
        """Every connection that could make room is busy (or signed): admit ``conn`` beyond the
        limits, on probation, when the daemon has a share for signed connections; its first request
        must be signed (:meth:`_request_started`).  At most ``reserved`` such connections at once:
        beyond, the oldest of them is closed."""
        if self.reserved == 0 or (len(self._probation) >= self.reserved and not self._drop_oldest_probation(conn)):
            self.refused += 1
            self._warn("refused", "HTTP connection limit (%d) reached with every connection busy or signed: "
                       "refusing new ones; %d refused so far", self.max_connections, self.refused)
            return False
        self.accepted += 1
        conn.probation = True
        self._probation[conn] = None
        return True

    def _drop_oldest_probation(self, newcomer: _GuardedProtocol) -> bool:
        """Close the oldest connection on probation of the peer holding the most of them, counting
        ``newcomer`` as its peer's (none of them is signed: a signed request takes its connection off
        probation at once), whatever it is doing: a stranger cannot park connections there (with
        requests the access layer refuses before the guard hears of them).  The heaviest peer's, not
        simply the oldest: a secret holder's connection is on probation until its first request
        arrives, and a stranger opening connections meanwhile must close its own, never that one."""
        count: dict[str, int] = {newcomer.peer: 1}
        for c in self._probation:
            count[c.peer] = count.get(c.peer, 0) + 1
        heaviest = max(count.values())
        victim = next((c for c in self._probation if count[c.peer] == heaviest), None)
        # the newcomer's own peer is the heaviest, with nothing older here: the oldest
        if victim is None:
            victim = next(iter(self._probation), None)
        if victim is None:
            return False
        self.evicted += 1
        victim.abort()
        return True

    @staticmethod
    def _victim(conns: dict[_GuardedProtocol, None], busy: bool = True) -> _GuardedProtocol | None:
        """Of ``conns`` (oldest first): the oldest waiting for its head, else the oldest idle, else
        (``busy``) the oldest busy one."""
        waiting = next((c for c in conns if not c.head_done), None)
        if waiting is not None:
            return waiting
        idle = next((c for c in conns if c.busy == 0), None)
        if idle is not None or not busy:
            return idle
        return next(iter(conns), None)

    def _idle_of_heaviest(self) -> _GuardedProtocol | None:
        """The oldest idle unsigned connection of the peer holding the most unsigned connections
        (the next heaviest when that one has none idle)."""
        for peer in self._unsigned.heaviest_first():
            victim = self._victim(self._unsigned.of(peer), busy=False)
            if victim is not None:
                return victim
        return None

    def _make_room(self, victim: _GuardedProtocol, why: str) -> None:
        # already closing: just stop counting it
        if victim.closed:
            self._forget(victim)
            return
        if not victim.head_done:
            self.evicted += 1
            self._warn("evicted", "HTTP connection limit (%d, %s per peer) reached: closing connections still "
                       "waiting for their request head; %d closed so far", self.max_connections,
                       self.per_peer or "any", self.evicted)
        else:
            self.evicted_unsigned += 1
            self._warn("evicted_unsigned", "HTTP connections without a signature at their limit (%s): closing "
                       "the oldest of the peer that holds the most (%s); %d closed so far",
                       "per peer" if why == "peer" else f"{self.max_connections - self.reserved} in all",
                       victim.peer, self.evicted_unsigned)
        victim.abort()

    def _head_complete(self, conn: _GuardedProtocol) -> None:
        self._waiting.pop(conn, None)

    def _request_started(self, conn: _GuardedProtocol, signed: bool) -> bool:
        """A request starts on ``conn``; False when it must be refused (an unsigned request on a
        connection admitted on probation)."""
        conn.busy += 1
        if conn.probation:
            if not signed:
                return False
            # a secret holder's connection: it is kept, and a stranger's makes room for it
            conn.probation = False
            self._probation.pop(conn, None)
            self._open[conn] = None
            conn.signed = True
            while len(self._open) > self.max_connections and self._unsigned:
                heaviest = self._unsigned.heaviest_first()[0]
                victim = self._victim(self._unsigned.of(heaviest))
                if victim is None:
                    break
                self._make_room(victim, "cap")
            return True
        if signed and not conn.signed:
            conn.signed = True
            self._unsign(conn)
        return True

    def _request_ended(self, conn: _GuardedProtocol) -> None:
        conn.busy = max(0, conn.busy - 1)

    def _unsign(self, conn: _GuardedProtocol) -> None:
        self._unsigned.discard(conn.peer, conn)

    def _forget(self, conn: _GuardedProtocol) -> None:
        self._open.pop(conn, None)
        self._waiting.pop(conn, None)
        self._probation.pop(conn, None)
        self._unsign(conn)
        if conn.transport is not None and _BY_TRANSPORT.get(conn.transport) is conn:
            del _BY_TRANSPORT[conn.transport]

    def _warn(self, kind: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._warned.get(kind, -WARN_EVERY) >= WARN_EVERY:
            self._warned[kind] = now
            log.warning(msg, *args)
        else:
            log.debug(msg, *args)

    def to_dict(self) -> dict[str, Any]:
        return {"open": self.count, "waiting_for_head": self.waiting, "unsigned": self.unsigned,
                "max_connections": self.max_connections, "reserved": self.reserved, "per_peer": self.per_peer,
                "header_timeout": self.header_timeout, "accepted": self.accepted, "refused": self.refused,
                "evicted": self.evicted, "evicted_unsigned": self.evicted_unsigned, "on_probation": self.on_probation,
                "header_timeouts": self.header_timeouts}


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
        # the router is frozen by now: no route can be added behind the access rules' back

        app = getattr(self._runner, "app", None)
        if app is None:
            raise RuntimeError("a guarded site serves the daemon's app (an AppRunner)")
        check_routes(app)
        await super().start()
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None
        extra: dict[str, Any] = {}
        # a TLS handshake is bounded like a request head
        if self._ssl_context is not None:
            extra["ssl_handshake_timeout"] = self.guard.header_timeout
        self._server = await loop.create_server(
            self.guard.factory(server), self._host, self._port, ssl=self._ssl_context, backlog=self._backlog,
            reuse_address=self._reuse_address, **extra)
        sockets = self._server.sockets
        self.bound_port = sockets[0].getsockname()[1] if sockets else self._port
