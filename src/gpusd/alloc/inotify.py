"""Linux inotify, through ctypes: the one binding of gpusd (the queue's wake-up, the lease view).

:class:`Inotify` is one inotify instance: :meth:`Inotify.watch` a directory, :meth:`Inotify.read` the
pending events as ``(wd, mask, name)`` without blocking, :meth:`Inotify.wait` for one.  Where inotify is
unavailable (not Linux, no ctypes, the per-user limit on instances reached) the constructor raises
OSError and callers fall back to what they did without it (polling, re-reading).  ``ctypes`` is imported
by the constructor: only a process that watches pays for it.
"""

from __future__ import annotations

import errno
import os
import struct
import time

IN_MODIFY = 0x002
IN_ATTRIB = 0x004
IN_CLOSE_WRITE = 0x008
IN_CLOSE_NOWRITE = 0x010
IN_MOVED_FROM = 0x040
IN_MOVED_TO = 0x080
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_UNMOUNT = 0x2000
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x01000000
IN_DONT_FOLLOW = 0x02000000
# The watch itself is gone or events were lost: whoever keeps state from events must start again.
LOST = IN_Q_OVERFLOW | IN_IGNORED | IN_DELETE_SELF | IN_MOVE_SELF | IN_UNMOUNT

# struct inotify_event: int wd; uint32 mask, cookie, len; then the name
_HEADER = struct.Struct("=iIII")
_EVENT_SIZE = _HEADER.size


class Inotify:
    """One inotify instance (non-blocking, close-on-exec).  OSError when one cannot be made."""

    def __init__(self) -> None:
        try:
            # only watchers need it: imported here, not by every gpusd command
            import ctypes

            self._libc = ctypes.CDLL(None, use_errno=True)
            fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        except (OSError, AttributeError, ImportError) as exc:
            raise OSError(errno.ENOSYS, f"inotify is not available: {exc}") from None
        if fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        self.fd: int = fd

    def watch(self, path: str | bytes | os.PathLike[str], events: int) -> int:
        """Add a watch: its descriptor (wd), or -1 when the kernel refuses (missing, not a directory with
        ``IN_ONLYDIR``, a symlink with ``IN_DONT_FOLLOW``, the per-user limit on watches)."""
        if self.fd < 0:
            return -1
        return int(self._libc.inotify_add_watch(self.fd, os.fsencode(path), events))

    def unwatch(self, wd: int) -> None:
        """Remove a watch (its last event is an ``IN_IGNORED``)."""
        if self.fd >= 0:
            self._libc.inotify_rm_watch(self.fd, wd)

    def read(self) -> list[tuple[int, int, bytes]]:
        """The pending events, ``(wd, mask, name)``, without blocking (empty when there are none).  A read
        error other than "nothing pending" comes as one event with ``IN_Q_OVERFLOW``: state kept from
        events cannot be trusted then."""
        out: list[tuple[int, int, bytes]] = []
        while self.fd >= 0:
            try:
                buf = os.read(self.fd, 65536)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EINTR:
                    continue
                out.append((-1, IN_Q_OVERFLOW, b""))
                break
            if not buf:
                break
            at, end = 0, len(buf)
            while at + _EVENT_SIZE <= end:
                wd, mask, _, size = _HEADER.unpack_from(buf, at)
                at += _EVENT_SIZE
                out.append((wd, mask, buf[at:at + size].rstrip(b"\0") if size else b""))
                at += size
        return out

    def wait(self, timeout: float) -> bool:
        """Block until an event is pending (True) or ``timeout`` seconds have passed (False)."""
        import select

        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            if left <= 0 or self.fd < 0:
                return False
            try:
                ready, _, _ = select.select([self.fd], [], [], left)
            except InterruptedError:
                continue
            return bool(ready)

    def close(self) -> None:
        """Close the instance, in a background thread: the kernel waits for an RCU grace period there
        (measured: ~18 ms), which must not delay the job that just got its GPUs."""
        if self.fd >= 0:
            import threading

            fd, self.fd = self.fd, -1
            threading.Thread(target=_close, args=(fd,), name="gpusd-inotify-close", daemon=True).start()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
