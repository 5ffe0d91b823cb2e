"""How a notice is delivered: a shell command, a signed JSON POST, or a mail (docs/notify.md).

Each target is checked when it is made (a URL that is not http(s), an address that is not one, a
secret file others can read: :class:`gpusd.errors.ConfigError` before anything waits) and its
delivery is bounded: every network step has a timeout, retries are counted, and a receiver that
never answers costs at most ``attempts * timeout`` plus the back-off, never a hang.  Nothing here
runs in the daemon: the notifier is a client process of its own.

The webhook's body is :func:`payload` (schema ``gpusd-notify/1``), its signature
``X-Gpusd-Signature: t=UNIX,v1=HEX``: HMAC-SHA256 over ``"UNIX." + body`` with the secret file's
first line, so that a receiver can refuse a replay older than it likes."""

from __future__ import annotations

import getpass
import hashlib
import hmac
import json
import logging
import os
import re
import shutil
import smtplib
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from email.message import EmailMessage
from email.utils import formatdate, make_msgid
from typing import Any, Protocol
from urllib.parse import urlsplit

from .._version import __version__
from ..errors import ConfigError, GpusdError
from ..sanitize import for_terminal, printable
from ..wire.signing import read_secret_file

log = logging.getLogger("gpusd.notify")

# the webhook body's version: fields are only ever added (docs/notify.md)
SCHEMA = "gpusd-notify/1"
EVENT = "gpus_free"
MAX_URL = 2048
# bytes: a shorter HMAC key is guessable
MIN_WEBHOOK_SECRET = 16
SIGNATURE_HEADER = "X-Gpusd-Signature"
DELIVERY_HEADER = "X-Gpusd-Delivery"


@dataclass(frozen=True)
class Gpu:
    """One GPU of a notice: its index on its host, UUID and shown name (all already bounded)."""

    index: int
    uuid: str
    name: str = ""


@dataclass(frozen=True)
class Notice:
    """What is told: ``count`` GPUs of ``host`` qualified (``fleet``: found among the fleet's verified
    hosts).  ``sequence`` counts the notices of one watch (``--repeat``), from 1.  ``time`` is the
    wall clock, for display only."""

    host: str
    node_id: str | None
    gpus: tuple[Gpu, ...]
    fleet: bool = False
    sequence: int = 1
    time: float = field(default_factory=time.time)

    @property
    def count(self) -> int:
        return len(self.gpus)


_UUID = re.compile(r"[A-Za-z0-9_.:/-]{1,96}")


def clean_gpu(index: object, uuid_: object, name: object) -> Gpu | None:
    """A GPU as a (possibly remote) snapshot gave it, bounded and typed: None when its index or UUID
    cannot be passed on as they are (they go into a shell's environment and a JSON body)."""
    if type(index) is not int or not 0 <= index < 1 << 16:
        return None
    if not isinstance(uuid_, str) or not _UUID.fullmatch(uuid_):
        return None
    return Gpu(index, uuid_, for_terminal(name or "", 96))


def clean_host(name: object) -> str:
    """A host name to pass on: printable, bounded (it may come from the network)."""
    return for_terminal(name or "?", 253)


def payload(n: Notice, delivery: str) -> dict[str, Any]:
    """The webhook's JSON body (``gpusd-notify/1``, docs/notify.md)."""
    return {"schema": SCHEMA, "event": EVENT, "delivery": delivery, "sequence": n.sequence,
            "time": round(n.time, 3), "fleet": n.fleet, "count": n.count,
            "host": {"name": n.host, "node_id": n.node_id},
            "gpus": [{"index": g.index, "uuid": g.uuid, "name": g.name} for g in n.gpus]}


def variables(n: Notice) -> dict[str, str]:
    """The ``GPUSD_NOTIFY_*`` variables an ``--exec`` command gets."""
    return {"GPUSD_NOTIFY_HOST": n.host, "GPUSD_NOTIFY_NODE": n.node_id or "",
            "GPUSD_NOTIFY_COUNT": str(n.count),
            "GPUSD_NOTIFY_GPUS": ",".join(str(g.index) for g in n.gpus),
            "GPUSD_NOTIFY_UUIDS": ",".join(g.uuid for g in n.gpus),
            "GPUSD_NOTIFY_FLEET": "1" if n.fleet else "0", "GPUSD_NOTIFY_SEQUENCE": str(n.sequence),
            "GPUSD_NOTIFY_TIME": f"{n.time:.3f}"}


def summary(n: Notice) -> str:
    where = f"on {n.host}" if n.fleet else f"on this machine ({n.host})"
    return f"{n.count} GPU(s) free {where}: {', '.join(str(g.index) for g in n.gpus)}"


