"""Who may read what, and who may write: the daemon's access rules (docs/security.md).

* Anyone who can reach the daemon may read GPU load (every ``GET``, unsigned: cheap).
* Process and lease owners (``user``) and command lines (``command``) are private.  A reader sees
  them when its request is signed with the fleet secret (RFC 9421, :mod:`gpusd.wire.signing`), or
  when it connects from this machine (loopback or one of the daemon's own addresses: ``ps`` shows
  it the same) *and* its ``Host`` names this daemon (a browser page on a rebound name does not),
  unless ``trust_loopback`` is off.  Everyone else gets them as ``null``.
* Nothing but ``GET``/``HEAD``/``OPTIONS`` is accepted without a valid signature: ``405`` when the
  daemon has no secret (it takes no writes at all), ``401`` otherwise, ``403`` from another site's
  page (``Origin``).
* A bad, stale, replayed or malformed signature, and any ``Authorization`` header (gpusd takes no
  bearer secrets), get ``401`` — never a 500.
* The answer to a verified request is signed back (:func:`install_proofs`): the client's proof
  that this daemon holds the secret.

:func:`serve` enforces these on every route of the daemon (:mod:`gpusd.daemon.routes` registers each
route through it and refuses to start with one that is not) and redacts JSON answers.  Handlers that
stream (server-sent events) pass every message through ``stream_filter(request)`` (:func:`stream_filter`).
"""

# Imports inside functions: optional or heavy packages.
from __future__ import annotations

import datetime
import functools
import hmac
import ipaddress
import json
import logging
import re
import weakref
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from ..model import private_keys, redact
from ..wire.signing import FleetKey, Headers, NonceCache, Request, Response, signature_base

if TYPE_CHECKING:  # pragma: no cover
    from aiohttp import web

log = logging.getLogger(__name__)


SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# aiohttp's keys of the marks a request carries, made on first use (name -> key)
_KEYS: dict[str, Any] = {}


def _mark_key(name: str, kind: type = bool) -> Any:
    key = _KEYS.get(name)
    if key is None:
        from aiohttp import web

        key = _KEYS[name] = web.RequestKey(name, kind) if hasattr(web, "RequestKey") else name
    return key


def _request_key() -> Any:
    """request[_request_key()]: True when this reader may see private fields."""
    return _mark_key("gpusd.private")


# the model's private fields (gpusd.model.PRIVATE)
_PRIVATE_NAMES = sorted(private_keys()[0])
_PRIVATE_VALUE = re.compile(rb'"(?:' + b"|".join(re.escape(k.encode()) for k in _PRIVATE_NAMES) + rb')"\s*:\s*"')
_PRIVATE_KEYS = tuple(b'"' + k.encode() + b'"' for k in _PRIVATE_NAMES)


def needs_redaction(body: bytes) -> bool:
    """Whether a JSON text may carry a private value (a non-null ``user`` or ``command``)."""
    return _PRIVATE_VALUE.search(body) is not None


def redact_json(body: bytes) -> bytes:
    """A JSON text with private fields nulled (returned as is when it carries none)."""
    if not needs_redaction(body):
        return body
    return json.dumps(redact(json.loads(body)), separators=(",", ":"), allow_nan=False).encode()


# [message, its redaction]: one event goes to every reader
_LAST_REDACTED: list[bytes] = []


def redact_event(message: bytes) -> bytes:
    """One server-sent event (``event: NAME\ndata: JSON\n\n``) with private fields nulled.  An event
    whose data cannot be parsed but may hold private values is dropped (``b""``), never passed on.
    The last event's redaction is remembered (by identity: the hub hands one bytes object to every
    reader), so a snapshot event is parsed once, not once per public reader."""
    if not any(k in message for k in _PRIVATE_KEYS):
        # the common case (heartbeats, events without processes): no parsing
        return message
    if _LAST_REDACTED and _LAST_REDACTED[0] is message:
        return _LAST_REDACTED[1]
    out = _redact_event(message)
    # holds the message: its id cannot be reused meanwhile
    _LAST_REDACTED[:] = [message, out]
    return out


def _redact_event(message: bytes) -> bytes:
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


FLEET_ALL, FLEET_OWN, FLEET_NONE = "all", "own", "none"


