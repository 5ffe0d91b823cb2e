"""The daemon's own TLS key and self-signed certificate (docs/security.md, "TLS").

Made on first start in the state directory (``tls-key.pem``, ``tls-cert.pem``), kept across restarts:
clients pin the certificate's SHA-256 fingerprint, announced in TXT (``fp``) and signed into every
proof the daemon gives, as Syncthing pins device ids.  Files are created with ``O_CREAT | O_EXCL |
O_NOFOLLOW`` and mode 0600 (never a symlink followed, never a file chmod-ed that gpusd did not just
create); existing files must be regular, owned by the daemon's user, the key not readable by others.
"""

# Imports inside functions: optional or heavy packages.
from __future__ import annotations

import datetime
import os
import ssl
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ConfigError
from ..wire.signing import fingerprint

if TYPE_CHECKING:  # pragma: no cover
    import ssl

KEY_FILE = "tls-key.pem"
CERT_FILE = "tls-cert.pem"
_MAX_PEM = 64 * 1024


@dataclass
class Identity:
    key_path: Path
    cert_path: Path
    # unpadded base64url SHA-256 of the DER certificate (gpusd.wire.signing.fingerprint)
    fingerprint: str

    def server_context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(str(self.cert_path), str(self.key_path))
        return ctx


def load_or_create(state_dir: Path, common_name: str) -> Identity:
    """The daemon's TLS identity in ``state_dir``: loaded, or made when neither file exists.
    :class:`~gpusd.errors.ConfigError` with a clear message for anything unsafe or damaged."""
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    key_path, cert_path = state_dir / KEY_FILE, state_dir / CERT_FILE
    have_key, have_cert = _exists(key_path), _exists(cert_path)
    if not have_key and not have_cert:
        _create(key_path, cert_path, common_name)
    elif have_key != have_cert:
        missing = cert_path if have_key else key_path
        raise ConfigError(f"TLS: {missing} is missing; remove {key_path} and {cert_path} to make a new "
                          "certificate (clients pinned the old one until they see the new announcement)")
    key_pem = _read_private(key_path, secret=True)
    cert_pem = _read_private(cert_path, secret=False)
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization


    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, password=None)
    except ValueError as exc:
        raise ConfigError(f"TLS: damaged {key_path} or {cert_path} ({exc}); remove both to make new ones") from None
    pub = serialization.PublicFormat.SubjectPublicKeyInfo
    if cert.public_key().public_bytes(serialization.Encoding.DER, pub) != key.public_key().public_bytes(
            serialization.Encoding.DER, pub):
        raise ConfigError(f"TLS: {cert_path} does not match {key_path}; remove both to make new ones")
    return Identity(key_path, cert_path, fingerprint(cert.public_bytes(serialization.Encoding.DER)))


def _exists(path: Path) -> bool:
    try:
        os.lstat(path)
        return True
    except FileNotFoundError:
        return False


def _read_private(path: Path, secret: bool) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise ConfigError(f"TLS: cannot open {path}: {exc.strerror or exc} (a symlink is refused)") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"TLS: {path} is not a regular file")
        if st.st_uid != os.geteuid():
            raise ConfigError(f"TLS: {path} belongs to uid {st.st_uid}, not to this daemon's user")
        if secret and st.st_mode & 0o077:
            raise ConfigError(f"TLS: {path} is readable by other users (mode {stat.S_IMODE(st.st_mode):o})")
        data = os.read(fd, _MAX_PEM + 1)
    finally:
        os.close(fd)
    if len(data) > _MAX_PEM:
        raise ConfigError(f"TLS: {path} is too large")
    return data


def _create(key_path: Path, cert_path: Path, common_name: str) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64] or "gpusd")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    _write_new(key_path, key_pem)
    try:
        _write_new(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    except BaseException:
        os.unlink(key_path)
        raise


def _write_new(path: Path, data: bytes) -> None:
    """Create ``path`` (never an existing file, never through a symlink), mode 0600, with ``data``."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise ConfigError(f"TLS: cannot create {path}: {exc.strerror or exc}") from None
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
