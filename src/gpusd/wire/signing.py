"""Fleet trust on the wire: HTTP Message Signatures (RFC 9421) with a key derived from the fleet secret.

No secret ever travels.  Every daemon and client of a fleet holds the same secret (``--token-file``
or ``$GPUSD_TOKEN``, see :func:`load_secret`); from it HKDF-SHA256 derives two HMAC-SHA256 keys, one
that signs requests and one that signs responses, and a public key id.  See docs/security.md.

* A client signs a request (:meth:`FleetKey.sign_request`): ``@method``, ``@authority``, ``@path``,
  ``@query``, ``content-digest`` (RFC 9530, SHA-256 of the body, also for an empty body) and, when
  the client knows which daemon it means, the ``gpusd-node`` header (the target's node id: a daemon
  refuses a write without it, so every write names it); with a user's SSH signature, the
  ``gpusd-user`` header (the account the user acts as: the daemon checks that account's keys only);
  over TLS, the ``gpusd-cert`` header (the fingerprint of the certificate the client pinned and saw:
  the daemon refuses one that is not its own, so a relay cannot replay the request on its own TLS
  connection); with the ``created`` and ``nonce`` parameters and the tag ``gpusd-request``.
* A daemon verifies it (:meth:`FleetKey.verify_request`, applied by :mod:`gpusd.daemon.access`): a
  known key id, a valid HMAC, ``created`` within :data:`MAX_SKEW` seconds of its clock either way, a
  nonce it has not seen (a bounded cache; a ``created`` no later than that of a nonce it forgot is
  refused, so a wall-clock step back cannot make a forgotten request valid again), an
  ``@authority`` naming the daemon itself (``localhost`` only from its loopback) and, when covered,
  its own node id (covered at all, on a write).
* The daemon answers a signed request with a signed response (:meth:`FleetKey.sign_response`):
  ``@status``, its node id (``gpusd-node``), its TLS certificate's fingerprint (``gpusd-cert``,
  when it serves TLS), its host name and the addresses it serves (``gpusd-host``, ``gpusd-addrs``:
  gpusd 0.3), the request's ``@authority`` and ``@path``, and the body's ``content-digest`` when
  the answer is not a stream; the response signature's ``nonce`` is the request's nonce.  A client
  that checks it (:meth:`FleetKey.verify_response`, :meth:`FleetKey.response_proof`) knows the
  answer came from a holder of the secret, for this request, from the node it meant, and which
  host name and addresses that node claims for itself (:class:`Proof`): the only name and
  addresses a client acts on (docs/security.md, "What a client believes, and from whom").

Nothing here does I/O; :mod:`gpusd.wire.http` applies it to urllib requests and aiohttp clients,
:mod:`gpusd.daemon.access` to the daemon's requests.
"""

# Imports inside functions: optional or heavy packages; memory at rest (loaded on request).
from __future__ import annotations

import base64
import collections
import datetime
import functools
import hashlib
import hmac
import ipaddress
import os
import secrets
import stat
import time
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import quote, unquote

from cryptography.hazmat.primitives import hashes
from http_message_signatures import HTTPMessageSigner, HTTPMessageVerifier, InvalidSignature, algorithms

from ..errors import SecretError
from ..sanitize import ip_word
from . import sigfast

