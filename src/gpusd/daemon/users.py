"""Who signed a write: the local account whose SSH key it is (docs/security.md, "Identity").

A remote write carries the user's SSHSIG signature (:mod:`gpusd.wire.sshsig`) over the fleet
signature's base.  The daemon (root) attributes the key to an account of this host:

1. the name an administrator maps to the key in the users file (``/etc/gpusd/users``, or
   ``$GPUSD_USERS`` for tests): lines ``NAME [options] TYPE BASE64 [comment]``, the file a regular file
   owned by root and writable by nobody else (for accounts without home directories);
2. else the account whose ``~/.ssh/authorized_keys`` lists the key, read as sshd's StrictModes would:
   the home opened as named, then ``.ssh`` and ``authorized_keys`` with ``O_NOFOLLOW`` relative to it
   (no symlink under the home is followed), each owned by the account (or root) and writable by
   nobody else, the file regular and at most :data:`MAX_FILE` bytes.  A file that fails a check is
   skipped (logged once) as sshd would skip it.

Options: ``from=`` is matched against the peer address the daemon sees (addresses, ``*``/``?``
wildcards, CIDR, ``!`` negation; host names never match: no DNS is asked); ``expiry-time=`` past
means no key; ``command=`` (a forced command: the key cannot run gpusd on this host over ssh) and
``cert-authority`` lines are not identities.  ``restrict`` and the ``no-*`` options limit forwarding
and terminals, not who the key is, so they change nothing here.

A key that several accounts list names nobody (refused) — except root with one other account: the
other one.  A key nobody lists gets a refusal that says what to set up.
"""

from __future__ import annotations

import fnmatch
import ipaddress
import logging
import os
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
    uid: int | None  # None: a name of the users file that is no local account
    key: str  # the key's fingerprint (SHA256:...)
    via: str  # "authorized_keys" or "users file"

    @property
    def is_root(self) -> bool:
        return self.uid == 0


@dataclass
class Entry:
    blob: bytes
    options: dict[str, str] = field(default_factory=dict)
    flags: frozenset[str] = frozenset()


def _split_options(text: str) -> tuple[str, str]:
    """(options, rest) of an authorized_keys line that starts with options (quotes may hold spaces)."""
    quoted, i = False, 0
    while i < len(text):
        c = text[i]
        if c == "\\" and quoted and i + 1 < len(text):
            i += 2
            continue
        if c == '"':
            quoted = not quoted
        elif c in " \t" and not quoted:
            return text[:i], text[i:].strip()
        i += 1
    return text, ""


def _parse_options(text: str) -> tuple[dict[str, str], set[str]]:
    opts: dict[str, str] = {}
    flags: set[str] = set()
    quoted, cur, parts = False, "", []
    i = 0
    while i < len(text):
        c = text[i]
        if c == "\\" and quoted and i + 1 < len(text):
            cur += text[i + 1]
            i += 2
            continue
        if c == '"':
            quoted = not quoted
        elif c == "," and not quoted:
            parts.append(cur)
            cur = ""
        else:
            cur += c
        i += 1
    parts.append(cur)
    for p in parts:
        name, eq, value = p.partition("=")
        name = name.strip().lower()
        if eq:
            opts[name] = value  # quotes already dropped
        elif name:
            flags.add(name)
    return opts, flags


def parse_line(line: str) -> Entry | None:
    """One authorized_keys line; None for comments, blank lines, unsupported types and broken keys."""
    from ..wire.sshsig import KEY_TYPES, SshSigError, parse_public

    line = line.strip()
    if not line or line.startswith("#") or len(line) > MAX_LINE:
        return None
    opts: dict[str, str] = {}
    flags: set[str] = set()
    if line.split(None, 1)[0] not in KEY_TYPES:
        options, line = _split_options(line)
        opts, flags = _parse_options(options)
    try:
        blob = parse_public(line)
    except SshSigError:
        return None
    return Entry(blob, opts, frozenset(flags))


def from_allows(patterns: str, peer: str | None) -> bool:
    """sshd's ``from=`` pattern-list for the peer address (no DNS: host-name patterns never match)."""
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
    allowed = False
    for raw in patterns.split(","):
        pat = raw.strip()
        negated = pat.startswith("!")
        pat = pat[1:] if negated else pat
        if not pat:
            continue
        if "/" in pat:
            try:
                hit = addr in ipaddress.ip_network(pat, strict=False)
            except ValueError:
                return False  # sshd: a bad CIDR makes the whole list fail
        else:
            hit = fnmatch.fnmatchcase(addr_text, pat.lower())
        if hit and negated:
            return False
        allowed = allowed or hit
    return allowed


def _expired(value: str) -> bool:
    for fmt in ("%Y%m%d%H%M%S", "%Y%m%d%H%M", "%Y%m%d"):
        try:
            return time.mktime(time.strptime(value.strip(), fmt)) <= time.time()
        except ValueError:
            continue
    return True  # sshd refuses a line whose expiry it cannot read


def why_not(entry: Entry, peer: str | None) -> str | None:
    """Why a listed key does not stand for its account for this request (None: it does)."""
    if "cert-authority" in entry.flags:
        return "a cert-authority line (certificates are not supported)"
    if "command" in entry.options:
        return "listed with command= (a forced command: not a gpusd identity)"
    if "expiry-time" in entry.options and _expired(entry.options["expiry-time"]):
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
            return None, None  # nothing listed: not a problem to report
        except OSError as exc:  # ELOOP: a symlink; ENOTDIR; EACCES
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
        import pwd

        return pwd.getpwall()

    def who(self, blob: bytes, peer: str | None, host: str = "this host") -> Account:
        """The account of the key ``blob`` for a request from ``peer``; :class:`Refused` otherwise."""
        from ..wire.sshsig import fingerprint

        fp = fingerprint(blob)
        reasons: list[str] = []
        path = self._users_path()
        data, problem = read_users_file(path)
        if problem:
            self._warn(problem)
        for raw in (data or b"").decode("utf-8", "replace").splitlines():
            name, _, rest = raw.strip().partition(" ")
            if not name or name.startswith("#"):
                continue
            entry = parse_line(rest)
            if entry is None or entry.blob != blob:
                continue
            if not _valid_name(name):
                self._warn(f"{path}: {name[:40]!r} is not a user name")
                continue
            why = why_not(entry, peer)
            if why is not None:
                reasons.append(f"{path} maps it to {name} but {why}")
                continue
            return Account(name, _uid_of(name), fp, "users file")
        import base64

        needle = base64.b64encode(blob)  # a cheap pre-filter: a listed key's base64 is in the file
        found: list[tuple[str, int]] = []
        for pw in self._passwd():
            text, problem = read_authorized_keys(pw.pw_dir, pw.pw_uid)
            if problem:
                self._warn(problem)
            if text is None or needle not in text:
                continue
            for line in text.decode("utf-8", "replace").splitlines():
                entry = parse_line(line)
                if entry is None or entry.blob != blob:
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
                              f"{USERS_FILE}")
        if found:
            return Account(found[0][0], found[0][1], fp, "authorized_keys")
        detail = f" ({'; '.join(reasons)[:300]})" if reasons else ""
        raise Refused(f"the key {fp} is not listed for any account on {host}{detail}: add its public key to "
                      f"your ~/.ssh/authorized_keys there, or ask the administrator to map it to your name in "
                      f"{USERS_FILE}")


def _uid_of(name: str) -> int | None:
    try:
        import pwd

        return pwd.getpwnam(name).pw_uid
    except (KeyError, ImportError):
        return None
