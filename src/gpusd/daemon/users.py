"""Who signed a write: the local account whose SSH key it is (docs/security.md, "Identity").

A remote write carries the user's SSHSIG signature (:mod:`gpusd.wire.sshsig`) over the fleet
signature's base, which covers the account the user acts as (``Gpusd-User``, gpusd 0.4).  The daemon
(root) checks that account only, as sshd checks the ``authorized_keys`` of the account a login names
(listing someone else's public key in one's own file lets them in as oneself, nothing more):

1. the users file (``/etc/gpusd/users``, or ``$GPUSD_USERS`` for tests) mapping the key to that name:
   lines ``NAME [options] TYPE BASE64 [comment]``, the file a regular file owned by root and writable
   by nobody else (for accounts without home directories);
2. else that account's ``~/.ssh/authorized_keys``, read as sshd's StrictModes would: the home opened
   as named, then ``.ssh`` and ``authorized_keys`` with ``O_NOFOLLOW`` relative to it (no symlink
   under the home is followed), each owned by the account (or root) and writable by nobody else, the
   file regular and at most :data:`MAX_FILE` bytes.  A file that fails a check is skipped (logged
   once) as sshd would skip it.

Lines are read as sshd reads them (:func:`parse_entry`, after OpenSSH's sshauthopt_parse): a line
whose options sshd refuses lists no key, logged once.  ``from=`` is matched against the peer address
the daemon sees as sshd's match_host_and_ip does with ``UseDNS no`` (:func:`from_allows`);
``expiry-time=`` past means no key; ``command=`` (a forced command: the key cannot run gpusd on this
host over ssh) and ``cert-authority`` lines are not identities.  ``restrict`` and the ``no-*``
options limit forwarding and terminals, not who the key is, so they change nothing here.

A request that names no account (a client before 0.4) is attributed by searching every account: a
key that several accounts list then names nobody (refused) — except root with one other account: the
other one.  A key the account does not list gets a refusal that says what to set up.
"""

# Imports inside functions: memory at rest (loaded on request).
from __future__ import annotations

import base64
import calendar
import ipaddress
import logging
import os
import pwd
import re
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

USERS_FILE = "/etc/gpusd/users"
USERS_ENV = "GPUSD_USERS"
MAX_FILE = 1 << 20
MAX_LINE = 16384
MAX_NAME = 32


class Refused(Exception):
    """A key that names no account (or an ambiguous one): the message says what to set up."""


@dataclass(frozen=True)
class Account:
    """The account a verified key belongs to."""

    name: str
    # None: a name of the users file that is no local account
    uid: int | None
    # the key's fingerprint (SHA256:...)
    key: str
    # "authorized_keys" or "users file"
    via: str

    @property
    def is_root(self) -> bool:
        return self.uid == 0


@dataclass
class Entry:
    blob: bytes
    options: dict[str, str] = field(default_factory=dict)
    flags: frozenset[str] = frozenset()
    # expiry-time, seconds since the epoch (the earliest given)
    valid_before: float | None = None


class BadOptions(ValueError):
    """An options field sshd refuses: the whole line lists no key (the message is sshd's reason)."""


# sshd's options (auth-options.c, sshauthopt_parse), in the order it tries them: flags (True: may be
# negated with "no-") and options with a quoted value (True: allowed once only)
_FLAGS = (("restrict", False), ("cert-authority", False), ("port-forwarding", True), ("agent-forwarding", True),
          ("x11-forwarding", True), ("touch-required", True), ("verify-required", True), ("pty", True),
          ("user-rc", True))
_VALUED = (("command", True), ("principals", True), ("from", True), ("expiry-time", False),
           ("environment", False), ("permitopen", False), ("permitlisten", False), ("tunnel", False))
# sshd's SSH_AUTHOPT_ENV_MAX
MAX_ENV = 1024


def _dequote(text: str, i: int) -> tuple[str, int]:
    """sshd's opt_dequote: the quoted value at ``text[i]`` (only ``\\"`` is an escape) and the index
    after its closing quote."""
    if i >= len(text) or text[i] != '"':
        raise BadOptions("missing start quote")
    i += 1
    out: list[str] = []
    while i < len(text) and text[i] != '"':
        if text[i] == "\\" and i + 1 < len(text) and text[i + 1] == '"':
            i += 1
        out.append(text[i])
        i += 1
    if i >= len(text):
        raise BadOptions("missing end quote")
    return "".join(out), i + 1