# seconds a signature's "created" may differ from the verifier's clock (either way)
MAX_SKEW = 30.0
# nonces remembered; only verified requests enter the cache
NONCE_CACHE_MAX = 200_000
MIN_SECRET = 16  # bytes
MAX_SECRET = 4096
LABEL = "gpusd"
TAG_REQUEST = "gpusd-request"
TAG_RESPONSE = "gpusd-response"
NODE_HEADER = "Gpusd-Node"
# a daemon's certificate fingerprint (answers); the one the client pinned (requests)
CERT_HEADER = "Gpusd-Cert"
# the account a user's SSH signature acts as (requests, gpusd 0.4)
USER_HEADER = "Gpusd-User"
# the daemon's host name, percent-encoded UTF-8 (plain for DNS names)
HOST_HEADER = "Gpusd-Host"
# the addresses it serves, comma-separated
ADDRS_HEADER = "Gpusd-Addrs"
# characters of a signed host name
MAX_SIGNED_HOST = 255
# addresses in a signed answer
MAX_SIGNED_ADDRS = 64
SECRET_ENV = "GPUSD_TOKEN"
SECRET_FILE_ENV = "GPUSD_TOKEN_FILE"
_REQUEST_COMPONENTS = ("@method", "@authority", "@path", "@query")
_RESPONSE_COMPONENTS = ("@status", '"@authority";req', '"@path";req', "gpusd-node")
# the same as serialized component ids (keys of the library's covered_components)
_REQUEST_COVERED = frozenset({'"@method"', '"@authority"', '"@path"', '"@query"', '"content-digest"'})
_RESPONSE_COVERED = frozenset({'"@status"', '"@authority";req', '"@path";req', '"gpusd-node"'})


