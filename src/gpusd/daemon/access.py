"""Who may read what, and who may write: the daemon's access rules.

* Anyone who can reach the daemon may read GPU load (every ``GET``).
* Process and lease owners (``user``) and command lines (``command``) are private.  A reader sees
  them when it presents the daemon's shared token (``Authorization: Bearer <token>``), or when it
  connects from this machine (loopback or one of the daemon's own addresses: ``ps`` shows it the
  same), unless ``trust_loopback`` is off.  Everyone else gets them as ``null``.
* Nothing but ``GET``/``HEAD``/``OPTIONS`` is accepted without the token: ``405`` when the daemon
  has no token (it takes no writes at all), ``401`` when the token is missing or wrong.

:func:`middleware` enforces both for JSON answers.  Handlers that stream (server-sent events) pass
every message through ``stream_filter(request)`` (:func:`stream_filter`).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import re
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from aiohttp import web

PRIVATE_FIELDS = ("user", "command")
_PRIVATE_LISTS = ("processes", "leases")
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_KEY: Any = None  # request[_request_key()]: True when this reader may see private fields


def _request_key() -> Any:
    global _KEY
    if _KEY is None:
        from aiohttp import web

        _KEY = web.RequestKey("gpusd.private", bool) if hasattr(web, "RequestKey") else "gpusd.private"
    return _KEY


def redact(payload: Any) -> Any:
    """A copy of a JSON-like payload (snapshot, GPU list, fleet, event data) where every entry of a
    ``processes`` or ``leases`` list has ``user`` and ``command`` set to ``None``.  Other values are
    shared, not copied."""
    if isinstance(payload, dict):
        out = {}
        for k, v in payload.items():
            if k in _PRIVATE_LISTS and isinstance(v, list):
                out[k] = [_strip(e) for e in v]
            else:
                out[k] = redact(v)
        return out
    if isinstance(payload, list):
        return [redact(v) for v in payload]
    return payload


_PRIVATE_VALUE = re.compile(rb'"(?:user|command)"\s*:\s*"')


def needs_redaction(body: bytes) -> bool:
    """Whether a JSON text may carry a private value (a non-null ``user`` or ``command``)."""
    return _PRIVATE_VALUE.search(body) is not None


def redact_json(body: bytes) -> bytes:
    """A JSON text with private fields nulled (returned as is when it carries none)."""
    if not needs_redaction(body):
        return body
    return json.dumps(redact(json.loads(body)), separators=(",", ":"), allow_nan=False).encode()


def redact_event(message: bytes) -> bytes:
    """One server-sent event (``event: NAME\ndata: JSON\n\n``) with private fields nulled.  An event
    whose data cannot be parsed but may hold private values is dropped (``b""``), never passed on."""
    if b'"user"' not in message and b'"command"' not in message:
        return message  # the common case (heartbeats, events without processes): no parsing
    lines = message.split(b"\n")
    data = b"\n".join(ln[5:].removeprefix(b" ") for ln in lines if ln.startswith(b"data:"))
    if not needs_redaction(data):
        return message
    try:
        clean = redact_json(data)
    except ValueError:
        return b""
    out, placed = [], False
    for ln in lines:
        if ln.startswith(b"data:"):
            if not placed:
                out.append(b"data: " + clean)
                placed = True
            continue
        out.append(ln)
    return b"\n".join(out)


def _identity(message: bytes) -> bytes:
    return message


def stream_filter(request: web.Request) -> Callable[[bytes], bytes]:
    """What an event-stream handler passes every message through before writing it to this reader:
    :func:`redact_event` for readers who may not see private fields, else nothing."""
    return _identity if can_see_private(request) else redact_event


def _strip(entry: Any) -> Any:
    if not isinstance(entry, dict):
        return entry
    return {k: (None if k in PRIVATE_FIELDS else v) for k, v in entry.items()}


def bearer_token(headers: Any) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None."""
    value = str(headers.get("Authorization", ""))
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def is_loopback(remote: str | None) -> bool:
    if not remote:
        return False
    try:
        return ipaddress.ip_address(remote.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


class Access:
    """The access rules of one daemon.  ``own_addresses()`` gives the daemon's own addresses: a
    reader connecting from one of them is on this machine, like a loopback reader."""

    def __init__(self, token: str | None, trust_loopback: bool = True,
                 own_addresses: Callable[[], Iterable[str]] | None = None) -> None:
        self.token = token or None
        self.trust_loopback = trust_loopback
        self._own = own_addresses

    def token_ok(self, headers: Any) -> bool:
        if self.token is None:
            return False
        given = bearer_token(headers)
        return given is not None and hmac.compare_digest(given.encode(), self.token.encode())

    def may_see_private(self, headers: Any, remote: str | None) -> bool:
        if self.trust_loopback and (is_loopback(remote) or self._is_own(remote)):
            return True
        return self.token_ok(headers)

    def _is_own(self, remote: str | None) -> bool:
        if not remote or self._own is None:
            return False
        try:
            return remote in set(self._own())
        except Exception:  # noqa: BLE001 - an address list that fails means "not own"
            return False

    def write_refusal(self, headers: Any) -> tuple[int, str] | None:
        """(status, message) when a write must be refused, else None."""
        if self.token is None:
            return 405, "this daemon accepts no writes: start it with a token (--token) to allow them"
        if not self.token_ok(headers):
            return 401, "a write needs the daemon's token: send 'Authorization: Bearer <token>'"
        return None


def can_see_private(request: web.Request) -> bool:
    """Whether the reader of this request may see process owners and commands (set by
    :func:`middleware`; False when the middleware is not installed)."""
    return bool(request.get(_request_key(), False))


Handler = Callable[["web.Request"], Awaitable["web.StreamResponse"]]


def middleware(access: Access) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """An aiohttp middleware applying ``access``: refuses writes without the token, marks each request
    (see :func:`can_see_private`), and redacts JSON answers for readers without the right to see private
    fields."""
    from aiohttp import web

    @web.middleware
    async def gpusd_access(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method not in SAFE_METHODS:
            refused = access.write_refusal(request.headers)
            if refused is not None:
                status, message = refused
                headers = {"Allow": "GET, HEAD, OPTIONS"} if status == 405 else {
                    "WWW-Authenticate": 'Bearer realm="gpusd"'}
                return web.json_response({"error": message}, status=status, headers=headers)
        private = access.may_see_private(request.headers, request.remote)
        request[_request_key()] = private
        response = await handler(request)
        if not private and isinstance(response, web.Response) and response.content_type == "application/json":
            body = response.body
            if isinstance(body, (bytes, bytearray)) and needs_redaction(bytes(body)):
                try:
                    response.body = redact_json(bytes(body))
                except ValueError:  # not JSON after all: hold it back rather than leak it
                    return web.json_response({"error": "answer withheld"}, status=500)
        return response

    return gpusd_access
