"""Who may read what, and who may write: the daemon's access rules.

* Anyone who can reach the daemon may read GPU load (every ``GET``).
* Process and lease owners (``user``) and command lines (``command``) are private.  A reader sees
  them when it presents the daemon's shared token (``Authorization: Bearer <token>``), or when it
  connects from this machine (loopback: ``ps`` shows it the same), unless ``trust_loopback`` is off.
  Everyone else gets them as ``null``.
* Nothing but ``GET``/``HEAD``/``OPTIONS`` is accepted without the token: ``405`` when the daemon
  has no token (it takes no writes at all), ``401`` when the token is missing or wrong.

:func:`middleware` enforces both for JSON answers.  Handlers that stream (server-sent events) must
call :func:`can_see_private` and pass their payloads through :func:`redact` themselves.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from typing import TYPE_CHECKING, Any, Awaitable, Callable

if TYPE_CHECKING:  # pragma: no cover
    from aiohttp import web

PRIVATE_FIELDS = ("user", "command")
_PRIVATE_LISTS = ("processes", "leases")
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
REQUEST_KEY = "gpusd.private"  # request[REQUEST_KEY]: True when this reader may see private fields


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


def _strip(entry: Any) -> Any:
    if not isinstance(entry, dict):
        return entry
    return {k: (None if k in PRIVATE_FIELDS else v) for k, v in entry.items()}


def bearer_token(headers: Any) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None."""
    value = headers.get("Authorization", "")
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
    """The access rules of one daemon."""

    def __init__(self, token: str | None, trust_loopback: bool = True) -> None:
        self.token = token or None
        self.trust_loopback = trust_loopback

    def token_ok(self, headers: Any) -> bool:
        if self.token is None:
            return False
        given = bearer_token(headers)
        return given is not None and hmac.compare_digest(given.encode(), self.token.encode())

    def may_see_private(self, headers: Any, remote: str | None) -> bool:
        if self.trust_loopback and is_loopback(remote):
            return True
        return self.token_ok(headers)

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
    return bool(request.get(REQUEST_KEY, False))


Handler = Callable[["web.Request"], Awaitable["web.StreamResponse"]]


def middleware(access: Access) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """An aiohttp middleware applying ``access``: refuses writes without the token, marks each request
    with :data:`REQUEST_KEY`, and redacts JSON answers for readers without the right to see private
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
        request[REQUEST_KEY] = private
        response = await handler(request)
        if not private and isinstance(response, web.Response) and response.content_type == "application/json":
            body = response.body
            if isinstance(body, (bytes, bytearray)) and (b'"user"' in body or b'"command"' in body):
                data = json.loads(body)
                response.body = json.dumps(redact(data), separators=(",", ":")).encode()
        return response

    return gpusd_access