class Target(Protocol):
    """Where a notice goes.  ``deliver`` raises :class:`GpusdError` (one line) when it could not."""

    def deliver(self, n: Notice) -> None: ...

    def describe(self) -> str: ...


# -- --exec ---------------------------------------------------------------------------------------------
@dataclass
class Exec:
    """``CMD`` run through ``/bin/sh -c`` with :func:`variables` added to this process's environment;
    the notifier waits for it (the command is the user's own action: it is not cut short)."""

    command: str

    def __post_init__(self) -> None:
        if not self.command.strip():
            raise ConfigError("--exec needs a command")
        if "\x00" in self.command:
            raise ConfigError("--exec: the command contains a NUL byte")

    def deliver(self, n: Notice) -> None:
        env = dict(os.environ, **variables(n))
        try:
            rc = subprocess.run(["/bin/sh", "-c", self.command], env=env, stdin=subprocess.DEVNULL).returncode
        except OSError as exc:
            raise GpusdError(f"--exec: cannot run /bin/sh: {exc.strerror or exc}") from None
        if rc != 0:
            raise GpusdError(f"--exec: the command exited with status {rc}")

    def describe(self) -> str:
        return "the command"


# -- --webhook ------------------------------------------------------------------------------------------
def check_url(url: str) -> str:
    """``url`` when it is an http(s) URL with a host (and no user:password, which ``ps`` would show);
    :class:`ConfigError` otherwise."""
    shown = for_terminal(url, 120)
    if len(url) > MAX_URL:
        raise ConfigError(f"--webhook: the URL is longer than {MAX_URL} characters")
    if not url.isprintable() or any(c.isspace() for c in url):
        raise ConfigError(f"--webhook: the URL contains white space or control characters: {shown!r}")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (raises ValueError for a port out of range)
    except ValueError as exc:
        raise ConfigError(f"--webhook: not a URL ({exc}): {shown!r}") from None
    if parts.scheme.lower() not in ("http", "https"):
        raise ConfigError(f"--webhook: only http:// and https:// URLs are posted to, not {shown!r}")
    if not parts.hostname:
        raise ConfigError(f"--webhook: the URL names no host: {shown!r}")
    if "@" in parts.netloc:
        raise ConfigError("--webhook: a URL with user:password@ is refused (every local user sees a command "
                          "line); sign with --webhook-secret-file instead")
    return url


def read_webhook_secret(path: str | os.PathLike[str]) -> bytes:
    """The HMAC key in ``path``: its first line, checked as the fleet secret's file is (a regular file,
    not a symlink, not readable by others: :func:`gpusd.wire.signing.read_secret_file`)."""

    value = read_secret_file(path, what="the webhook secret file")
    if len(value.encode()) < MIN_WEBHOOK_SECRET:
        raise ConfigError(f"the webhook secret file {os.fspath(path)!r}: the secret must be at least "
                          f"{MIN_WEBHOOK_SECRET} bytes (make one with: openssl rand -hex 32)")
    return value.encode()


def sign(secret: bytes, body: bytes, when: int) -> str:
    """The ``X-Gpusd-Signature`` value of ``body`` sent at ``when`` (unix seconds)."""
    mac = hmac.new(secret, str(when).encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"t={when},v1={mac}"


def verify(secret: bytes, body: bytes, header: str, now: float | None = None, tolerance: float = 300.0) -> bool:
    """What a receiver checks (written here so the docs' recipe is tested): the signature matches and
    was made within ``tolerance`` seconds of ``now``."""
    fields = dict(part.split("=", 1) for part in header.split(",") if "=" in part)
    try:
        when = int(fields.get("t", ""))
    except ValueError:
        return False
    if abs((time.time() if now is None else now) - when) > tolerance:
        return False
    return hmac.compare_digest(sign(secret, body, when), f"t={when},v1={fields.get('v1', '')}")


def _opener() -> Any:
    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: Any, **kw: Any) -> None:
            # a redirect is the receiver's answer: never followed (another host, another scheme)
            return None

    return urllib.request.build_opener(NoRedirect)


RETRY_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


