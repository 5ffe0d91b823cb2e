"""The interactive ``gpusd top``: a full-screen rich view refreshed every ``interval`` seconds, with
keys read from the terminal in cbreak mode (no Enter needed, no echo)."""

from __future__ import annotations

import os
import select
import sys
import termios
import time
import tty
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

from rich.console import Group
from rich.live import Live
from rich.segment import Segment, Segments
from rich.style import Style

from .top import HostBook, HostView, TopState, footer_line, render

if TYPE_CHECKING:  # pragma: no cover
    from rich.console import Console, RenderableType

_SEQUENCES = {
    "\x1b[A": "UP", "\x1b[B": "DOWN", "\x1bOA": "UP", "\x1bOB": "DOWN",
    "\x1b[5~": "PGUP", "\x1b[6~": "PGDN", "\x1b[H": "HOME", "\x1b[1~": "HOME", "\x1bOH": "HOME",
}


def split_keys(chunk: str) -> list[str]:
    """Keys in what one read returned: escape sequences as names (``UP``, ``PGDN`` ...), a lone
    Esc as ``\\x1b``, unknown sequences dropped, other characters one by one."""
    keys: list[str] = []
    i = 0
    while i < len(chunk):
        c = chunk[i]
        if c == "\x1b" and i + 1 < len(chunk) and chunk[i + 1] in "[O":
            j = i + 2
            while j < len(chunk) and not (chunk[j].isalpha() or chunk[j] == "~"):
                j += 1
            seq = chunk[i:j + 1]
            if seq in _SEQUENCES:
                keys.append(_SEQUENCES[seq])
            i = j + 1
            continue
        keys.append(c)
        i += 1
    return keys


class KeyReader:
    """Reads single keys from a terminal.  On anything that is not a terminal it reads nothing (the
    view still refreshes; quit with Ctrl-C)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream if stream is not None else sys.stdin
        self._fd: int | None = None
        self._eof = False
        self._saved: Any = None

    def __enter__(self) -> KeyReader:  # noqa: PYI034 - Python 3.10 has no typing.Self
        try:
            fd = self._stream.fileno()
        except (AttributeError, OSError, ValueError):
            return self
        if not os.isatty(fd):
            return self

        self._fd = fd
        self._saved = termios.tcgetattr(fd)
        tty.setcbreak(fd)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None and self._saved is not None:
            try:
                termios.tcsetattr(self._fd, termios.TCSADRAIN, self._saved)
            except termios.error:
                # the terminal is gone: nothing left to restore
                pass
        self._fd = None

    @property
    def interactive(self) -> bool:
        return self._fd is not None

    def read(self, timeout: float) -> list[str]:
        """Keys typed within ``timeout`` seconds (returns as soon as there is one)."""
        timeout = max(0.0, timeout)
        if self._fd is None or self._eof:
            time.sleep(timeout)
            return []
        ready, _, _ = select.select([self._fd], [], [], timeout)
        if not ready:
            return []
        try:
            data = os.read(self._fd, 64)
        except OSError:
            # EIO: the terminal hung up
            data = b""
        # end of input (a closed terminal or pipe): stop reading keys, keep refreshing
        if not data:
            self._eof = True
            return []
        return split_keys(data.decode("utf-8", "replace"))


def crop(console: Console, frame: RenderableType, footer: RenderableType, offset: int,
         height: int) -> tuple[RenderableType, int]:
    """The frame scrolled to ``offset`` lines so that it and the footer fit ``height`` lines; returns
    the renderable and the offset actually used (clamped)."""

    options = console.options.update(height=None)
    body = console.render_lines(frame, options, pad=False)
    foot = console.render_lines(footer, options, pad=False)
    room = max(1, height - len(foot))
    offset = max(0, min(offset, len(body) - room))
    shown = body[offset:offset + room]
    # say that the frame goes on: a marker line in place of the first or last row shown

    def marker(text: str) -> list[Segment]:
        return [Segment(text[:max(1, options.max_width)], Style(dim=True, reverse=True))]

    below = len(body) - (offset + room)
    if below > 0 and len(shown) > 1:
        shown = [*shown[:-1], marker(f"↓ {below + 1} more line(s) below: ↓/j, PgDn")]
    if offset > 0 and len(shown) > 2:
        shown = [marker(f"↑ {offset + 1} more line(s) above: ↑/k, PgUp, Home"), *shown[1:]]
    segments: list[Segment] = []
    for line in [*shown, *foot]:
        segments.extend(line)
        segments.append(Segment.line())
    if segments:
        segments.pop()
    return Group(Segments(segments)), offset


def run_live(hosts: Callable[[], list[HostView]], state: TopState, book: HostBook, interval: float,
             console: Console, keys: KeyReader | None = None) -> int:
    """The live loop: fetch hosts every ``interval`` s, redraw after every fetch and key; returns 0 when
    the user quits."""

    keys = keys or KeyReader()
    message: str | None = None
    views: list[HostView] = []
    next_fetch = 0.0
    with keys, Live(console=console, screen=True, auto_refresh=False, redirect_stdout=False,
                    redirect_stderr=False) as live:
        # something on screen while the first fetch browses the LAN
        width, height = console.size
        live.update(render([], state, width=width, message="looking for hosts…"), refresh=True)
        while True:
            mono = time.monotonic()
            if mono >= next_fetch:
                try:
                    views = book.update(hosts())
                    message = None
                except Exception as exc:  # noqa: BLE001 - shown on screen; the view keeps running
                    message = f"cannot refresh: {exc}"
                next_fetch = time.monotonic() + interval
            width, height = console.size
            frame = render(views, state, width=width, footer=False, message=message)
            view, state.offset = crop(console, frame, footer_line(state, width), state.offset, height)
            live.update(view, refresh=True)
            for k in keys.read(next_fetch - time.monotonic()):
                if not state.key(k):
                    return 0