def parse_options(text: str) -> tuple[dict[str, str], set[str], float | None]:
    """An authorized_keys options field as sshd reads it (sshauthopt_parse): (valued options, flags
    set, the earliest expiry-time); :class:`BadOptions` for a field sshd refuses -- an unknown option
    (``frm=``), a second ``from=``/``command=``/``principals=``, an unquoted or unterminated value, an
    expiry-time it cannot read, a bad ``environment``/``permitopen``/``permitlisten``/``tunnel``."""
    opts: dict[str, str] = {}
    flags: set[str] = set()
    valid_before: float | None = None
    envs = 0
    i, n = 0, len(text)
    while i < n and text[i] not in " \t":
        low = text[i:i + 40].lower()
        for name, negatable in _FLAGS:
            neg = negatable and low.startswith("no-")
            if low[3 if neg else 0:].startswith(name):
                i += len(name) + (3 if neg else 0)
                flags.add(("no-" if neg else "") + name)
                break
        else:
            for name, once in _VALUED:
                if low.startswith(name + "="):
                    if once and name in opts:
                        raise BadOptions(f'multiple "{name}" clauses')
                    value, i = _dequote(text, i + len(name) + 1)
                    if name == "expiry-time":
                        when = parse_expiry(value)
                        valid_before = when if valid_before is None else min(valid_before, when)
                    elif name == "environment":
                        envs += 1
                        env_name, eq, _ = value.partition("=")
                        if envs > MAX_ENV or not eq or not env_name or \
                                not all(c.isascii() and (c.isalnum() or c == "_") for c in env_name):
                            raise BadOptions("invalid environment string")
                    elif name in ("permitopen", "permitlisten"):
                        _check_permit(name, value)
                    elif name == "tunnel":
                        if not value.isdigit() or not value.isascii() or int(value) > 0x7FFFFFFD:
                            raise BadOptions("invalid tun device")
                    opts[name] = value
                    break
            else:
                raise BadOptions("unsupported option")
        if i >= n or text[i] in " \t":
            break
        if text[i] != ",":
            raise BadOptions("unknown key option")
        i += 1
        if i >= n:
            raise BadOptions("unexpected end-of-options")
    return opts, flags, valid_before


def _check_permit(name: str, value: str) -> None:
    """sshd's check of a ``permitopen``/``permitlisten`` value: ``host:port`` (``[v6]:port``), the
    port a number 1-65535 or ``*``; ``permitlisten`` also takes a port alone."""
    host, port = value, None
    if value.startswith("["):
        end = value.find("]")
        host, rest = (value[1:end], value[end + 1:]) if end > 0 else ("", "")
        port = rest[1:] if rest.startswith(":") else None
    elif ":" in value:
        host, _, port = value.rpartition(":")
    elif name == "permitlisten":
        host, port = "localhost", value
    if not host or len(host) >= 1025:
        raise BadOptions("invalid permission hostname")
    if port is None or (port != "*" and not (port.isascii() and port.isdigit() and 0 < int(port) < 65536)):
        raise BadOptions("invalid permission port")


def parse_expiry(value: str) -> float:
    """sshd's parse_absolute_time: ``YYYYMMDD``, ``YYYYMMDDHHMM`` or ``YYYYMMDDHHMMSS``, local time, or
    UTC with a ``Z`` (or ``UTC``) suffix, any case; :class:`BadOptions` otherwise."""
    text, utc = value, False
    if len(text) > 1 and text[-1] in "zZ":
        text, utc = text[:-1], True
    elif len(text) > 3 and text[-3:].upper() == "UTC":
        text, utc = text[:-3], True
    fmt = {8: "%Y%m%d", 12: "%Y%m%d%H%M", 14: "%Y%m%d%H%M%S"}.get(len(text))
    if fmt is None or not text.isascii() or not text.isdigit():
        raise BadOptions("invalid expires time")
    try:
        tm = time.strptime(text, fmt)
        when = float(calendar.timegm(tm) if utc else time.mktime(tm))
    except (ValueError, OverflowError):
        raise BadOptions("invalid expires time") from None
    if when <= 0:
        raise BadOptions("invalid expires time")
    return when


def _skip_options(line: str) -> int:
    """sshd's sshkey_advance_past_options: the index where the options field ends (a space or tab
    outside quotes; ``\\"`` is skipped whole); -1 for an unterminated quote."""
    quoted, i = False, 0
    while i < len(line) and (quoted or line[i] not in " \t"):
        if line[i] == "\\" and i + 1 < len(line) and line[i + 1] == '"':
            i += 1
        elif line[i] == '"':
            quoted = not quoted
        i += 1
    return -1 if quoted and i >= len(line) else i