def fleet_level(request: web.Request) -> str:
    """Whose private fields a reader of the fleet view (``/api/v1/fleet``, its event stream) gets: every
    host's for a secret holder (:func:`is_signed`, ``FLEET_ALL``), this host's alone for a reader who
    sees them because it is local (unsigned, on loopback: ``FLEET_OWN``), none for anyone else."""
    if not can_see_private(request):
        return FLEET_NONE
    return FLEET_ALL if is_signed(request) else FLEET_OWN


def fleet_filter(request: web.Request, own_node: str) -> Callable[[bytes], bytes]:
    """:func:`stream_filter` for the fleet's event stream, by :func:`fleet_level`: the events of this host
    (``own_node``) as they are and every other host's redacted for a local reader without the secret."""
    level = fleet_level(request)
    if level == FLEET_NONE:
        return redact_event
    if level == FLEET_ALL:
        return _identity

    def local(message: bytes) -> bytes:
        if not any(k in message for k in _PRIVATE_KEYS) or _event_node(message) == own_node:
            return message
        return redact_event(message)

    return local


def _event_node(message: bytes) -> str | None:
    """The ``node_id`` an event's data names (None: none, or data that cannot be read)."""
    data = b"\n".join(ln[5:].removeprefix(b" ") for ln in message.split(b"\n") if ln.startswith(b"data:"))
    try:
        node = json.loads(data).get("node_id")
    except (ValueError, AttributeError):
        return None
    return node if isinstance(node, str) else None


