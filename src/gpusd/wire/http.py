"""One blocking HTTP GET for the command line (``gpusd top --url``, ``gpusd status``, ``export``):
JSON of at most 4 MiB, signed with the fleet secret when there is one, the daemon's proof checked.

Plain ``http.client``: no aiohttp at CLI start-up.  ``https://`` URLs are accepted with the daemon's
self-signed certificate; what makes such an answer trustworthy is the daemon's signed proof, which
names that certificate's fingerprint (docs/security.md), or ``pin`` (an announced fingerprint).
"""

# Imports inside functions: start-up (gpusd list imports this module); start-up (gpusd top imports this module).
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Callable
from urllib.parse import urlsplit

from ..errors import ConfigError

# re-exported: defined in gpusd.errors
from ..errors import SourceError as SourceError
from ..model import redact
from ..sanitize import printable

if TYPE_CHECKING:  # pragma: no cover
    from .signing import FleetKey

# bytes, as docs/wire-format.md says for HTTP answers
MAX_ANSWER = 4 * 2**20


class Answer:
    """A checked answer: its JSON, and whether the daemon proved it holds the fleet secret.  (Plain
    classes here, not dataclasses: ``gpusd list`` imports this module, each dataclass costs ~0.5 ms.)"""

    __slots__ = ("data", "node_id", "verified")

    def __init__(self, data: Any, verified: bool | None, node_id: str | None = None) -> None:
        self.data = data
        # None: no fleet secret here, nothing to check; True: the daemon proved it holds the secret
        # (for this request, on this connection); False: it did not -- private fields were removed.
        self.verified = verified
        # the node id the proof names (when verified)
        self.node_id = node_id


class _Exchange:
    """One request and its raw answer (:func:`_exchange`)."""

    __slots__ = ("body", "cert_fp", "headers", "nonce", "reason", "sent", "status")

    def __init__(self, status: int, reason: str, body: bytes, sent: Any, headers: list[tuple[str, str]],
                 nonce: str | None, cert_fp: str | None) -> None:
        self.status = status
        self.reason = reason
        # at most max_bytes + 1 bytes: longer means too long
        self.body = body
        # the request as signed (gpusd.wire.signing.Request), for checking the proof; None: unsigned
        self.sent = sent
        self.headers = headers
        # the signature's nonce (None: unsigned)
        self.nonce = nonce
        # the TLS certificate's fingerprint (https only)
        self.cert_fp = cert_fp


def _exchange(method: str, url: str, payload: bytes | None, key: FleetKey | None, timeout: float,
              node_id: str | None, pin: str | None, user: Any = None, max_bytes: int = MAX_ANSWER,
              sent: Callable[[], None] | None = None) -> _Exchange:
    """Send one request (signed with ``key``; over TLS for ``https://``, the certificate checked
    against ``pin``) and read at most ``max_bytes + 1`` bytes of its answer (``sent`` is called once the
    request is on its way, the connection made).  :class:`SourceError` when the daemon cannot be
    reached, does not speak HTTP, or shows another certificate."""
    import http.client

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SourceError(f"not a daemon URL: {url!r}")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise SourceError(f"bad port in {url!r}") from None
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    absolute = f"{parts.scheme}://{parts.netloc}{target}"
    headers = {"Accept": "application/json", "Host": parts.netloc}
    if payload is not None:
        headers["Content-Type"] = "application/json"
    nonce = None
    if key is not None and method.upper() not in ("GET", "HEAD") and not node_id:
        # a daemon refuses a signed write that does not name it (docs/security.md): say so here
        raise SourceError(f"{url}: a signed {method.upper()} must name the daemon's node id")
    signer = user
    if key is not None and signer is None and method.upper() not in ("GET", "HEAD"):
        # a write: the user signs it too (security.md)
        from .sshsig import SshSigError, default_signer

        try:
            signer = default_signer()
        except SshSigError as exc:
            raise ConfigError(f"cannot sign with your SSH key: {exc}") from None
    conn: http.client.HTTPConnection
    if parts.scheme == "https":
        # a self-signed certificate: pinned here, proven by the signature
        conn = http.client.HTTPSConnection(parts.hostname, port, timeout=timeout, context=_pinning_context())
    else:
        conn = http.client.HTTPConnection(parts.hostname, port, timeout=timeout)
    cert_fp: str | None = None
    try:
        # the certificate is checked before a byte of the request goes out: a
        if parts.scheme == "https":
            # signed request shown to another certificate could be replayed to the daemon by it
            import ssl

            from .signing import fingerprint

            conn.connect()
            sock = conn.sock
            der = sock.getpeercert(binary_form=True) if isinstance(sock, ssl.SSLSocket) else None
            cert_fp = fingerprint(der) if der else None
            if pin is not None and cert_fp != pin:
                raise SourceError(f"{url}: the daemon's certificate is not the one announced (pinned)")
        # signed once the certificate is known: over TLS the signature covers it
        if key is not None:
            signed, nonce = key.sign_request(method, absolute, body=payload or b"", node_id=node_id, user=signer,
                                             cert_fp=cert_fp)
            headers.update(signed)
        conn.request(method, target, body=payload, headers=headers)
        if sent is not None:
            sent()
        resp = conn.getresponse()
        body = resp.read(max_bytes + 1)
        status, reason, resp_headers = resp.status, resp.reason, resp.getheaders()
    except SourceError:
        raise
    except (TimeoutError, OSError) as exc:
        raise SourceError(f"cannot reach {url}: {getattr(exc, 'strerror', None) or exc}") from None
    except http.client.HTTPException as exc:
        # not HTTP (BadStatusLine), or the daemon died mid-answer
        raise SourceError(f"{url}: broken HTTP answer ({exc.__class__.__name__})") from None
    finally:
        conn.close()
    if len(body) > max_bytes:
        raise SourceError(f"{url}: answer larger than {max_bytes} bytes")
    as_signed = None
    # signed: the request as signed, to check the answer's proof against
    if nonce is not None:
        from .signing import Headers, Request

        as_signed = Request(method, absolute, Headers(headers))
    return _Exchange(status, reason, body, as_signed, resp_headers, nonce, cert_fp)