def parse_entry(line: str) -> tuple[Entry | None, str | None]:
    """One authorized_keys line as sshd reads it: (the entry, None); (None, None) for comments, blank
    lines, unsupported key types and broken keys (sshd goes on to the next line); (None, why) for a
    line whose options sshd refuses (the key is not listed at all)."""
    from ..wire.sshsig import KEY_TYPES, SshSigError, parse_public

    line = line.strip()
    if not line or line.startswith("#"):
        return None, None
    if len(line) > MAX_LINE:
        return None, f"a line longer than {MAX_LINE} characters"
    options = ""
    if line.split(None, 1)[0] not in KEY_TYPES:
        end = _skip_options(line)
        if end < 0:
            return None, "invalid key option string (unterminated quote)"
        options, line = line[:end], line[end:].strip()
    try:
        blob = parse_public(line)
    except SshSigError:
        return None, None
    try:
        opts, flags, valid_before = parse_options(options)
    except BadOptions as exc:
        return None, f"bad key options: {exc}"
    return Entry(blob, opts, frozenset(flags), valid_before), None


def parse_line(line: str) -> Entry | None:
    """One authorized_keys line; None for comments, blank lines, unsupported types, broken keys and
    lines whose options sshd refuses (:func:`parse_entry` says why)."""
    return parse_entry(line)[0]


def match_pattern(text: str, pattern: str) -> bool:
    """OpenSSH's match_pattern (match.c): ``*`` any run of characters, ``?`` one; every other
    character, ``[`` included, stands for itself."""
    rx = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    return re.fullmatch(rx, text, re.DOTALL) is not None


