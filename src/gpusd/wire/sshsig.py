"""Users' signatures with their SSH keys: OpenSSH's SSHSIG format (``ssh-keygen -Y sign``), docs/security.md.

A remote write (a lease request, its renewal, its release) carries, beside the fleet secret's RFC 9421
signature, the user's own signature in the ``Gpusd-User-Signature`` header: an SSHSIG blob (the
binary form of what ``ssh-keygen -Y sign -n gpusd`` writes between its armour lines, base64) over the
fleet signature's **signature base** (RFC 9421 section 2.5: the covered components, with the request's
``created`` and ``nonce``).  So a user signature is good for one request only: to one daemon (the base
covers ``gpusd-node`` and ``@authority``), within the fleet signature's clock window, once (its nonce).

Keys: Ed25519, ECDSA (NIST P-256, P-384, P-521) and RSA (at least 2048 bits; signed as ``rsa-sha2-512``,
``rsa-sha2-256`` accepted; never SHA-1).  Security keys (``sk-*``) and certificates are not taken.

Signers: a private key file (``--identity FILE``, like ``ssh -i``; unencrypted, or through the agent
when the agent holds it), or the key the SSH agent offers first (``$SSH_AUTH_SOCK``), asked with the
agent protocol's sign request (draft-miller-ssh-agent: ``SSH_AGENTC_SIGN_REQUEST``).  Verification and
key parsing use ``cryptography``; nothing here trusts a key — :mod:`gpusd.daemon.users` decides whose
it is.
"""

# Imports inside functions: optional or heavy packages.
from __future__ import annotations

import base64
import hashlib
import logging
import os
import pwd
import socket
import struct
from dataclasses import dataclass
from typing import Any, Protocol

MAGIC = b"SSHSIG"
VERSION = 1
NAMESPACE = "gpusd"
HEADER = "Gpusd-User-Signature"
# bytes of the (decoded) blob: an RSA-16384 signature fits
MAX_SIGNATURE = 8192
MIN_RSA_BITS = 2048
# what --identity FILE sets for the process and its renewer
IDENTITY_ENV = "GPUSD_IDENTITY"
# the account on the GPU hosts a user signature acts as (default: the login name)
ACCOUNT_ENV = "GPUSD_ACCOUNT"
# seconds: an agent may ask its user to confirm (ssh-add -c)
AGENT_TIMEOUT = 30.0
MAX_AGENT_ANSWER = 262144
KEY_TYPES = frozenset({"ssh-ed25519", "ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384", "ecdsa-sha2-nistp521",
                       "ssh-rsa"})
_CURVES = {"ecdsa-sha2-nistp256": ("nistp256", "SECP256R1", "SHA256"),
           "ecdsa-sha2-nistp384": ("nistp384", "SECP384R1", "SHA384"),
           "ecdsa-sha2-nistp521": ("nistp521", "SECP521R1", "SHA512")}


class SshSigError(ValueError):
    """A signature or key that cannot be used (the message says why, in one line)."""