def _proven(x: _Exchange, key: FleetKey, node_id: str | None) -> tuple[bool, str | None]:
    """Whether the answer carries the daemon's proof for this request; the node id it names."""
    from .signing import NODE_HEADER, Headers, Response

    answer = Response(x.status, x.sent, Headers(x.headers))
    assert x.nonce is not None
    ok = key.verify_response(answer, x.nonce, node_id=node_id, cert_fp=x.cert_fp, body=x.body)
    return ok, answer.headers.find(NODE_HEADER) if ok else None


def fetch_json(url: str, key: FleetKey | None = None, timeout: float = 5.0, node_id: str | None = None,
               pin: str | None = None, max_bytes: int = MAX_ANSWER) -> Answer:
    """GET ``url`` (``http://`` or ``https://``) and parse its JSON (at most ``max_bytes``: 4 MiB unless
    the caller knows a larger bound, as for a fleet view); :class:`SourceError` with a one-line reason
    otherwise.  With ``key`` the request is signed and the answer's proof checked
    (``node_id``: the node meant; ``pin``: the certificate fingerprint expected over TLS); an
    answer without a valid proof is returned with its private fields nulled and ``verified`` False."""
    return fetch(url, key, timeout, node_id, pin, max_bytes).answer()


class Fetched:
    """An answer of status 200 as received (:func:`fetch`): :meth:`answer` parses and checks it, in
    whichever thread takes it (10 MB of a fleet view take ~0.1 s to parse)."""

    __slots__ = ("_exchange", "_key", "_node_id", "url")

    def __init__(self, url: str, exchange: _Exchange, key: FleetKey | None, node_id: str | None) -> None:
        self.url = url
        self._exchange = exchange
        self._key = key
        self._node_id = node_id

    def answer(self) -> Answer:
        """The JSON and the proof's verdict, as :func:`fetch_json` returns them; :class:`SourceError`
        for an answer that is not JSON."""
        x, key = self._exchange, self._key
        try:
            data = json.loads(x.body)
        except ValueError:
            raise SourceError(f"{self.url}: answer is not JSON") from None
        if key is None or x.nonce is None:
            return Answer(data, None)
        ok, node = _proven(x, key, self._node_id)
        if ok:
            return Answer(data, True, node)

        return Answer(redact(data), False)


def fetch(url: str, key: FleetKey | None = None, timeout: float = 5.0, node_id: str | None = None,
          pin: str | None = None, max_bytes: int = MAX_ANSWER, sent: Callable[[], None] | None = None) -> Fetched:
    """:func:`fetch_json`'s request and its answer's bytes, not parsed yet (:meth:`Fetched.answer`);
    ``sent`` is called once the request is on its way."""
    x = _exchange("GET", url, None, key, timeout, node_id, pin, max_bytes=max_bytes, sent=sent)
    if x.status != 200:
        raise SourceError(f"{url}: HTTP {x.status} {x.reason}" + _error_text(x.body))
    return Fetched(url, x, key, node_id)


def _error_text(body: bytes) -> str:
    """``: <error>`` from a gpusd JSON error answer (bounded, printable), else nothing."""
    try:
        err = json.loads(body[:4096]).get("error")
    except (ValueError, AttributeError):
        return ""
    if not isinstance(err, str):
        return ""
    return ": " + printable(err, 200, replace="")


class Reply:
    """The answer to :func:`request_json`: HTTP status, parsed JSON (``{}`` when none), and whether
    the daemon proved it holds the fleet secret (as :attr:`Answer.verified`)."""

    __slots__ = ("data", "status", "verified")

    def __init__(self, status: int, data: Any, verified: bool | None) -> None:
        self.status = status
        self.data = data
        self.verified = verified


_CONTEXT: Any = None


def _pinning_context() -> Any:
    """One TLS client context for pinned daemons, made once: no CA store to load (a self-signed
    certificate is checked against the announced fingerprint instead), which is most of the cost of
    ``ssl.create_default_context()`` (~20 ms)."""
    global _CONTEXT
    if _CONTEXT is None:
        import ssl

        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.check_hostname = False
        # self-signed: pinned by the caller, proven by the signature
        ctx.verify_mode = ssl.CERT_NONE
        _CONTEXT = ctx
    return _CONTEXT


def request_json(method: str, url: str, body: Any = None, key: FleetKey | None = None, timeout: float = 5.0,
                 node_id: str | None = None, pin: str | None = None, user: Any = None) -> Reply:
    """One signed request with a JSON body (``POST``/``DELETE`` to a daemon: docs/pool.md); the
    status is returned, not raised (a 409 is an answer).  :class:`SourceError` when the daemon cannot
    be reached, the certificate is not ``pin``, or the answer is not JSON.  A write is also signed with
    the user's SSH key (``user``, a :mod:`gpusd.wire.sshsig` signer; default: ``--identity`` or the
    agent's first key, none when there is neither)."""
    payload = json.dumps(body, allow_nan=False).encode() if body is not None else None
    x = _exchange(method, url, payload, key, timeout, node_id, pin, user)
    try:
        data = json.loads(x.body) if x.body.strip() else {}
    except ValueError:
        raise SourceError(f"{url}: HTTP {x.status}, and the answer is not JSON") from None
    if key is None or x.nonce is None:
        return Reply(x.status, data, None)
    return Reply(x.status, data, _proven(x, key, node_id)[0])