def _cidr(pat: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None | bool:
    """sshd's addr_pton_cidr: the network of ``addr[/len]``; None when it is no address (then a
    wildcard pattern); False for an address with host bits set or a bad length (the list is broken)."""
    addr_text, slash, length = pat.partition("/")
    if slash and (not length or not length.isascii() or not length.isdigit() or int(length) > 128):
        return None
    try:
        addr = ipaddress.ip_address(addr_text)
    except ValueError:
        return None
    bits = int(length) if slash else addr.max_prefixlen
    if bits > addr.max_prefixlen:
        return False
    try:
        return ipaddress.ip_network(f"{addr}/{bits}", strict=True)
    except ValueError:
        return False


def from_allows(patterns: str, peer: str | None) -> bool:
    """sshd's ``from=`` check (match_host_and_ip) for the peer address, with ``UseDNS no``: the host
    name sshd matches is the address itself.  Address entries (CIDR, or addresses) and wildcard
    patterns (``*``, ``?`` only: a ``[0-9]`` is literal); ``!`` negates; a broken entry (empty,
    host bits set, a bad length) makes the whole list refuse."""
    if not peer:
        return False
    addr_text = peer.split("%", 1)[0]
    try:
        addr = ipaddress.ip_address(addr_text)
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped
        addr_text = str(addr)
    except ValueError:
        return False
    # addr_match_list
    mip = 0
    for raw in patterns.split(","):
        neg = raw.startswith("!")
        pat = raw[1:] if neg else raw
        if not pat:
            return False
        net = _cidr(pat)
        if net is False:
            return False
        hit = (addr in net) if net is not None and not isinstance(net, bool) else match_pattern(addr_text, pat)
        if hit:
            if neg:
                mip = -1
                break
            mip = 1
    if mip == -1:
        return False
    # match_hostname: the same list as host-name patterns (lower-cased), against the address text
    mhost = 0
    for raw in patterns.split(","):
        neg = raw.startswith("!")
        pat = (raw[1:] if neg else raw).lower()
        if len(pat) >= 1023:
            return False
        if match_pattern(addr_text.lower(), pat):
            if neg:
                return False
            mhost = 1
    return bool(mhost or mip)


def why_not(entry: Entry, peer: str | None, now: float | None = None) -> str | None:
    """Why a listed key does not stand for its account for this request (None: it does)."""
    if "cert-authority" in entry.flags:
        return "a cert-authority line (certificates are not supported)"
    if "command" in entry.options:
        return "listed with command= (a forced command: not a gpusd identity)"
    if entry.valid_before is not None and entry.valid_before < (time.time() if now is None else now):
        return "its expiry-time has passed"
    if "from" in entry.options and not from_allows(entry.options["from"], peer):
        return f"its from= does not allow the address {peer}"
    return None


# -- reading files safely ---------------------------------------------------------------------------
def _dir_ok(st: os.stat_result, uid: int) -> bool:
    return st.st_uid in (uid, 0) and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def read_authorized_keys(home: str, uid: int) -> tuple[bytes | None, str | None]:
    """The bytes of ``home/.ssh/authorized_keys`` (None, why) when it cannot be trusted: a symlink
    anywhere under the home, a file or directory of another user or writable by others, not a regular
    file, larger than :data:`MAX_FILE`."""
    if not home.startswith("/"):
        return None, "no home directory"
    fds: list[int] = []
    try:
        try:
            fds.append(os.open(home, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
            if not _dir_ok(os.fstat(fds[-1]), uid):
                return None, f"{home} belongs to another user or is writable by others"
            fds.append(os.open(".ssh", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fds[-1]))
            if not _dir_ok(os.fstat(fds[-1]), uid):
                return None, f"{home}/.ssh belongs to another user or is writable by others"
            fds.append(os.open("authorized_keys", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                               dir_fd=fds[-1]))
        except FileNotFoundError:
            # nothing listed: not a problem to report
            return None, None
        except OSError as exc:
            # ELOOP: a symlink; ENOTDIR; EACCES
            return None, f"{home}/.ssh/authorized_keys cannot be read safely ({exc.strerror})"
        st = os.fstat(fds[-1])
        if not stat.S_ISREG(st.st_mode):
            return None, f"{home}/.ssh/authorized_keys is not a regular file"
        if not _dir_ok(st, uid):
            return None, f"{home}/.ssh/authorized_keys belongs to another user or is writable by others"
        data = os.read(fds[-1], MAX_FILE + 1)
        if len(data) > MAX_FILE:
            return None, f"{home}/.ssh/authorized_keys is larger than {MAX_FILE} bytes"
        return data, None
    finally:
        for fd in reversed(fds):
            os.close(fd)


def read_users_file(path: str) -> tuple[bytes | None, str | None]:
    """The users file's bytes, or (None, why) when it is missing (no why) or cannot be trusted."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"{path} cannot be read safely ({exc.strerror})"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return None, f"{path} must be a regular file owned by root and writable by nobody else"
        data = os.read(fd, MAX_FILE + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_FILE:
        return None, f"{path} is larger than {MAX_FILE} bytes"
    return data, None


def _valid_name(name: str) -> bool:
    return (0 < len(name) <= MAX_NAME and name.isascii() and (name[0].isalpha() or name[0] == "_")
            and all(c.isalnum() or c in "._-" for c in name))


class Directory:
    """The keys of this host's accounts, re-read as the files change (``who``)."""

    def __init__(self, users_file: str | None = None,
                 accounts: Callable[[], Iterable[Any]] | None = None) -> None:
        self.users_file = users_file
        self._accounts = accounts
        self._warned: set[str] = set()

    def _warn(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            log.warning("ignoring %s", message)

    def _users_path(self) -> str:
        return self.users_file or os.environ.get(USERS_ENV) or USERS_FILE

    def _passwd(self) -> Iterable[Any]:
        if self._accounts is not None:
            return self._accounts()

        return pwd.getpwall()

    def _entries(self, text: str, where: str) -> Iterable[Entry]:
        """The entries of an authorized_keys text; a line sshd refuses lists nothing (logged once)."""
        for number, line in enumerate(text.splitlines(), 1):
            entry, why = parse_entry(line)
            if why is not None:
                self._warn(f"{where} line {number}: {why} (sshd refuses the whole line)")
            if entry is not None:
                yield entry

    def _mapped(self, blob: bytes, peer: str | None, reasons: list[str],
                only: str | None = None) -> str | None:
        """The name the users file maps ``blob`` to (only ``only``'s lines when given), or None."""
        path = self._users_path()
        data, problem = read_users_file(path)
        if problem:
            self._warn(problem)
        for number, raw in enumerate((data or b"").decode("utf-8", "replace").splitlines(), 1):
            name, _, rest = raw.strip().partition(" ")
            if not name or name.startswith("#") or (only is not None and name != only):
                continue
            entry, why = parse_entry(rest)
            if why is not None:
                self._warn(f"{path} line {number}: {why} (the whole line is refused)")
            if entry is None or entry.blob != blob:
                continue
            if not _valid_name(name):
                self._warn(f"{path}: {name[:40]!r} is not a user name")
                continue
            refused = why_not(entry, peer)
            if refused is not None:
                reasons.append(f"{path} maps it to {name} but {refused}")
                continue
            return name
        return None

    def who(self, blob: bytes, peer: str | None, host: str = "this host", account: str | None = None) -> Account:
        """The account of the key ``blob`` for a request from ``peer``; :class:`Refused` otherwise.

        ``account``: the account the signer names (covered by its signature, ``Gpusd-User``): only
        that account's lines of the users file and its own ``authorized_keys`` are read, as sshd
        reads the file of the user a login names -- listing someone's public key in one's own file
        lets its holder in as oneself, never locks them out of their own account.  None (a client
        before gpusd 0.4): every account is searched, and a key several accounts list names nobody."""
        if account is not None:
            return self._named(blob, peer, host, account)
        from ..wire.sshsig import fingerprint

        fp = fingerprint(blob)
        reasons: list[str] = []
        name = self._mapped(blob, peer, reasons)
        if name is not None:
            return Account(name, _uid_of(name), fp, "users file")

        # a cheap pre-filter: a listed key's base64 is in the file
        needle = base64.b64encode(blob)
        found: list[tuple[str, int]] = []
        for pw in self._passwd():
            text, problem = read_authorized_keys(pw.pw_dir, pw.pw_uid)
            if problem:
                self._warn(problem)
            if text is None or needle not in text:
                continue
            for entry in self._entries(text.decode("utf-8", "replace"), f"{pw.pw_dir}/.ssh/authorized_keys"):
                if entry.blob != blob:
                    continue
                why = why_not(entry, peer)
                if why is None:
                    found.append((pw.pw_name, pw.pw_uid))
                    break
                reasons.append(f"{pw.pw_name}'s authorized_keys lists it but {why}")
        if len(found) > 1:
            others = [f for f in found if f[1] != 0]
            if len(others) == 1:
                found = others
            else:
                names = ", ".join(sorted({n for n, _ in found}))
                raise Refused(f"the key {fp} is listed by several accounts on {host} ({names}): gpusd cannot "
                              "tell whose it is; keep it in one account's ~/.ssh/authorized_keys, or map it in "
                              f"{USERS_FILE} (or upgrade the client to gpusd 0.4, which names its account)")
        if found:
            return Account(found[0][0], found[0][1], fp, "authorized_keys")
        detail = f" ({'; '.join(reasons)[:300]})" if reasons else ""
        raise Refused(f"the key {fp} is not listed for any account on {host}{detail}: add its public key to "
                      f"your ~/.ssh/authorized_keys there, or ask the administrator to map it to your name in "
                      f"{USERS_FILE}")

    def _named(self, blob: bytes, peer: str | None, host: str, account: str) -> Account:
        from ..wire.sshsig import fingerprint

        fp = fingerprint(blob)
        if not _valid_name(account):
            raise Refused(f"the signature names {account[:40]!r}, which is not an account name")
        reasons: list[str] = []
        if self._mapped(blob, peer, reasons, only=account) is not None:
            return Account(account, _uid_of(account), fp, "users file")
        pw = next((p for p in self._passwd() if p.pw_name == account), None) if self._accounts is not None \
            else _getpwnam(account)
        if pw is not None:
            text, problem = read_authorized_keys(pw.pw_dir, pw.pw_uid)
            if problem:
                self._warn(problem)
                reasons.append(problem)
            for entry in self._entries((text or b"").decode("utf-8", "replace"),
                                       f"{pw.pw_dir}/.ssh/authorized_keys"):
                if entry.blob != blob:
                    continue
                why = why_not(entry, peer)
                if why is None:
                    return Account(pw.pw_name, pw.pw_uid, fp, "authorized_keys")
                reasons.append(f"{account}'s authorized_keys lists it but {why}")
        detail = f" ({'; '.join(reasons)[:300]})" if reasons else ""
        raise Refused(f"the key {fp} is not listed for the account {account} on {host}{detail}: add its public "
                      f"key to ~{account}/.ssh/authorized_keys there, ask the administrator to map it to {account} "
                      f"in {USERS_FILE}, or sign as the account that lists it ($GPUSD_ACCOUNT)")


def _getpwnam(name: str) -> Any:
    try:
        return pwd.getpwnam(name)
    except KeyError:
        return None


def _uid_of(name: str) -> int | None:
    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        return None
