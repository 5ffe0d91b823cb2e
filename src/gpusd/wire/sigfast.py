"""A fast path for gpusd's own signature shapes (RFC 9421), beside the library that stays the reference.

gpusd signs every request and every answer with one shape (:mod:`gpusd.wire.signing`): the label
``gpusd``, a fixed list of covered components in a fixed order, and the parameters ``created``,
``keyid``, ``alg``, ``nonce``, ``tag`` in that order.  The library (``http-message-signatures``)
parses and serialises these headers as generic Structured Fields, which costs ~0.15 ms a message
around an HMAC of a few µs.  Here the same headers are built and read by exact patterns, and the
same RFC 9421 signature base is computed from the same component values (the library's own URL
parser and header normalisation), with the same checks on those values.

The rule that keeps it safe: this path only ever *accepts* or *produces*.  A header that does not
match gpusd's exact shape, a value the library would refuse, a MAC or digest that does not match,
a ``created`` outside the window -- anything but a clean accept -- returns None, and the caller
runs the library path as before (so what is refused, and why, is the library's answer).  The
differential tests (tests/wire/test_sigfast.py) check that what this path accepts the library
accepts with the same result, and that the headers it writes verify with the library.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import re
import time
from collections import OrderedDict
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

_KEYID = r"[A-Za-z0-9-]{1,64}"
_NONCE = r"[A-Za-z0-9_-]{1,64}"
# no leading zeros: the header text is then the serialised value
_CREATED = r"0|[1-9][0-9]{0,14}"
# the optional covered request fields, in the order the shape lists them (gpusd 0.4 added the last two:
# the account a user signature acts as, and over TLS the certificate the client pinned)
_REQ_OPTIONAL = ("gpusd-node", "gpusd-user", "gpusd-cert")
_REQ_INPUT = re.compile(
    r'gpusd=(\((?P<list>"@method" "@authority" "@path" "@query"(?: "gpusd-node")?(?: "gpusd-user")?'
    r'(?: "gpusd-cert")? "content-digest")\)'
    rf';created=(?P<created>{_CREATED});keyid="(?P<keyid>{_KEYID})";alg="hmac-sha256"'
    rf';nonce="(?P<nonce>{_NONCE})";tag="gpusd-request")')
_RESP_INPUT = re.compile(
    r'gpusd=(\((?P<list>"@status" "@authority";req "@path";req "gpusd-node"'
    r'(?: "gpusd-cert")?(?: "gpusd-host"(?: "gpusd-addrs")?)?(?: "content-digest")?)\)'
    rf';created=(?P<created>{_CREATED});keyid="(?P<keyid>{_KEYID})";alg="hmac-sha256"'
    rf';nonce="(?P<nonce>{_NONCE})";tag="gpusd-response")')
_KEYID_RE = re.compile(_KEYID)
_NONCE_RE = re.compile(_NONCE)
# the only header fields gpusd's shapes read (every other field is left alone, as the library leaves it)
_FIELDS = frozenset({"signature-input", "signature", "content-digest", "gpusd-node", "gpusd-cert", "gpusd-host",
                     "gpusd-addrs", "gpusd-user"})


# the library's URL parser and header normalisation (private names the fast path reuses)
try:
    from http_message_signatures._url import parse_url
    from http_message_signatures.algorithms import HMAC_SHA256
    from http_message_signatures.structures import VerifyResult, normalize_header_value
except ImportError:
    # an upgrade moved them: every call takes the library's public path (slower, never wrong)
    _LIBRARY_OK = False
else:
    _LIBRARY_OK = True


def _fields(headers: Any) -> dict[str, str]:
    """The values of the fields gpusd's shapes read (:data:`_FIELDS`) by lower-case name, as the
    library combines and normalises them (the other fields are not looked at)."""
    lines: dict[str, list[str]] = {}
    for name, value in headers.items():
        low = name.lower()
        if low in _FIELDS:
            lines.setdefault(low, []).append(normalize_header_value(value))
    return {k: ", ".join(v) for k, v in lines.items()}


# one URL per daemon and path: parsed once (the parse is pure)
@functools.lru_cache(maxsize=512)
def _url_components(url: str) -> tuple[str, str, str] | None:
    """``@authority``, ``@path``, ``@query`` of an absolute URL, as the library resolves them."""
    try:
        parts = parse_url(url)
    except Exception:  # noqa: BLE001 - the library path will say why
        return None
    host, port = parts.host.lower(), parts.port
    if port and port.lstrip("0") == {"http": "80", "https": "443"}.get(parts.scheme.lower()):
        port = None
    return (f"{host}:{port}" if port else host), (parts.path or "/"), "?" + (parts.query or "")


def _derived_ok(value: str) -> bool:
    return not value or (value.isprintable() and not value.startswith(" ") and not value.endswith(" "))


def _field_ok(value: str) -> bool:
    return "\r" not in value and "\n" not in value and (not value or value.replace("\t", " ").isprintable())


def _digest(body: bytes) -> str:
    if not body:
        return _EMPTY_DIGEST
    return f"sha-256=:{base64.b64encode(hashlib.sha256(body).digest()).decode()}:"


_EMPTY_DIGEST = f"sha-256=:{base64.b64encode(hashlib.sha256(b'').digest()).decode()}:"
# id(body) -> (body, its digest): answers served many times
_DIGESTS: dict[int, tuple[bytes, str]] = {}


def _digest_of(body: bytes) -> str:
    """``_digest(body)``, remembered for the last few large bodies by identity (the daemon answers
    with one bytes object per sample, daemon/http.py; an entry holds its body, so its id cannot be
    reused while it is here)."""
    if type(body) is not bytes or len(body) < 1024:
        return _digest(body)
    hit = _DIGESTS.get(id(body))
    if hit is not None and hit[0] is body:
        return hit[1]
    digest = _digest(body)
    if len(_DIGESTS) >= 8:
        del _DIGESTS[next(iter(_DIGESTS))]
    _DIGESTS[id(body)] = (body, digest)
    return digest


# the keys of one or two fleets
@functools.lru_cache(maxsize=8)
def _keyed(key: bytes) -> Any:
    """An HMAC-SHA256 object keyed with ``key``, before any data: copied for each message (OpenSSL 3
    looks the algorithm up again for every new HMAC, a few µs; a copy does not)."""
    return hmac.new(key, digestmod=hashlib.sha256)


def _mac(key: bytes, data: bytes) -> bytes:
    h = _keyed(key).copy()
    h.update(data)
    return h.digest()  # type: ignore[no-any-return]


def _digest_ok(value: str, body: bytes) -> bool:
    # equal to the text of the right digest: ``sha-256=:<43 base64 characters>=:``, canonical base64 of
    # the same bytes (any other text, e.g. a non-canonical encoding, is for the library to judge)
    return value.isascii() and hmac.compare_digest(value, _digest(body))


def _mac_ok(key: bytes, base: bytes, signature: str) -> bool:
    # equal to the text of the right MAC: ``gpusd=:<43 base64 characters>=:``, canonical, the same bytes
    mac = _mac(key, base)
    return signature.isascii() and hmac.compare_digest(signature, f"gpusd=:{base64.b64encode(mac).decode()}:")


def _created_ok(created: int, skew: float, now: float | None = None) -> bool:
    now = time.time() if now is None else now
    # the library's checks with max_age 0: not in the future beyond the skew, not older than it
    return now - skew <= created <= now + skew


def _result(elements: Sequence[tuple[str, str]], params: str, m: re.Match[str], body: bytes | None) -> Any:
    covered: OrderedDict[str, str] = OrderedDict(elements)
    covered['"@signature-params"'] = params
    tag = "gpusd-response" if params.endswith('tag="gpusd-response"') else "gpusd-request"
    parameters = {"created": int(m["created"]), "keyid": m["keyid"], "alg": "hmac-sha256",
                  "nonce": m["nonce"], "tag": tag}
    return VerifyResult(label="gpusd", algorithm=HMAC_SHA256, covered_components=covered,
                        parameters=parameters, body=body, nonce=m["nonce"])


# -- requests ------------------------------------------------------------------------------------
def sign_request(key: bytes, key_id: str, method: str, url: str, node_id: str | None, body: bytes,
                 nonce: str, created: int, account: str | None = None,
                 cert_fp: str | None = None) -> tuple[dict[str, str], bytes] | None:
    """The headers gpusd's request signature adds (as the library writes them) and the signature
    base, or None (the caller signs with the library).  ``account``, ``cert_fp``: the covered
    ``gpusd-user`` and ``gpusd-cert`` fields (docs/security.md), when given."""
    if not _LIBRARY_OK:
        return None
    if not _KEYID_RE.fullmatch(key_id) or not _NONCE_RE.fullmatch(nonce):
        return None
    extra = tuple((n, v) for n, v in zip(_REQ_OPTIONAL, (node_id or None, account or None, cert_fp or None))
                  if v is not None)
    head = _request_head(method, url, extra)
    if head is None:
        return None
    ids, prefix = head
    digest = _digest(body)
    params = f'({ids});created={created};keyid="{key_id}";alg="hmac-sha256";nonce="{nonce}";tag="gpusd-request"'
    base = f'{prefix}"content-digest": {digest}\n"@signature-params": {params}'.encode()  # ASCII: see the head
    mac = _mac(key, base)
    headers: dict[str, str] = {_HEADER_NAMES[n]: v for n, v in extra}
    headers["Content-Digest"] = digest
    headers["Signature-Input"] = f"gpusd={params}"
    headers["Signature"] = f"gpusd=:{base64.b64encode(mac).decode()}:"
    return headers, base


_HEADER_NAMES = {"gpusd-node": "Gpusd-Node", "gpusd-user": "Gpusd-User", "gpusd-cert": "Gpusd-Cert"}


# a client signs few method, URL and node combinations
@functools.lru_cache(maxsize=256)
def _request_head(method: str, url: str, extra: tuple[tuple[str, str], ...]) -> tuple[str, str] | None:
    """The covered component ids of gpusd's request signature for these values (``extra``: the
    covered ``gpusd-*`` fields, in the shape's order) and the signature base's lines before
    ``content-digest``; None when the library must sign (a value it refuses)."""
    comps = _url_components(url)
    if comps is None or method != method.upper() or not method.isprintable() or not method:
        return None
    elements = [('"@method"', method), ('"@authority"', comps[0]), ('"@path"', comps[1]), ('"@query"', comps[2])]
    if not all(_derived_ok(v) for _, v in elements):
        return None
    for name, value in extra:
        if value != value.strip(" \t") or not _field_ok(value):
            return None
        elements.append((f'"{name}"', value))
    ids = " ".join([k for k, _ in elements] + ['"content-digest"'])
    prefix = "".join(f"{k}: {v}\n" for k, v in elements)
    # (the rest of the base is ASCII by its shape)
    return (ids, prefix) if prefix.isascii() else None


def _signed_input(shape: re.Pattern[str], key_id: str, headers: Any, skew: float, now: float | None
                  ) -> tuple[dict[str, str], re.Match[str]] | None:
    """The fields and the ``Signature-Input`` match of a message signed by ``key_id`` in gpusd's
    ``shape`` (a request's or a response's) and created within ``skew``; None otherwise (the caller
    asks the library)."""
    if not _LIBRARY_OK:
        return None
    f = _fields(headers)
    m = shape.fullmatch(f.get("signature-input", ""))
    if m is None or m["keyid"] != key_id or "signature" not in f:
        return None
    if not _created_ok(int(m["created"]), skew, now):
        return None
    return f, m


def verify_request(key: bytes, key_id: str, method: str, url: str, headers: Any, body: bytes,
                   skew: float, now: float | None = None) -> Any:
    """The library's VerifyResult for a request carrying gpusd's exact signature shape that the
    library would accept, or None (anything else: the caller asks the library)."""
    signed = _signed_input(_REQ_INPUT, key_id, headers, skew, now)
    if signed is None:
        return None
    f, m = signed
    ids = m["list"]
    head = _verify_head(method, url, ids, tuple(f.get(n) for n in _REQ_OPTIONAL if f'"{n}"' in ids))
    digest = f.get("content-digest")
    # (a right digest is a field value)
    if head is None or digest is None or not _digest_ok(digest, body):
        return None
    params = m.group(1)
    elements, prefix = head
    base = f'{prefix}"content-digest": {digest}\n"@signature-params": {params}'.encode()  # ASCII by shape
    if not _mac_ok(key, base, f["signature"]):
        return None
    return _result((*elements, ('"content-digest"', digest)), params, m, body)


# one daemon's few paths (bounded: any peer can send such headers)
@functools.lru_cache(maxsize=128)
def _verify_head(method: str, url: str, ids: str, fields: tuple[str | None, ...]
                 ) -> tuple[tuple[tuple[str, str], ...], str] | None:
    """The covered components of a request signature with the component list ``ids`` (a match of
    :data:`_REQ_INPUT`) before ``content-digest``, and the signature base's lines for them
    (``fields``: the values of the covered ``gpusd-*`` fields, in order); None when a value is one
    the library refuses (or a covered field is missing)."""
    comps = _url_components(url)
    if comps is None or method != method.upper() or not method:
        return None
    elements: list[tuple[str, str]] = []
    for cid, v in zip(('"@method"', '"@authority"', '"@path"', '"@query"'), (method, *comps)):
        if "\r" in v or "\n" in v or not _derived_ok(v):
            return None
        elements.append((cid, v))
    # the covered gpusd-* fields (the last is content-digest, checked apart)
    names = ids.split(" ")[4:-1]
    if len(names) != len(fields):
        return None
    for cid, value in zip(names, fields):
        if value is None or not _field_ok(value):
            return None
        elements.append((cid, value))
    prefix = "".join(f"{k}: {v}\n" for k, v in elements)
    return (tuple(elements), prefix) if prefix.isascii() else None


# -- responses -----------------------------------------------------------------------------------
def sign_response(key: bytes, key_id: str, status: int, req_url: str, headers: MutableMapping[str, str],
                  covered: Sequence[str], nonce: str, created: int, body: bytes | None) -> bool:
    """Write gpusd's response signature into ``headers`` (which hold the covered ``gpusd-*``
    fields already); False (nothing written) when the library must do it."""
    if not _LIBRARY_OK:
        return False
    # (the shape of ``created``: _CREATED)
    if not _KEYID_RE.fullmatch(key_id) or not _NONCE_RE.fullmatch(nonce) or type(created) is not int \
            or not 0 <= created < 10**15:
        return False
    f = _fields(headers)
    if "content-digest" in f:
        return False
    names = tuple(covered[3:])
    head = _response_head(status, req_url, names, tuple(f.get(name) for name in names), body is not None)
    if head is None:
        return False
    ids, prefix = head
    digest = None
    if body is not None:
        digest = _digest_of(body)
        prefix = f'{prefix}"content-digest": {digest}\n'
    params = f'({ids});created={created};keyid="{key_id}";alg="hmac-sha256";nonce="{nonce}";tag="gpusd-response"'
    # ASCII: the head is, and the values matched
    base = f'{prefix}"@signature-params": {params}'.encode()
    mac = _mac(key, base)
    if digest is not None:
        headers["Content-Digest"] = digest
    headers["Signature-Input"] = f"gpusd={params}"
    headers["Signature"] = f"gpusd=:{base64.b64encode(mac).decode()}:"
    return True


# a daemon signs few shapes (per path, status and its own identity)
@functools.lru_cache(maxsize=64)
def _response_head(status: int, req_url: str, names: tuple[str, ...], values: tuple[str | None, ...],
                   digest: bool) -> tuple[str, str] | None:
    """What a response signature of this shape has before its digest, ``created`` and ``nonce``:
    the covered component ids (as ``@signature-params`` lists them) and the signature base's first
    lines; None when the library must sign (a value it would refuse, a shape not gpusd's)."""
    comps = _url_components(req_url)
    if comps is None:
        return None
    elements = [('"@status"', str(status)), ('"@authority";req', comps[0]), ('"@path";req', comps[1])]
    if not all(_derived_ok(v) for _, v in elements):
        return None
    for name, v in zip(names, values):
        if v is None or not _field_ok(v):
            return None
        elements.append((f'"{name}"', v))
    ids = " ".join([k for k, _ in elements] + (['"content-digest"'] if digest else []))
    # the whole parameters' shape, with values of the shape the caller's are (checked there)
    if _RESP_INPUT.fullmatch(f'gpusd=({ids});created=0;keyid="k";alg="hmac-sha256";nonce="n";'
                             'tag="gpusd-response"') is None:
        return None
    prefix = "".join(f"{k}: {v}\n" for k, v in elements)
    return (ids, prefix) if prefix.isascii() else None


def verify_response(key: bytes, key_id: str, status: int, req_method: str, req_url: str, headers: Mapping[str, str],
                    body: bytes | None, skew: float, now: float | None = None) -> Any:
    """The library's VerifyResult for an answer carrying gpusd's exact response shape that the
    library would accept (with ``body`` checked as the library's ``verify(body=...)`` does), or None."""
    signed = _signed_input(_RESP_INPUT, key_id, headers, skew, now)
    if signed is None:
        return None
    f, m = signed
    ids = m["list"]
    # (the shape allows it last only)
    digest_covered = ids.endswith('"content-digest"')
    names = ids.split(" ")[3:-1] if digest_covered else ids.split(" ")[3:]
    head = _proof_head(status, req_method, req_url, tuple(f.get(cid[1:-1]) for cid in names), ids)
    if head is None:
        return None
    elements, prefix = head
    checked: bytes | None = None
    if digest_covered:
        digest = f.get("content-digest")
        if digest is None or not _field_ok(digest):
            return None
        if body is not None:
            if not _digest_ok(digest, body):
                return None
            checked = body
        elements = (*elements, ('"content-digest"', digest))
        prefix = f'{prefix}"content-digest": {digest}\n'
    elif body is not None and (body or "content-digest" in f):
        return None
    params = m.group(1)
    text = f'{prefix}"@signature-params": {params}'
    if not text.isascii() or not _mac_ok(key, text.encode(), f["signature"]):
        return None
    return _result(elements, params, m, checked)


# the proofs of a few daemons, each the same about itself
@functools.lru_cache(maxsize=128)
def _proof_head(status: int, req_method: str, req_url: str, values: tuple[str | None, ...], ids: str
                ) -> tuple[tuple[tuple[str, str], ...], str] | None:
    """The covered components of a response signature with the component list ``ids`` before its
    ``content-digest`` (``values``: the covered ``gpusd-*`` fields, in order), and the signature
    base's lines for them; None when a value is missing or one the library refuses."""
    comps = _url_components(req_url)
    if comps is None or req_method != req_method.upper() or not req_method:
        return None
    elements = [('"@status"', str(status)), ('"@authority";req', comps[0]), ('"@path";req', comps[1])]
    if not all(_derived_ok(v) for _, v in elements):
        return None
    for cid, got in zip(ids.split(" ")[3:], values):
        if got is None or not _field_ok(got):
            return None
        elements.append((cid, got))
    return tuple(elements), "".join(f"{k}: {v}\n" for k, v in elements)