# called per request with the peer's address: parse each one once
@functools.lru_cache(maxsize=256)
def is_loopback(remote: str | None) -> bool:
    if not remote:
        return False
    try:
        addr = ipaddress.ip_address(remote.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        # ::ffff:127.0.0.1 on a dual-stack socket
        addr = addr.ipv4_mapped
    return addr.is_loopback


LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def peer_of(remote: str | None) -> str:
    """The peer a connection or request is counted against (per-peer limits, holders of remote
    leases): its IPv4 address (an IPv4-mapped IPv6 address as IPv4), the /64 of an IPv6 address (one
    machine usually has a whole /64 to pick source addresses from), ``-`` when unknown."""
    if not remote:
        return "-"
    try:
        addr = ipaddress.ip_address(remote.split("%", 1)[0])
    except ValueError:
        return remote[:64]
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return str(addr.ipv4_mapped)
        if not addr.is_loopback:
            return str(ipaddress.IPv6Network((addr, 64), strict=False))
    return str(addr)


_KEYID = re.compile(r'keyid="([A-Za-z0-9._-]{1,64})"')


# per request with the Host header: parse each value once
@functools.lru_cache(maxsize=256)
def split_host(value: str) -> tuple[str, int | None] | None:
    """``name``, ``name:port``, ``[v6]:port`` -> (lower-case name without a trailing dot, port or
    None); None when it is not a host."""
    if not value or len(value) > 300 or not value.isascii() or any(c in value for c in " /\\@?#\t"):
        return None
    value = value.lower()
    port: int | None = None
    if value.startswith("["):
        name, sep, rest = value[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            return None
        port_text = rest[1:] if rest else None
    else:
        name, sep, port_text = value.rpartition(":")
        if not sep:
            name, port_text = value, None
        elif ":" in name:  # a bare IPv6 address
            return None
    if port_text is not None:
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            return None
        port = int(port_text)
    name = name.rstrip(".")
    return (name, port) if name else None


def _seconds(value: object) -> float | None:
    """A signature's ``created`` as seconds since the epoch (the library gives a datetime, the fast
    path an int); None when it is neither."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, datetime.datetime):
        return value.timestamp()
    return None


class _Verified(Request):
    """A request whose signature the daemon checked: its ``nonce`` and the library's ``result``, and
    ``base``, the RFC 9421 signature base (what a user's SSH key signs, :mod:`gpusd.wire.sshsig`),
    made from the result when first read (only remote writes read it)."""

    nonce: Any = None
    result: Any = None

    @functools.cached_property
    def base(self) -> bytes:
        return signature_base(self.result)


class Access:
    """The access rules of one daemon.

    ``token``: the fleet secret (None: trust off, no writes, no signed readers).  ``own_addresses()``,
    ``own_names()`` and ``own_ports()`` say who the daemon is: a ``Host`` header must name one of
    them (or ``localhost``) for a request to see private fields, to write, or to carry a valid
    signature (DNS rebinding, replay to another daemon).  A reader connecting from one of the own
    addresses is on this machine, like a loopback reader.  ``node_id()`` and ``cert_fp()`` go into
    signed answers (docs/security.md), with ``host_name()`` and ``own_addresses()``: who the daemon
    is, the name and addresses clients act on."""

    def __init__(self, token: str | None, trust_loopback: bool = True,
                 own_addresses: Callable[[], Iterable[str]] | None = None,
                 own_names: Callable[[], Iterable[str]] | None = None,
                 own_ports: Callable[[], Iterable[int]] | None = None,
                 node_id: Callable[[], str | None] | None = None,
                 cert_fp: Callable[[], str | None] | None = None,
                 host_name: Callable[[], str | None] | None = None) -> None:
        self.token = token or None
        self.key = FleetKey(self.token) if self.token else None
        self.nonces = NonceCache()
        # TLS connections on which a signed request was verified: later reads on them are the same
        # client's (TLS binds them), so they need no signature of their own (docs/security.md).
        self.sessions: weakref.WeakSet[Any] = weakref.WeakSet()
        # public answers already checked for private values, by identity (see _public)
        self.clean: dict[int, bytes] = {}
        self.trust_loopback = trust_loopback
        self._own = own_addresses
        self._names = own_names
        self._ports = own_ports
        self._node_id = node_id
        self._cert_fp = cert_fp
        self._host_name = host_name

    # -- who is asking -----------------------------------------------------------------------------
    def _is_own(self, remote: str | None) -> bool:
        if not remote or self._own is None:
            return False
        try:
            return remote in set(self._own())
        except Exception:  # noqa: BLE001 - an address list that fails means "not own"
            return False

    def local_reader(self, remote: str | None) -> bool:
        return self.trust_loopback and (is_loopback(remote) or self._is_own(remote))

    def host_ok(self, host: str | None, remote: str | None = None) -> bool:
        """Whether a ``Host`` header (or an ``@authority``, or an ``Origin``'s host) sent by the peer
        ``remote`` names this daemon: one of its own addresses or names (``name``, ``name.local``),
        on one of its ports (any port when the daemon does not say); ``localhost`` and loopback
        addresses only when the peer itself is on loopback (from another machine, "localhost" is
        that machine, not this daemon: a request signed for it must not be accepted here)."""
        parsed = split_host(host or "")
        if parsed is None:
            return False
        name, port = parsed
        try:
            ports = self._ports() if self._ports is not None else ()
            if ports and (port if port is not None else 80) not in ports:
                return False
            if name in LOOPBACK_NAMES or is_loopback(name):
                return is_loopback(remote)
            own = {a.lower() for a in (self._own() if self._own is not None else ())}
            for n in (self._names() if self._names is not None else ()):
                n = n.lower().rstrip(".")
                own.update((n, n + ".local") if not n.endswith(".local") else (n,))
        except Exception:  # noqa: BLE001 - a failing callback: not ours
            return False
        return name in own

    def origin_ok(self, origin: str | None, remote: str | None = None) -> bool:
        """No ``Origin`` (not a browser), or one of this daemon's own pages (as :meth:`host_ok` for
        the peer ``remote``)."""
        if origin is None:
            return True

        try:
            parts = urlsplit(origin)
        except ValueError:
            return False
        return parts.scheme in ("http", "https") and self.host_ok(parts.netloc, remote)

    # -- signatures --------------------------------------------------------------------------------
    def verify(self, method: str, scheme: str, host: str, raw_path: str, headers: Any,
               body: bytes = b"", remote: str | None = None) -> tuple[Any, str | None]:
        """Check a signed request from the peer ``remote``: (the signature library's request object,
        None) when it is valid, else (None, why not).  Never raises: anything malformed is simply not
        valid.  A write (any method but GET/HEAD/OPTIONS) must cover ``gpusd-node``: this daemon's
        node id, so that one signed write is good for one daemon only; a ``localhost`` or loopback
        ``@authority`` is accepted from loopback peers only (:meth:`host_ok`)."""
        if self.key is None:
            return None, "this daemon has no fleet secret"
        if not self.host_ok(host, remote):
            return None, "the request does not name this daemon (Host/@authority)"
        try:
            req = _Verified(method, f"{scheme}://{host}{raw_path}", Headers((k, v) for k, v in headers.items()))
            result = self.key.verify_request(req, body)
        except Exception as exc:  # noqa: BLE001 - InvalidSignature, malformed fields, odd bytes
            return None, f"bad signature: {str(exc)[:120]}"
        covered = result.covered_components
        bound = covered.get('"gpusd-cert"')
        if scheme == "https" or bound is not None:
            # The signature must name the certificate this connection shows (the one the client
            # pinned and saw): a relay that shows the client its own certificate and replays the
            # request on its own TLS connection to us presents a fingerprint that is not ours; a
            # request signed for plain HTTP carries none.
            own = self._cert_fp() if self._cert_fp is not None else None
            if bound is None:
                return None, ("over TLS a signature must cover the certificate the client pinned "
                              "(gpusd-cert, gpusd 0.4: upgrade the client)")
            if scheme != "https" or not own or not isinstance(bound, str) or not bound.isascii() \
                    or not hmac.compare_digest(bound, own):
                return None, "the request was signed for a TLS connection to another certificate"
        node = self._node_id() if self._node_id is not None else None
        if '"gpusd-node"' in covered and covered['"gpusd-node"'] != node:
            return None, "the request was signed for another node"
        if method.upper() not in SAFE_METHODS and ('"gpusd-node"' not in covered or not node):
            return None, "a signed write must name this daemon's node id (gpusd-node, docs/security.md)"
        created = result.parameters.get("created") if isinstance(getattr(result, "parameters", None), dict) else None
        refused = self.nonces.add(str(result.nonce), created=_seconds(created))
        if refused is not None:
            return None, refused
        req.nonce = result.nonce
        # its ``base`` (what a user's SSH key signs) is made when read
        req.result = result
        return req, None

    def sign_response(self, req: Any, status: int, headers: Any, body: bytes | None) -> None:
        """Add the daemon's proof (docs/security.md) to the answer of a verified request ``req``."""
        assert self.key is not None
        resp = Response(status, req, Headers())
        node = (self._node_id() if self._node_id is not None else None) or "-"
        fp = self._cert_fp() if self._cert_fp is not None else None
        name = self._host_name() if self._host_name is not None else None
        name = name if isinstance(name, str) else None
        addresses = list(self._own()) if self._own is not None and name else []
        self.key.sign_response(resp, req.nonce, node, fp, body, host=name, addresses=addresses)
        for k, v in resp.headers.items():
            headers[k] = v

    def tls_on(self) -> bool:
        """Whether this daemon serves HTTPS: then private fields and writes never travel in clear
        to another machine (a signed reader on plain HTTP gets the public view and the proof)."""
        try:
            return bool(self._cert_fp is not None and self._cert_fp())
        except Exception:  # noqa: BLE001
            return False

    def write_refusal(self, verified: bool) -> tuple[int, str] | None:
        """(status, message) when a write must be refused, else None."""
        if self.key is None:
            return 405, "this daemon accepts no writes: start it with a fleet secret (--token-file) to allow them"
        if not verified:
            return 401, "a write needs a request signed with the fleet secret (docs/security.md)"
        return None


def can_see_private(request: web.Request) -> bool:
    """Whether the reader of this request may see process owners and commands (set by
    :func:`serve`; False when the access rules did not run)."""
    try:
        # (set on every request by serve: no KeyError then)
        return bool(request[_request_key()])
    except KeyError:
        return False


def is_signed(request: web.Request) -> bool:
    """Whether this request is a secret holder's: signed and verified, or on a TLS connection a
    verified request authenticated (set by :func:`serve`)."""
    return bool(request.get(_trusted_key(), False))


def signed_request(request: web.Request) -> Any:
    """The verified signed request (with its ``nonce`` and signature ``base``), or None."""
    return request.get(_signed_key())


def holder_of(request: web.Request) -> str:
    """Who holds what this (verified, signed) request takes, as far as the daemon can check it
    until user identities exist: the signature's key id and the peer address (:func:`peer_of`),
    e.g. ``gpusd-0123abcd... from 198.18.0.7``; never a name the request declares."""
    found = _KEYID.search(request.headers.get("Signature-Input", ""))
    return f"{found.group(1) if found else 'unsigned'} from {peer_of(request.remote)}"


Handler = Callable[["web.Request"], Awaitable["web.StreamResponse"]]


def _trusted_key() -> Any:
    """request[_trusted_key()]: True for a secret holder's request (is_signed)."""
    return _mark_key("gpusd.trusted")


def _signed_key() -> Any:
    """request[_signed_key()]: the verified signed request (for the answer's proof)."""
    return _mark_key("gpusd.signed", object)


def _refuse(status: int, message: str) -> web.Response:
    from aiohttp import web

    headers = {"Allow": "GET, HEAD, OPTIONS"} if status == 405 else (
        {"WWW-Authenticate": 'Signature realm="gpusd"'} if status == 401 else {})
    return web.json_response({"error": message}, status=status, headers=headers)


async def serve(gate: Any, handler: Handler, request: web.Request) -> web.StreamResponse:
    """Apply the access rules of ``gate`` (:class:`gpusd.daemon.routes.Gate`) to ``request``, then
    run ``handler`` if they let it in: every route of the daemon is registered as this function with
    its handler (:func:`gpusd.daemon.routes.add_routes`; no route is served without it, checked when
    the app starts).  Checks signed requests (401 for any bad or replayed one, whatever its bytes),
    refuses writes without a valid signature and from foreign pages, marks each request (see
    :func:`can_see_private`), and redacts JSON answers for readers without the right to see private
    fields.  An unsigned read costs three header lookups and the reader's place (local or not)."""
    access: Access | None = gate.access
    # never served unchecked
    if access is None:
        return _refuse(503, "this daemon's access rules are not installed")
    headers = request.headers
    method = request.method
    if "Signature" in headers or "Signature-Input" in headers or "Authorization" in headers \
            or method not in SAFE_METHODS:
        return await _serve_checked(access, handler, request)
    # an unsigned read: public, or private for a local reader naming this daemon, or for a TLS
    # connection a verified request authenticated
    transport = request.transport
    # the connection guard's record (None: no guard watches it)
    conn = _conn_of(transport)
    # (the same peer address)
    remote = conn.remote if conn is not None else request.remote
    if access.key is not None and request.secure and transport in access.sessions:
        private = trusted = True
        request[_trusted_key()] = True
    else:
        # (not trusted: is_signed's default)
        trusted = False
        # a local reader whose Host names us (request.host: the header, else the local address)
        private = access.local_reader(remote) and access.host_ok(headers.get("Host") or request.host, remote)
    # always set: a missing key costs can_see_private a KeyError
    request[_request_key()] = private
    if conn is None:
        response = await handler(request)
    else:
        # the guard decides (daemon/guard.py)
        if conn.probation or (trusted and not conn.signed):
            if not conn.guard._request_started(conn, trusted):  # noqa: SLF001 - the guard's own hook
                return _probation_refusal(conn)
        else:
            # what _request_started does for any other request: one more in progress
            conn.busy += 1
        try:
            response = await handler(request)
        finally:
            conn.busy -= 1
    return response if private else _public(access, response)


def _signed_for_this_listener(request: web.Request) -> bool:
    """Whether the port the request names (its ``Host``, which its signature's ``@authority`` covers) is
    the port of the listener that took it (a TLS connection's).  gpusd's clients always name the port."""
    parsed = split_host(request.host or "")
    transport = request.transport
    sockname = transport.get_extra_info("sockname") if transport is not None else None
    if parsed is None or parsed[1] is None or not isinstance(sockname, tuple) or len(sockname) < 2:
        # (no port: a signed authority drops a default one, so 80 and 443 would look alike)
        return False
    return bool(parsed[1] == sockname[1])


async def _serve_checked(access: Access, handler: Handler, request: web.Request) -> web.StreamResponse:
    """The access rules for a request that is signed, carries credentials, or writes."""
    from aiohttp import web

    headers = request.headers
    if "Authorization" in headers:
        return _refuse(401, "gpusd takes no bearer tokens (a secret must not travel): sign requests "
                            "with the fleet secret, see docs/security.md")
    verified = None
    if "Signature" in headers or "Signature-Input" in headers:
        body = b""
        if request.method not in SAFE_METHODS or request.content_length:
            try:
                body = await request.read()
            except web.HTTPException:
                raise
            except Exception:  # noqa: BLE001 - a broken body is a bad request, not a 500
                return _refuse(400, "unreadable request body")
        verified, why = access.verify(request.method, request.scheme, request.host, request.raw_path,
                                      headers, body, request.remote)
        if verified is None:
            if access.key is None:
                # no fleet secret here: an unsigned reader, as far as we know
                verified = None
            else:
                log.debug("refused a signed %s %s from %s: %s", request.method, request.path[:100],
                          request.remote, why)
                return _refuse(401, f"signature refused: {why}")
    session = False
    secure, remote = request.secure, request.remote
    if verified is not None and secure and not _signed_for_this_listener(request):
        # a request signed for the plain HTTP port, taken off the wire (the clear text a client falls
        # back to, or a man in the middle's) and replayed over TLS, would be served private fields
        # there, and its connection made a session
        return _refuse(401, "signature refused: signed for another of this daemon's ports")
    if verified is not None and secure and request.transport is not None:
        access.sessions.add(request.transport)
    elif verified is None and secure and request.transport in access.sessions:
        # writes are signed one by one
        session = request.method in SAFE_METHODS
    local = access.local_reader(remote)
    # With TLS on, private fields and writes go to other machines over HTTPS only.
    in_clear = verified is not None and not secure and not local and access.tls_on()
    if request.method not in SAFE_METHODS:
        if not access.origin_ok(headers.get("Origin"), remote):
            return _refuse(403, "writes are not accepted from another site's page")
        refused = access.write_refusal(verified is not None)
        if refused is not None:
            return _refuse(*refused)
        if in_clear:
            return _refuse(403, "writes to this daemon go over HTTPS (its announced tls port)")
    private = (verified is not None and not in_clear) or session or (
        local and access.host_ok(request.host, remote))
    request[_request_key()] = private
    request[_trusted_key()] = verified is not None or session
    if verified is not None:
        request[_signed_key()] = verified
    # the connection guard keeps a secret holder's connection when it needs room (daemon/guard.py)
    conn = _conn_of(request.transport)
    if conn is not None and not conn.guard._request_started(conn, verified is not None or session):  # noqa: SLF001
        return _probation_refusal(conn)
    try:
        response = await handler(request)
    finally:
        if conn is not None:
            conn.busy -= 1
    return response if private else _public(access, response)


def _unwatched(transport: Any) -> Any:
    return None


# The connection guard's record of a transport (None: no guard watches it): gpusd.daemon.guard's lookup
# once a guard exists (it calls watched_by; this module is below it and imports nothing of it).
_conn_of: Callable[[Any], Any] = _unwatched


def watched_by(lookup: Callable[[Any], Any]) -> None:
    """The connection guard's lookup of a connection's record, ``lookup(transport)`` (None: none)."""
    global _conn_of
    _conn_of = lookup


def _probation_refusal(conn: Any) -> web.StreamResponse:
    conn.busy -= 1
    refusal = _refuse(503, "this daemon holds as many connections as it serves; this one was let in for "
                           "a signed request only (docs/daemon.md, limits): try again later")
    refusal.headers["Retry-After"] = "5"
    refusal.force_close()
    return refusal


def _public(access: Access, response: web.StreamResponse) -> web.StreamResponse:
    """``response`` for a reader who may not see private fields: a JSON answer carrying any is
    redacted (a body found clean is remembered by identity: the daemon serves one body per sample
    and level, daemon/http.py, so each is scanned once, not once per request)."""
    from aiohttp import web

    if not isinstance(response, web.Response) or response.content_type != "application/json":
        return response
    answer = response.body
    clean = access.clean
    if type(answer) is bytes and clean.get(id(answer)) is answer:
        return response
    if isinstance(answer, (bytes, bytearray)) and needs_redaction(bytes(answer)):
        try:
            response.body = redact_json(bytes(answer))
        except ValueError:
            # not JSON after all: hold it back rather than leak it
            return web.json_response({"error": "answer withheld"}, status=500)
    elif type(answer) is bytes and len(answer) > 512:
        # worth remembering (a small one scans fast)
        if len(clean) >= 16:
            clean.pop(next(iter(clean)))
        # held: its id cannot be reused while it is here
        clean[id(answer)] = answer
    return response


def install_proofs(app: web.Application, access: Access) -> None:
    """Sign the answers to verified requests (the daemon's proof that it holds the fleet secret):
    headers are added just before an answer (or an event stream) is sent.  Without a fleet secret
    nothing is ever verified: no hook (one coroutine less per answer)."""
    if access.key is None:
        return

    async def prove(request: web.Request, response: web.StreamResponse) -> None:
        req = request.get(_signed_key())
        if req is None or access.key is None:
            return
        from aiohttp import web

        body: bytes | None = None
        if isinstance(response, web.Response) and isinstance(response.body, (bytes, bytearray)):
            body = bytes(response.body)
        elif isinstance(response, web.Response) and response.body is None:
            body = b""
        try:
            access.sign_response(req, response.status, response.headers, body)
        except Exception:
            log.exception("cannot sign an answer")

    app.on_response_prepare.append(prove)