# -- the SSH wire encoding (RFC 4251 section 5) ----------------------------------------------------
def _string(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def _mpint(n: int) -> bytes:
    if n == 0:
        return _string(b"")
    # a leading zero byte where the top bit is set
    raw = n.to_bytes((n.bit_length() + 8) // 8, "big")
    return _string(raw)


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise SshSigError("truncated SSH encoding")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def uint32(self) -> int:
        return int(struct.unpack(">I", self.take(4))[0])

    def string(self) -> bytes:
        return self.take(self.uint32())

    def mpint(self) -> int:
        raw = self.string()
        if raw and raw[0] & 0x80:
            raise SshSigError("negative mpint")
        return int.from_bytes(raw, "big")

    def done(self) -> None:
        if self.pos != len(self.data):
            raise SshSigError("trailing bytes in an SSH encoding")


# -- keys ------------------------------------------------------------------------------------------
def key_type(blob: bytes) -> str:
    try:
        return _Reader(blob).string().decode("ascii")
    except (SshSigError, UnicodeDecodeError):
        raise SshSigError("not an SSH public key") from None


def fingerprint(blob: bytes) -> str:
    """The key's fingerprint as ``ssh-keygen -l`` prints it: ``SHA256:`` and unpadded base64."""
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def parse_public(text: str) -> bytes:
    """The blob of a public key written ``TYPE BASE64 [comment]`` (a ``.pub`` file's line)."""
    fields = text.strip().split()
    if len(fields) < 2 or fields[0] not in KEY_TYPES:
        raise SshSigError("not an SSH public key of a supported type "
                          f"({', '.join(sorted(KEY_TYPES))})")
    try:
        blob = base64.b64decode(fields[1], validate=True)
    except ValueError:
        raise SshSigError("an SSH public key with bad base64") from None
    if key_type(blob) != fields[0]:
        raise SshSigError("an SSH public key whose type does not match its data")
    # parses: a broken key is refused here
    _public_key(blob)
    return blob


def _public_key(blob: bytes) -> Any:
    """The ``cryptography`` public key of an SSH key blob (SshSigError for other types or bad data)."""
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

    r = _Reader(blob)
    kind = r.string().decode("ascii", "replace")
    try:
        if kind == "ssh-ed25519":
            pk = r.string()
            r.done()
            return ed25519.Ed25519PublicKey.from_public_bytes(pk)
        if kind in _CURVES:
            curve_name, curve, _ = _CURVES[kind]
            if r.string() != curve_name.encode():
                raise SshSigError("an ECDSA key whose curve does not match its type")
            point = r.string()
            r.done()
            return ec.EllipticCurvePublicKey.from_encoded_point(getattr(ec, curve)(), point)
        if kind == "ssh-rsa":
            e, n = r.mpint(), r.mpint()
            r.done()
            if n.bit_length() < MIN_RSA_BITS:
                raise SshSigError(f"an RSA key of {n.bit_length()} bits (at least {MIN_RSA_BITS} are needed)")
            return rsa.RSAPublicNumbers(e, n).public_key()
    except SshSigError:
        raise
    except ValueError as exc:
        raise SshSigError(f"a broken {kind} key ({exc})") from None
    raise SshSigError(f"keys of type {kind[:40]!r} are not supported")


# -- SSHSIG (OpenSSH PROTOCOL.sshsig) ---------------------------------------------------------------
def signed_data(message: bytes, namespace: str = NAMESPACE, hash_alg: str = "sha512") -> bytes:
    """What the key actually signs: the magic, the namespace, the hash algorithm and H(message)."""
    digest = hashlib.new(hash_alg, message).digest()
    return MAGIC + _string(namespace.encode()) + _string(b"") + _string(hash_alg.encode()) + _string(digest)


def encode(public_blob: bytes, ssh_signature: bytes, namespace: str = NAMESPACE, hash_alg: str = "sha512") -> bytes:
    return (MAGIC + struct.pack(">I", VERSION) + _string(public_blob) + _string(namespace.encode()) + _string(b"")
            + _string(hash_alg.encode()) + _string(ssh_signature))


def armor(blob: bytes) -> str:
    """The text ``ssh-keygen -Y sign`` writes (for ``ssh-keygen -Y verify``)."""
    b64 = base64.b64encode(blob).decode()
    lines = [b64[i:i + 76] for i in range(0, len(b64), 76)]
    return "-----BEGIN SSH SIGNATURE-----\n" + "\n".join(lines) + "\n-----END SSH SIGNATURE-----\n"


def unarmor(text: str) -> bytes:
    body = [ln.strip() for ln in text.strip().splitlines()]
    if not body or body[0] != "-----BEGIN SSH SIGNATURE-----" or body[-1] != "-----END SSH SIGNATURE-----":
        raise SshSigError("not an armoured SSH signature")
    try:
        return base64.b64decode("".join(body[1:-1]), validate=True)
    except ValueError:
        raise SshSigError("an SSH signature with bad base64") from None


def verify(blob: bytes, message: bytes, namespace: str = NAMESPACE) -> bytes:
    """Check an SSHSIG ``blob`` over ``message`` in ``namespace``; the signer's public key blob.
    :class:`SshSigError` says why a signature is not good (who the key belongs to is not decided here)."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec, padding
    from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

    if len(blob) > MAX_SIGNATURE:
        raise SshSigError(f"a user signature is at most {MAX_SIGNATURE} bytes")
    r = _Reader(blob)
    if r.take(6) != MAGIC or r.uint32() != VERSION:
        raise SshSigError("not an SSHSIG signature (version 1)")
    public, ns, _reserved, hash_alg = r.string(), r.string(), r.string(), r.string()
    sig = r.string()
    r.done()
    if ns != namespace.encode():
        raise SshSigError(f"a signature for another namespace ({ns[:40].decode('ascii', 'replace')!r}, "
                          f"not {namespace!r})")
    if hash_alg not in (b"sha256", b"sha512"):
        raise SshSigError("an SSHSIG hash algorithm other than sha256/sha512")
    data = signed_data(message, namespace, hash_alg.decode())
    key = _public_key(public)
    kind = key_type(public)
    s = _Reader(sig)
    alg, raw = s.string().decode("ascii", "replace"), s.string()
    s.done()
    try:
        if kind == "ssh-ed25519":
            if alg != kind:
                raise SshSigError("an Ed25519 key with another signature algorithm")
            key.verify(raw, data)
        elif kind in _CURVES:
            if alg != kind:
                raise SshSigError("an ECDSA key with another signature algorithm")
            rs = _Reader(raw)
            der = encode_dss_signature(rs.mpint(), rs.mpint())
            rs.done()
            key.verify(der, data, ec.ECDSA(getattr(hashes, _CURVES[kind][2])()))
        else:  # ssh-rsa
            algs = {"rsa-sha2-512": hashes.SHA512, "rsa-sha2-256": hashes.SHA256}
            if alg not in algs:
                raise SshSigError(f"an RSA signature of type {alg[:40]!r} (rsa-sha2-512 or rsa-sha2-256 needed)")
            key.verify(raw, data, padding.PKCS1v15(), algs[alg]())
    except InvalidSignature:
        raise SshSigError("the user signature does not match the request") from None
    return public


# -- signers ---------------------------------------------------------------------------------------
class Signer(Protocol):
    @property
    def public_blob(self) -> bytes: ...
    def sign_data(self, data: bytes) -> bytes:
        """The SSH signature (``string algorithm, string signature``) of ``data``."""
        ...


def sign(signer: Signer, message: bytes, namespace: str = NAMESPACE) -> bytes:
    """An SSHSIG blob over ``message`` by ``signer``."""
    return encode(signer.public_blob, signer.sign_data(signed_data(message, namespace)), namespace)


@dataclass
class FileSigner:
    """A private key read from a file (OpenSSH or PEM format, unencrypted or with ``passphrase``)."""

    key: Any
    public_blob: bytes
    source: str = ""
    # the account its signatures act as (None: :func:`account_of`'s default)
    account: str | None = None

    @classmethod
    def load(cls, path: str, passphrase: bytes | None = None) -> FileSigner:
        from cryptography.hazmat.primitives import serialization

        try:
            with open(path, "rb") as f:
                data = f.read(65537)
        except OSError as exc:
            raise SshSigError(f"cannot read the identity {path!r}: {exc.strerror or exc}") from None
        key: Any
        try:
            if b"OPENSSH PRIVATE KEY" in data:
                key = serialization.load_ssh_private_key(data, passphrase)
            else:
                key = serialization.load_pem_private_key(data, passphrase)
        except TypeError:
            raise SshSigError(f"the identity {path!r} is encrypted: add it to your agent (ssh-add {path})") from None
        except (ValueError, _unsupported()) as exc:
            raise SshSigError(f"the identity {path!r} is not a usable private key ({exc})") from None
        pub = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        return cls(key, parse_public(pub.decode()), path)

    def sign_data(self, data: bytes) -> bytes:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa
        from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

        kind = key_type(self.public_blob)
        if isinstance(self.key, ed25519.Ed25519PrivateKey):
            return _string(kind.encode()) + _string(self.key.sign(data))
        if isinstance(self.key, ec.EllipticCurvePrivateKey):
            r, s = decode_dss_signature(self.key.sign(data, ec.ECDSA(getattr(hashes, _CURVES[kind][2])())))
            return _string(kind.encode()) + _string(_mpint(r) + _mpint(s))
        if isinstance(self.key, rsa.RSAPrivateKey):
            return _string(b"rsa-sha2-512") + _string(self.key.sign(data, padding.PKCS1v15(), hashes.SHA512()))
        raise SshSigError(f"keys of type {kind!r} cannot sign here")


def _unsupported() -> type[Exception]:
    from cryptography.exceptions import UnsupportedAlgorithm

    return UnsupportedAlgorithm


# the agent protocol (draft-miller-ssh-agent)
_REQUEST_IDENTITIES, _IDENTITIES_ANSWER, _SIGN_REQUEST, _SIGN_RESPONSE, _FAILURE = 11, 12, 13, 14, 5
_RSA_SHA2_512 = 4


def _agent_call(path: str, kind: int, payload: bytes) -> tuple[int, bytes]:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(AGENT_TIMEOUT)
            s.connect(path)
            msg = bytes([kind]) + payload
            s.sendall(struct.pack(">I", len(msg)) + msg)
            head = _recv(s, 4)
            (n,) = struct.unpack(">I", head)
            if not 0 < n <= MAX_AGENT_ANSWER:
                raise SshSigError("the SSH agent sent an answer of a bad size")
            body = _recv(s, n)
    except OSError as exc:
        raise SshSigError(f"cannot talk to the SSH agent ($SSH_AUTH_SOCK): {exc.strerror or exc}") from None
    return body[0], body[1:]


def _recv(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise SshSigError("the SSH agent closed the connection")
        out += chunk
    return out


def agent_keys(path: str) -> list[tuple[bytes, str]]:
    """The (public key blob, comment) pairs the agent at ``path`` holds, in its order."""
    kind, body = _agent_call(path, _REQUEST_IDENTITIES, b"")
    if kind != _IDENTITIES_ANSWER:
        raise SshSigError("the SSH agent refused to list its keys")
    r = _Reader(body)
    out = []
    for _ in range(min(r.uint32(), 1024)):
        blob, comment = r.string(), r.string()
        out.append((blob, comment.decode("utf-8", "replace")))
    return out


@dataclass
class AgentSigner:
    """A key the SSH agent holds; the agent signs (the private key never leaves it)."""

    path: str
    public_blob: bytes
    comment: str = ""
    # the account its signatures act as (None: :func:`account_of`'s default)
    account: str | None = None

    def sign_data(self, data: bytes) -> bytes:
        flags = _RSA_SHA2_512 if key_type(self.public_blob) == "ssh-rsa" else 0
        kind, body = _agent_call(self.path, _SIGN_REQUEST,
                                 _string(self.public_blob) + _string(data) + struct.pack(">I", flags))
        if kind != _SIGN_RESPONSE:
            raise SshSigError(f"the SSH agent refused to sign with {fingerprint(self.public_blob)}")
        r = _Reader(body)
        sig = r.string()
        r.done()
        return sig


def load_signer(identity: str | None = None, environ: dict[str, str] | None = None) -> Signer | None:
    """The user's signer: ``identity`` (a private or public key file, like ``ssh -i``: the agent signs
    when it holds that key), else ``$GPUSD_IDENTITY``, else the agent's first key; None when there is
    neither an identity nor an agent with a key.  :class:`SshSigError` for an identity that cannot sign."""
    env = os.environ if environ is None else environ
    identity = identity or env.get(IDENTITY_ENV) or None
    sock = env.get("SSH_AUTH_SOCK") or None
    held: list[tuple[bytes, str]] = []
    if sock:
        try:
            held = agent_keys(sock)
        except SshSigError as exc:
            # a stale $SSH_AUTH_SOCK: as ssh does, go on without the agent

            logging.getLogger("gpusd").warning("%s (going on without the agent)", exc)
    held = [(b, c) for b, c in held if _usable(b)]
    if identity is None:
        return AgentSigner(sock, held[0][0], held[0][1]) if sock and held else None
    pub_blob: bytes | None = None
    for candidate in (identity, identity + ".pub"):
        try:
            with open(candidate, encoding="utf-8", errors="replace") as f:
                text = f.read(65536)
        except OSError:
            continue
        if "PRIVATE KEY" not in text:
            try:
                pub_blob = parse_public(text)
                break
            except SshSigError:
                continue
    if pub_blob is not None and sock:
        for blob, comment in held:
            if blob == pub_blob:
                return AgentSigner(sock, blob, comment)
    if identity.endswith(".pub"):
        raise SshSigError(f"the SSH agent does not hold the key {identity!r} (ssh-add it)")
    return FileSigner.load(identity)


def _usable(blob: bytes) -> bool:
    try:
        _public_key(blob)
        return True
    except SshSigError:
        return False


_cached: dict[tuple[str | None, str | None], Signer | None] = {}


def default_signer() -> Signer | None:
    """:func:`load_signer` for this process's environment, loaded once (None when there is no key;
    a key that cannot be loaded is an error the first write reports)."""
    where = (os.environ.get(IDENTITY_ENV), os.environ.get("SSH_AUTH_SOCK"))
    if where not in _cached:
        _cached[where] = load_signer()
    return _cached[where]


def account_of(signer: object, environ: dict[str, str] | None = None) -> str:
    """The account on the GPU hosts that ``signer``'s signatures act as, as ssh's ``user@``: the
    signer's own ``account`` attribute when it has one, else ``$GPUSD_ACCOUNT``, else this process's
    login name.  A daemon checks that account's ``authorized_keys`` (or its users-file lines) only."""
    named = getattr(signer, "account", None)
    if isinstance(named, str) and named:
        return named
    env = os.environ if environ is None else environ
    if env.get(ACCOUNT_ENV):
        return env[ACCOUNT_ENV]

    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        # a uid without a passwd entry (a container): its number, which names nobody
        return str(os.geteuid())


def header_value(signer: Signer, base: bytes) -> str:
    """The ``Gpusd-User-Signature`` header for a request whose fleet signature base is ``base``."""
    return base64.b64encode(sign(signer, base)).decode()


def read_header(value: str) -> bytes:
    if len(value) > MAX_SIGNATURE * 4 // 3 + 8:
        raise SshSigError(f"a user signature is at most {MAX_SIGNATURE} bytes")
    try:
        return base64.b64decode(value.strip(), validate=True)
    except ValueError:
        raise SshSigError("a user signature is base64 of an SSHSIG blob") from None