@dataclass
class Webhook:
    """A JSON POST of :func:`payload` to ``url``, signed with ``secret`` when given; ``attempts`` tries
    at most, each bounded by ``timeout`` seconds, ``backoff`` seconds before the second, doubling
    (capped at 8 s).  One delivery id for every try of one notice, so that a receiver can drop
    repeats."""

    url: str
    secret: bytes | None = None
    timeout: float = 5.0
    attempts: int = 4
    backoff: float = 0.5

    def __post_init__(self) -> None:
        check_url(self.url)
        if not 0 < self.timeout <= 300:
            raise ConfigError(f"--webhook-timeout must be between 0 and 300 seconds, not {self.timeout:g}")
        if not 1 <= self.attempts <= 20:
            raise ConfigError(f"--webhook-attempts must be from 1 to 20, not {self.attempts}")
        self._opener = _opener()

    def describe(self) -> str:
        p = urlsplit(self.url)
        # not the query: it may hold a token
        return for_terminal(f"{p.scheme}://{p.netloc}{p.path}", 120)

    def post(self, body: bytes, delivery: str) -> int:
        """One try: the HTTP status (raises OSError for no answer, a refused connection, a timeout)."""

        headers = {"Content-Type": "application/json", "User-Agent": _agent(), DELIVERY_HEADER: delivery,
                   "X-Gpusd-Event": EVENT}
        if self.secret is not None:
            headers[SIGNATURE_HEADER] = sign(self.secret, body, int(time.time()))
        req = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        try:
            with self._opener.open(req, timeout=self.timeout) as resp:
                # bounded: the answer's body means nothing to us
                resp.read(65536)
                return int(resp.status)
        except urllib.error.HTTPError as exc:
            exc.close()
            return int(exc.code)
        except urllib.error.URLError as exc:
            reason = exc.reason
            raise OSError(str(getattr(reason, "strerror", None) or reason)) from None
        except (TimeoutError, ConnectionError) as exc:
            raise OSError(str(exc) or type(exc).__name__) from None
        except Exception as exc:  # noqa: BLE001  (http.client's BadStatusLine, RemoteDisconnected, ...)
            raise OSError(f"{type(exc).__name__}: {exc}") from None

    def deliver(self, n: Notice) -> None:
        delivery = uuid.uuid4().hex
        body = json.dumps(payload(n, delivery), separators=(",", ":")).encode()
        why = ""
        for attempt in range(self.attempts):
            if attempt:
                time.sleep(min(8.0, self.backoff * 2 ** (attempt - 1)))
            try:
                status = self.post(body, delivery)
            except OSError as exc:
                why = for_terminal(str(exc) or "no answer", 120)
                if "timed out" in why:
                    why = f"no answer within {self.timeout:g}s"
                log.info("webhook %s: try %d: %s", self.describe(), attempt + 1, why)
                continue
            if 200 <= status < 300:
                return
            why = f"HTTP {status}"
            if status not in RETRY_STATUS:
                # the receiver said no (or moved): trying again would not change it
                break
        raise GpusdError(f"--webhook {self.describe()}: not delivered after {attempt + 1} tr"
                         f"{'y' if attempt == 0 else 'ies'}: {why}")


def _agent() -> str:
    return f"gpusd/{__version__} (notify)"


# -- --mail ---------------------------------------------------------------------------------------------
_ADDRESS = re.compile(r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~.-]{1,64}@[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?")


def check_address(addr: str, flag: str = "--mail") -> str:
    """``addr`` when it is one plain mail address (``user@host``): no name part, no second address,
    no white space or header break; :class:`ConfigError` otherwise."""
    if len(addr) > 254 or not _ADDRESS.fullmatch(addr) or addr.startswith("-"):
        raise ConfigError(f"{flag}: not one plain mail address (user@host): {for_terminal(addr, 80)!r}")
    return addr


def check_smtp(hostport: str) -> tuple[str, int]:
    """``HOST[:PORT]`` (default port 25; ``[v6]:PORT`` for an IPv6 address)."""
    m = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\](?::(\d{1,5}))?|([A-Za-z0-9.-]{1,253})(?::(\d{1,5}))?", hostport)
    if m is None:
        raise ConfigError(f"--smtp: not HOST[:PORT]: {for_terminal(hostport, 80)!r}")
    host, port = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
    number = int(port) if port else 25
    if not 0 < number < 65536:
        raise ConfigError(f"--smtp: the port must be from 1 to 65535, not {number}")
    return host, number


def find_sendmail(path: str | None = None) -> str | None:
    """The local MTA's ``sendmail`` (on ``$PATH``, else where Debian and others put it)."""
    search = os.pathsep.join(p for p in ((path if path is not None else os.environ.get("PATH", "")),
                                         "/usr/sbin", "/usr/lib") if p)
    return shutil.which("sendmail", path=search)


def default_sender() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001
        user = str(os.geteuid())
    sender = f"{user}@{socket.gethostname()}"
    return sender if _ADDRESS.fullmatch(sender) else "gpusd@localhost"