# -- the secret --------------------------------------------------------------------------------------
def read_secret_file(path: str | os.PathLike[str], what: str = "the token file") -> str:
    """The secret kept in ``path`` (first line, surrounding white space removed).  The file must be
    a regular file that other users cannot read; a symlink is not followed.  ``what``: the file's name
    in the messages."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise SecretError(f"cannot read {what} {os.fspath(path)!r}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SecretError(f"{what} {os.fspath(path)!r} is not a regular file")
        if st.st_mode & 0o077 and st.st_uid == os.geteuid():
            # ours and readable by others: refuse, as ssh does with keys
            raise SecretError(f"{what} {os.fspath(path)!r} is readable by other users: chmod 600 it")
        data = os.read(fd, MAX_SECRET + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_SECRET:
        raise SecretError(f"{what} {os.fspath(path)!r} is larger than {MAX_SECRET} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise SecretError(f"{what} {os.fspath(path)!r} is not UTF-8 text") from None
    lines = text.strip().splitlines()
    return lines[0].strip() if lines else ""


def load_secret(token_file: str | os.PathLike[str] | None = None,
                environ: Mapping[str, str] | None = None) -> str | None:
    """The fleet secret: from ``token_file`` (``--token-file``), else the file named by
    ``$GPUSD_TOKEN_FILE``, else ``$GPUSD_TOKEN``; None when none is given.  Never from a
    command-line value (``ps`` shows those to every local user).  :class:`SecretError` for an
    unreadable file or a secret shorter than :data:`MIN_SECRET` bytes."""
    env = os.environ if environ is None else environ
    if token_file is None and env.get(SECRET_FILE_ENV):
        token_file = env[SECRET_FILE_ENV]
    if token_file is not None:
        value = read_secret_file(token_file)
        where = f"the token file {os.fspath(token_file)!r}"
    else:
        value = (env.get(SECRET_ENV) or "").strip()
        where = f"${SECRET_ENV}"
        if not value:
            return None
    check_secret(value, where)
    return value


def check_secret(value: str, where: str = "the token") -> None:
    if len(value.encode()) < MIN_SECRET:
        raise SecretError(f"{where}: the fleet secret must be at least {MIN_SECRET} bytes "
                          "(make one with: openssl rand -hex 32)")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise SecretError(f"{where}: the fleet secret contains control characters")


# -- messages as the signature library sees them -----------------------------------------------------
class Headers(dict[str, str]):
    """A case-insensitive enough header map for the signature library (keys stored as given)."""

    def find(self, name: str) -> str | None:
        low = name.lower()
        for k, v in self.items():
            if k.lower() == low:
                return v
        return None


@dataclass
class Request:
    method: str
    # absolute: http://authority/path?query
    url: str
    headers: Any = field(default_factory=Headers)


@dataclass
class Response:
    status_code: int
    request: Request
    headers: Any = field(default_factory=Headers)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def fingerprint(der_certificate: bytes) -> str:
    """The SHA-256 fingerprint of a DER certificate, as announced (``fp`` in TXT): unpadded base64url."""
    return _b64(hashlib.sha256(der_certificate).digest())


def fingerprint_bytes(fp: str) -> bytes | None:
    """The 32 digest bytes of an announced fingerprint, or None when it is not one."""
    if not isinstance(fp, str) or len(fp) != 43:
        return None
    try:
        raw = base64.urlsafe_b64decode(fp + "=")
    except ValueError:
        return None
    return raw if len(raw) == 32 else None


class FleetKey:
    """The keys derived from one fleet secret (HKDF-SHA256, distinct ``info`` per purpose)."""

    def __init__(self, secret: str | bytes) -> None:
        raw = secret.encode() if isinstance(secret, str) else bytes(secret)
        self.request_key = _hkdf(raw, b"gpusd v1 request signing")
        self.response_key = _hkdf(raw, b"gpusd v1 response signing")
        # public: tells a daemon "this client holds another secret" (no use for an attacker)
        self.key_id = "gpusd-" + _hkdf(raw, b"gpusd v1 key id", 9).hex()

        self._req_signer = HTTPMessageSigner(signature_algorithm=algorithms.HMAC_SHA256,
                                             key_resolver=cast(Any, _Keys(self.key_id, self.request_key)))
        self._resp_signer = HTTPMessageSigner(signature_algorithm=algorithms.HMAC_SHA256,
                                              key_resolver=cast(Any, _Keys(self.key_id, self.response_key)))
        self._req_verifier = _verifier(self.key_id, self.request_key)
        self._resp_verifier = _verifier(self.key_id, self.response_key)

        # gpusd's own shape, the library as the reference (imported with the library)
        self._fast = sigfast

    # -- requests ---------------------------------------------------------------------------------
    def sign_request(self, method: str, url: str, headers: MutableMapping[str, str] | None = None,
                     body: bytes = b"", node_id: str | None = None,
                     now: float | None = None, user: Any = None, account: str | None = None,
                     cert_fp: str | None = None) -> tuple[dict[str, str], str]:
        """The headers to add to a request (``Content-Digest``, ``Signature-Input``, ``Signature``,
        and ``Gpusd-Node`` with ``node_id``), and the nonce used (to check the answer's proof).
        ``now``: the signing time (default: the clock).  ``user``: the user's SSH key signer
        (:mod:`gpusd.wire.sshsig`), which signs this signature's base into ``Gpusd-User-Signature``;
        the base then covers ``Gpusd-User``, the account it acts as (``account``, else the signer's
        :func:`gpusd.wire.sshsig.account_of`).  ``cert_fp``: over TLS, the fingerprint of the
        certificate the connection showed (covered as ``Gpusd-Cert``: the request is good on a
        connection to that certificate only)."""
        req = Request(method.upper(), url, Headers())
        nonce = secrets.token_urlsafe(16)
        when = time.time() if now is None else now
        if user is not None and account is None:
            from .sshsig import account_of

            account = account_of(user)
        fast = self._fast.sign_request(self.request_key, self.key_id, req.method, url, node_id, body, nonce, int(when),
                                       account, cert_fp)
        # gpusd's one shape, as the library writes it (docs/security.md)
        if fast is not None:
            req.headers.update(fast[0])
            base = fast[1]
        else:
            covered = list(_REQUEST_COMPONENTS)
            for header, value in ((NODE_HEADER, node_id), (USER_HEADER, account), (CERT_HEADER, cert_fp)):
                if value:
                    req.headers[header] = value
                    covered.append(header.lower())
            created = datetime.datetime.fromtimestamp(when, datetime.timezone.utc)
            prepared = self._req_signer.prepare(req, key_id=self.key_id, nonce=nonce, label=LABEL, tag=TAG_REQUEST,
                                                created=created, covered_component_ids=covered, body=body)
            _apply(req.headers, prepared.signature_params, self.request_key, prepared.signature_base)
            base = bytes(prepared.signature_base)
        if user is not None:
            from .sshsig import HEADER, header_value

            req.headers[HEADER] = header_value(user, base)
        out = dict(req.headers)
        if headers is not None:
            headers.update(out)
        return out, nonce

    def verify_request(self, req: Request, body: bytes = b"") -> Any:
        """The library's VerifyResult of the request's gpusd signature; raises on any problem."""
        fast = self._fast.verify_request(self.request_key, self.key_id, req.method, str(req.url), req.headers, body,
                                      MAX_SKEW)
        # gpusd's exact shape, accepted with the library's checks (docs/security.md)
        if fast is not None:
            return fast

        results = self._req_verifier.verify(req, max_age=datetime.timedelta(0), expect_tag=TAG_REQUEST, body=body)
        if len(results) != 1 or not results[0].nonce:
            raise InvalidSignature("one signature with a nonce expected")
        missing = _REQUEST_COVERED - results[0].covered_components.keys()
        # checked here rather than by the library's require_components: a third of the cost
        if missing:
            raise InvalidSignature(f"the signature does not cover {sorted(missing)}")
        return results[0]

    # -- responses --------------------------------------------------------------------------------
    def sign_response(self, resp: Response, nonce: str, node_id: str, cert_fp: str | None = None,
                      body: bytes | None = None, host: str | None = None,
                      addresses: Sequence[str] = ()) -> None:
        """Add ``Gpusd-Node`` (and ``Gpusd-Cert``, ``Gpusd-Host``, ``Gpusd-Addrs``), ``Signature-Input``
        and ``Signature`` to ``resp.headers`` (and ``Content-Digest`` when ``body`` is given, i.e. not
        a stream).  ``host``, ``addresses``: who the daemon is (its host name, the addresses it
        serves), covered by the signature like the node id."""
        fields, covered = _identity(node_id, cert_fp, host, tuple(addresses) if host else ())
        resp.headers.update(fields)
        if self._fast.sign_response(self.response_key, self.key_id, resp.status_code, str(resp.request.url),
                                 resp.headers, covered, nonce, int(time.time()), body):
            return
        prepared = self._resp_signer.prepare(resp, key_id=self.key_id, nonce=nonce, label=LABEL, tag=TAG_RESPONSE,
                                             created=datetime.datetime.now(datetime.timezone.utc),
                                             covered_component_ids=list(covered), body=body)
        _apply(resp.headers, prepared.signature_params, self.response_key, prepared.signature_base)

    def verify_response(self, resp: Response, nonce: str, node_id: str | None = None,
                        cert_fp: str | None = None, body: bytes | None = None) -> bool:
        """Whether ``resp`` carries this fleet's proof for the request signed with ``nonce``: from
        ``node_id`` when given, over a TLS connection whose certificate is ``cert_fp`` when given,
        with a body matching its signed digest when ``body`` is given.  Never raises."""
        return self.response_proof(resp, nonce, node_id, cert_fp, body) is not None

    def response_proof(self, resp: Response, nonce: str, node_id: str | None = None,
                       cert_fp: str | None = None, body: bytes | None = None) -> Proof | None:
        """The :class:`Proof` ``resp`` carries (as :meth:`verify_response` checks it), or None: what
        the daemon signed about itself.  Never raises."""
        try:
            fast = self._fast.verify_response(self.response_key, self.key_id, resp.status_code, resp.request.method,
                                           str(resp.request.url), resp.headers, body, MAX_SKEW)
            results = [fast] if fast is not None else self._resp_verifier.verify(
                resp, max_age=datetime.timedelta(0), expect_tag=TAG_RESPONSE, body=body)
            if len(results) != 1 or results[0].nonce != nonce:
                return None
            if _RESPONSE_COVERED - results[0].covered_components.keys():
                return None
            covered = results[0].covered_components
            if node_id is not None and covered.get('"gpusd-node"') != node_id:
                return None
            if cert_fp is not None and covered.get('"gpusd-cert"') != cert_fp:
                return None
            # a body with content must match the signed digest
            if body and results[0].body is None:
                return None
            return Proof(node_id=str(covered.get('"gpusd-node"') or ""),
                         host=decode_host(covered.get('"gpusd-host"')),
                         addresses=decode_addresses(covered.get('"gpusd-addrs"')),
                         cert_fp=covered.get('"gpusd-cert"'))
        except Exception:  # noqa: BLE001 - any malformed proof is no proof
            return None


# a daemon says the same about itself in every answer
@functools.lru_cache(maxsize=16)
def _identity(node_id: str, cert_fp: str | None, host: str | None, addresses: tuple[str, ...]
              ) -> tuple[tuple[tuple[str, str], ...], tuple[str, ...]]:
    """The header fields a signed answer carries about the daemon, and the components its signature
    covers (:meth:`FleetKey.sign_response`)."""
    fields = [(NODE_HEADER, node_id)]
    covered = list(_RESPONSE_COMPONENTS)
    if cert_fp:
        fields.append((CERT_HEADER, cert_fp))
        covered.append("gpusd-cert")
    if host:
        fields.append((HOST_HEADER, encode_host(host)))
        covered.append("gpusd-host")
        addrs = [a for a in addresses if _ip(a)][:MAX_SIGNED_ADDRS]
        if addrs:
            fields.append((ADDRS_HEADER, ",".join(addrs)))
            covered.append("gpusd-addrs")
    return tuple(fields), tuple(covered)


@dataclass(frozen=True)
class Proof:
    """What a daemon's signed answer says about the daemon: its node id, and (gpusd 0.3) its host
    name and the addresses it serves (``host`` None, ``addresses`` empty: the daemon signed none, or
    signed a value that is not one; an older daemon).  A client takes the name and addresses it acts
    on from here, never from an announcement."""

    node_id: str
    host: str | None = None
    addresses: tuple[str, ...] = ()
    cert_fp: str | None = None


def encode_host(name: str) -> str:
    """A host name as the ``Gpusd-Host`` header carries it: percent-encoded UTF-8 (RFC 3986), so a
    DNS name goes as it is and any other name stays one printable ASCII header value."""
    return quote(name[:MAX_SIGNED_HOST], safe="")


# per answer checked: the same few names again and again
@functools.lru_cache(maxsize=256)
def decode_host(value: object) -> str | None:
    """The host name of a signed ``Gpusd-Host`` value; None when absent or not a printable name of
    at most :data:`MAX_SIGNED_HOST` characters."""
    if not isinstance(value, str) or not value or len(value) > 3 * MAX_SIGNED_HOST:
        return None
    try:
        name = unquote(value, errors="strict") if "%" in value else value
    except UnicodeDecodeError:
        return None
    if not 0 < len(name) <= MAX_SIGNED_HOST or not name.isprintable():
        return None
    return name


@functools.lru_cache(maxsize=256)
def decode_addresses(value: object) -> tuple[str, ...]:
    """The IP addresses of a signed ``Gpusd-Addrs`` value (entries that are not an address one can
    reach a host at -- not an IP address, unspecified, multicast -- dropped; at most
    :data:`MAX_SIGNED_ADDRS`)."""
    if not isinstance(value, str) or not value:
        return ()
    out: list[str] = []
    for part in value.split(",")[:MAX_SIGNED_ADDRS]:
        a = part.strip()
        if not _ip(a) or a in out:
            continue
        ip = ipaddress.ip_address(a)
        if not (ip.is_unspecified or ip.is_multicast):
            out.append(a)
    return tuple(out)


def _ip(text: str) -> bool:
    """An IP address that is one safe word (:func:`gpusd.sanitize.ip_word`: no scope id such as
    ``%;reboot``): what a client may put in a hostfile or a remote shell."""

    return ip_word(text)


def _apply(headers: MutableMapping[str, str], params: str, key: bytes, base: bytes) -> None:
    """What the library's ``apply()`` writes (``Signature-Input``, ``Signature``), without rebuilding the
    signature base ``prepare()`` just built: half the cost of ``sign()``."""
    mac = hmac.new(key, base, hashlib.sha256).digest()
    headers["Signature-Input"] = f"{LABEL}={params}"
    headers["Signature"] = f"{LABEL}=:{base64.b64encode(mac).decode()}:"


def _hkdf(secret: bytes, info: bytes, length: int = 32) -> bytes:
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return HKDF(algorithm=hashes.SHA256(), length=length, salt=b"gpusd fleet secret", info=info).derive(secret)


class _Keys:
    """A key resolver that knows one key id (the library's resolver protocol, duck-typed: the library
    is imported only when a key is used)."""

    def __init__(self, key_id: str, key: bytes) -> None:
        self.key_id, self.key = key_id, key

    def resolve_private_key(self, key_id: str) -> bytes:
        return self.resolve_public_key(key_id)

    def resolve_public_key(self, key_id: str) -> bytes:
        if key_id != self.key_id:
            raise InvalidSignature("unknown key id (another fleet secret?)")
        return self.key


def _verifier(key_id: str, key: bytes) -> Any:
    v = HTTPMessageVerifier(signature_algorithm=algorithms.HMAC_SHA256, key_resolver=cast(Any, _Keys(key_id, key)))
    v.max_clock_skew = datetime.timedelta(seconds=MAX_SKEW)
    return v


class NonceCache:
    """Nonces of verified requests, each kept for ``2 * MAX_SKEW`` seconds of the monotonic clock
    (past that, the request's ``created`` is out of the window anyway -- while the wall clock does not
    step back).  Bounded: at ``maximum`` live entries it refuses new ones.

    A wall clock stepped back (NTP, an administrator, libfaketime) would make a forgotten request's
    ``created`` valid again.  So the cache keeps, for each nonce, its request's ``created``, and when it
    forgets a nonce it raises :attr:`floor` to that ``created``: a request created no later than the
    floor may be one it forgot, and is refused, whatever either clock says now.  Without a step the
    floor stays at least ``MAX_SKEW`` behind the wall clock (a forgotten request was at most
    ``MAX_SKEW`` ahead of it, ``2 * MAX_SKEW`` ago), where the window refuses anyway."""

    def __init__(self, ttl: float = 2 * MAX_SKEW, maximum: int = NONCE_CACHE_MAX) -> None:
        self.ttl, self.maximum = ttl, maximum
        self._seen: collections.OrderedDict[str, tuple[float, float]] = collections.OrderedDict()
        # the latest ``created`` of a nonce this cache forgot
        self.floor = float("-inf")

    def __len__(self) -> int:
        return len(self._seen)

    def add(self, nonce: str, now: float | None = None, created: float | None = None) -> str | None:
        """None when ``nonce`` is new (and now remembered), else why it is refused.  ``created``: the
        request's signing time (seconds since the epoch, as signed)."""
        now = time.monotonic() if now is None else now
        seen = self._seen
        # insertion order is expiry order
        while seen:
            first, (expires, was_created) = next(iter(seen.items()))
            if expires > now:
                break
            del seen[first]
            if was_created > self.floor:
                self.floor = was_created
        if nonce in seen:
            return "replayed request (nonce already used)"
        if created is not None and created <= self.floor:
            return ("signed before a request this daemon no longer remembers (its clock stepped back?): "
                    "sign it again")
        if len(seen) >= self.maximum:
            return "too many signed requests in the replay window"
        seen[nonce] = (now + self.ttl, float("-inf") if created is None else created)
        return None


def signature_base(result: Any) -> bytes:
    """The RFC 9421 signature base a verified request was signed over (what a user's SSH key signs,
    :mod:`gpusd.wire.sshsig`), rebuilt from the library's VerifyResult: its covered components, in
    order, then ``@signature-params``."""
    return "\n".join(f"{k}: {v}" for k, v in result.covered_components.items()).encode()
