"""The daemon's log: bounded in rate and in size, whatever its peers do.

Hostile or broken peers can make a daemon log the same line at network speed (measured:
~1 M lines, 500 MB in 100 s).  Two defences, installed by :func:`setup` (``gpusd start``):

* :class:`RateLimitFilter`: at most ``per_window`` (10) records per *kind* per ``window`` (60 s);
  the rest are counted and summed up in one line when the window ends ("... 1234 more like this
  were not logged").  A kind is the logger, the level and the message *template* (``"skipping %s:
  %s"``), so one line about each of 1,000 fake hosts is one kind.  At most ``max_kinds`` (256) kinds
  are tracked per window; records of further kinds share one extra allowance.  Messages longer than
  ``max_chars`` (4,000) are cut.
* :class:`RotatingLog`: the log file is rotated by size while the daemon runs (``gpusd.log``,
  ``gpusd.log.1`` ... ``gpusd.log.3``, 10 MiB each by default; ``$GPUSD_LOG_MAX_BYTES`` and
  ``$GPUSD_LOG_BACKUPS`` change that).  When the process's stdout/stderr were the log file (a
  background daemon), they follow the rotation, so stray output never grows a rotated file.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..alloc.lockdir import same_file
from ..sanitize import log_formatter

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_MAX_BYTES = 10 * 2**20
LOG_BACKUPS = 3
PER_WINDOW = 10
WINDOW = 60.0
MAX_KINDS = 256
MAX_CHARS = 4000

# the shared kind of records beyond max_kinds
_OTHER = ("", 0, "")
_filters: weakref.WeakSet[RateLimitFilter] = weakref.WeakSet()


class _Kind:
    __slots__ = ("count", "levelno", "name", "start", "template")

    def __init__(self, start: float, record: logging.LogRecord) -> None:
        self.start = start
        self.count = 0
        self.name = record.name
        self.levelno = record.levelno
        self.template = str(record.msg)[:200]


class RateLimitFilter(logging.Filter):
    """A handler filter: at most ``per_window`` records of one kind per ``window`` seconds, then one
    summary line per kind and window.  Attach it with :meth:`attach` (it writes its summaries
    through that handler)."""

    def __init__(self, per_window: int = PER_WINDOW, window: float = WINDOW, max_kinds: int = MAX_KINDS,
                 max_chars: int = MAX_CHARS, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.per_window = per_window
        self.window = window
        self.max_kinds = max_kinds
        self.max_chars = max_chars
        self.clock = clock
        # records held back so far (all kinds)
        self.suppressed = 0
        self._kinds: dict[tuple[str, int, str], _Kind] = {}
        self._handler: logging.Handler | None = None
        self._lock = threading.RLock()
        self._last_flush = 0.0

    def attach(self, handler: logging.Handler) -> RateLimitFilter:
        self._handler = handler
        handler.addFilter(self)
        _filters.add(self)
        return self

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "gpusd_summary", False):
            return True
        now = self.clock()
        with self._lock:
            if now - self._last_flush >= 1.0:
                self._flush(now)
            key = (record.name, record.levelno, str(record.msg)[:200])
            kind = self._kinds.get(key)
            if kind is None:
                if len(self._kinds) >= self.max_kinds:
                    key = _OTHER
                    kind = self._kinds.get(key)
                if kind is None:
                    kind = self._kinds[key] = _Kind(now, record)
                    if key == _OTHER:
                        kind.name, kind.template = "gpusd.logs", "(messages of other kinds)"
            kind.count += 1
            if kind.count > self.per_window:
                self.suppressed += 1
                return False
        self._cut(record)
        return True

    def _cut(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format: let the handler report it as usual
            return
        if len(text) > self.max_chars:
            record.msg = f"{text[:self.max_chars]}... [{len(text) - self.max_chars} more characters]"
            record.args = None

    def flush(self, force: bool = False) -> None:
        """Write the summaries of windows that have ended (also done on every record, at most once a
        second; call it now and then so a summary is not held back until the next record).  Without
        ``force``, at most once a second."""
        now = self.clock()
        with self._lock:
            if force or now - self._last_flush >= 1.0:
                self._flush(now)

    def _flush(self, now: float) -> None:
        self._last_flush = now
        ended = [(k, v) for k, v in self._kinds.items() if now - v.start >= self.window]
        for key, kind in ended:
            del self._kinds[key]
            extra = kind.count - self.per_window
            if extra > 0 and self._handler is not None:
                rec = logging.makeLogRecord({
                    "name": kind.name, "levelno": kind.levelno, "levelname": logging.getLevelName(kind.levelno),
                    "msg": "%d more messages like this one in the last %.0f s were not logged: %r",
                    "args": (extra, now - kind.start, kind.template), "gpusd_summary": True})
                self._handler.handle(rec)


def flush() -> None:
    """:meth:`RateLimitFilter.flush` for every filter installed in this process."""
    for f in list(_filters):
        f.flush()


class RotatingLog(logging.handlers.RotatingFileHandler):
    """A size-rotated log file.  With ``follow_stdio``, file descriptors 1 and 2 are pointed at the
    new file after each rotation (a background daemon's stdout/stderr are its log)."""

    def __init__(self, path: str | Path, max_bytes: int = LOG_MAX_BYTES, backups: int = LOG_BACKUPS,
                 follow_stdio: bool = False) -> None:
        super().__init__(path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8", errors="backslashreplace")
        self.follow_stdio = follow_stdio
        self.rotations = 0

    def doRollover(self) -> None:
        super().doRollover()
        self.rotations += 1
        if self.follow_stdio and self.stream is not None:
            for fd, stream in ((1, sys.stdout), (2, sys.stderr)):
                try:
                    if stream is not None:
                        stream.flush()
                    os.dup2(self.stream.fileno(), fd)
                except (OSError, ValueError):
                    pass


def rotate(path: Path, backups: int = LOG_BACKUPS, max_bytes: int = 0) -> bool:
    """Rotate ``path`` the way :class:`RotatingLog` does (``.1`` ... ``.backups``) if it is larger
    than ``max_bytes``.  Returns whether it did."""
    try:
        if path.stat().st_size <= max_bytes:
            return False
        for i in range(backups - 1, 0, -1):
            src = path.with_name(f"{path.name}.{i}")
            if src.exists():
                os.replace(src, path.with_name(f"{path.name}.{i + 1}"))
        if backups > 0:
            os.replace(path, path.with_name(f"{path.name}.1"))
        else:
            path.unlink()
        return True
    except OSError:
        return False


def limits_from_env() -> tuple[int, int]:
    """(max bytes, backups) for the log file: the defaults, or ``$GPUSD_LOG_MAX_BYTES`` and
    ``$GPUSD_LOG_BACKUPS``."""
    def number(name: str, default: int, lowest: int) -> int:
        try:
            return max(lowest, int(os.environ.get(name, "")))
        except ValueError:
            return default

    return number("GPUSD_LOG_MAX_BYTES", LOG_MAX_BYTES, 4096), number("GPUSD_LOG_BACKUPS", LOG_BACKUPS, 1)


def setup(level: int | str = logging.INFO, log_file: str | Path | None = None, *,
          max_bytes: int | None = None, backups: int | None = None,
          rate_limit: RateLimitFilter | None = None) -> logging.Handler:
    """Make the root logger write to ``log_file`` (size-rotated) or to stderr, through a
    :class:`RateLimitFilter`.  Replaces the root logger's handlers.  Returns the handler."""
    env_bytes, env_backups = limits_from_env()
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
        old.close()
    handler: logging.Handler
    if log_file is not None:
        path = Path(log_file)
        path.parent.mkdir(parents=True, exist_ok=True)

        # a background daemon: its stderr is this file
        follow = same_file(2, path)
        handler = RotatingLog(path, max_bytes if max_bytes is not None else env_bytes,
                              backups if backups is not None else env_backups, follow_stdio=follow)
    else:
        handler = logging.StreamHandler(sys.stderr)
    # the one rule for logs: what a GPU or a peer said, no control byte

    # room for the cut's note and the prefix
    handler.setFormatter(log_formatter(LOG_FORMAT, MAX_CHARS + 256))
    (rate_limit or RateLimitFilter()).attach(handler)
    root.addHandler(handler)
    root.setLevel(level)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    return handler


def describe(handler: Any) -> str:
    if isinstance(handler, RotatingLog):
        return (f"logging to {handler.baseFilename} (rotated at {handler.maxBytes} bytes, "
                f"{handler.backupCount} kept)")
    return "logging to stderr"