@dataclass
class Mail:
    """A mail to ``to``: through ``smtp`` (``HOST[:PORT]``, smtplib, ``timeout`` per step, STARTTLS
    where the server offers it) or else the local MTA's ``sendmail`` (bounded by ``timeout`` too)."""

    to: str
    smtp: str | None = None
    sender: str | None = None
    timeout: float = 30.0
    attempts: int = 3
    backoff: float = 1.0
    _hostport: tuple[str, int] | None = None
    _sendmail: str | None = None

    def __post_init__(self) -> None:
        check_address(self.to)
        self.sender = check_address(self.sender, "--mail-from") if self.sender else default_sender()
        if self.smtp is not None:
            self._hostport = check_smtp(self.smtp)
        else:
            self._sendmail = find_sendmail()
            if self._sendmail is None:
                raise ConfigError("--mail: no sendmail found (install a local MTA, or name a mail server with "
                                  "--smtp HOST[:PORT])")

    def describe(self) -> str:
        return self.to

    def message(self, n: Notice) -> bytes:
        msg = EmailMessage()
        msg["From"] = self.sender
        msg["To"] = self.to
        msg["Subject"] = printable(f"gpusd: {summary(n)}", 200)
        msg["Date"] = formatdate(n.time, localtime=True)
        msg["Message-ID"] = make_msgid("gpusd-notify")
        lines = [summary(n) + ".", ""]
        lines += [f"  GPU {g.index}  {g.uuid}  {g.name}" for g in n.gpus]
        lines += ["", "This is a notice, not a lease: the GPUs may be taken by the time you act "
                  "(gpusd run --wait holds them).", ""]
        msg.set_content("\n".join(lines))
        return msg.as_bytes()

    def deliver(self, n: Notice) -> None:
        data = self.message(n)
        if self._hostport is None:
            assert self._sendmail is not None
            try:
                r = subprocess.run([self._sendmail, "-oi", self.to], input=data, capture_output=True,
                                   timeout=self.timeout)
            except subprocess.TimeoutExpired:
                raise GpusdError(f"--mail: sendmail did not finish within {self.timeout:g}s") from None
            except OSError as exc:
                raise GpusdError(f"--mail: cannot run {self._sendmail}: {exc.strerror or exc}") from None
            if r.returncode != 0:
                err = for_terminal(r.stderr.decode(errors="replace").strip().splitlines()[-1:] or [""], 200)
                raise GpusdError(f"--mail: sendmail exited with status {r.returncode}: {err}")
            return
        why = ""
        for attempt in range(self.attempts):
            if attempt:
                time.sleep(min(8.0, self.backoff * 2 ** (attempt - 1)))
            try:
                self._smtp(data)
                return
            except Exception as exc:  # noqa: BLE001  (socket errors, smtplib's, a timeout)
                why = for_terminal(f"{type(exc).__name__}: {exc}", 160)
                log.info("smtp %s: try %d: %s", self.smtp, attempt + 1, why)

                if isinstance(exc, smtplib.SMTPRecipientsRefused | smtplib.SMTPSenderRefused):
                    # the server said no: again would be no too
                    break
        raise GpusdError(f"--mail {self.to} through {for_terminal(self.smtp, 80)}: not delivered: {why}")

    def _smtp(self, data: bytes) -> None:
        assert self._hostport is not None and self.sender is not None
        host, port = self._hostport
        with smtplib.SMTP(host, port, timeout=self.timeout) as s:
            s.ehlo_or_helo_if_needed()
            if s.has_extn("starttls"):
                s.starttls(context=ssl.create_default_context())
                s.ehlo()
            s.sendmail(self.sender, [self.to], data)


def target(*, exec_: str | None = None, webhook: str | None = None, secret_file: str | None = None,
            mail: str | None = None, smtp: str | None = None, mail_from: str | None = None,
            webhook_timeout: float = 5.0, webhook_attempts: int = 4) -> Target:
    """The target a command line names (exactly one of ``exec_``, ``webhook``, ``mail``), checked."""
    given = [x for x in (exec_, webhook, mail) if x is not None]
    if len(given) != 1:
        raise ConfigError("say where to send the notice: one of --exec CMD, --webhook URL or --mail ADDR")
    if secret_file is not None and webhook is None:
        raise ConfigError("--webhook-secret-file signs a --webhook: give one")
    if (smtp is not None or mail_from is not None) and mail is None:
        raise ConfigError("--smtp and --mail-from are for --mail")
    if exec_ is not None:
        return Exec(exec_)
    if webhook is not None:
        # before the secret file: the first thing wrong is said first
        check_url(webhook)
        secret = read_webhook_secret(secret_file) if secret_file is not None else None
        return Webhook(webhook, secret, timeout=webhook_timeout, attempts=webhook_attempts)
    assert mail is not None
    return Mail(mail, smtp=smtp, sender=mail_from)
