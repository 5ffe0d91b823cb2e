"""systemd's file descriptor store, for descriptors that must outlive the daemon (docs/pool.md).

Under systemd (``Type=notify`` with ``FileDescriptorStoreMax=`` in docs/gpusd.service) the service
manager keeps descriptors the daemon sends it (``sd_notify`` ``FDSTORE=1`` with ``SCM_RIGHTS``, each
set under a name, ``FDNAME=``) across a restart of the daemon, and hands them to the next one as
``sd_listen_fds(3)`` describes: ``LISTEN_PID`` (that process), ``LISTEN_FDS`` (how many, from
descriptor 3 on) and ``LISTEN_FDNAMES`` (their names, colon-separated).  ``FDSTOREREMOVE=1`` with a
name drops every descriptor stored under it.

The store is used only where the service manager says it has one: ``$NOTIFY_SOCKET`` set and
``$FDSTORE`` (set by systemd 254 and later to ``FileDescriptorStoreMax=``; the unit file sets it too,
for older versions) a positive number.
"""

from __future__ import annotations

import array
import os
import socket

# sd_notify's limit on FDNAME
MAX_NAME = 255
# below the kernel's SCM_MAX_FD (253)
MAX_FDS_PER_MESSAGE = 250


def available() -> bool:
    """Whether a service manager with a file descriptor store supervises this process."""
    if not os.environ.get("NOTIFY_SOCKET"):
        return False
    try:
        return int(os.environ.get("FDSTORE") or "0") > 0
    except ValueError:
        return False


def _address() -> str | None:
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return None
    return "\0" + addr[1:] if addr.startswith("@") else addr


def valid_name(name: str) -> bool:
    """A name sd_notify takes: printable ASCII, no colon (the separator of LISTEN_FDNAMES)."""
    return 0 < len(name) <= MAX_NAME and name.isascii() and name.isprintable() and ":" not in name


def _send(message: str, fds: list[int]) -> bool:
    addr = _address()
    if addr is None:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            # a datagram to the service manager: never a wait without end
            s.settimeout(2.0)
            s.connect(addr)
            anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
            s.sendmsg([message.encode()], anc)
        return True
    except OSError:
        return False


def store(name: str, fds: list[int]) -> bool:
    """Give the service manager copies of ``fds`` under ``name`` (False: not sent)."""
    if not valid_name(name) or not fds or len(fds) > MAX_FDS_PER_MESSAGE:
        return False
    return _send(f"FDSTORE=1\nFDNAME={name}", fds)


def remove(name: str) -> bool:
    """Have the service manager close every descriptor it stores under ``name``."""
    if not valid_name(name):
        return False
    return _send(f"FDSTOREREMOVE=1\nFDNAME={name}", [])


def listen_fds() -> dict[str, list[int]]:
    """The descriptors the service manager handed this process at start, by name (``sd_listen_fds``
    semantics: only when ``LISTEN_PID`` is this process; from descriptor 3 on; made close-on-exec, the
    variables removed so that no child takes them for its own).  Read once: a second call finds none."""
    pid, count, names = (os.environ.get(k) for k in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"))
    for k in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(k, None)
    try:
        if pid is None or int(pid) != os.getpid():
            return {}
        n = int(count or "0")
    except ValueError:
        return {}
    if not 0 < n <= 4096:
        return {}
    labels = (names or "").split(":")
    out: dict[str, list[int]] = {}
    for i in range(n):
        fd = 3 + i
        try:
            os.set_inheritable(fd, False)
        except OSError:
            continue
        label = labels[i] if i < len(labels) and labels[i] else "unknown"
        out.setdefault(label, []).append(fd)
    return out
