"""Server-sent events: formatting (daemon) and a bounded incremental parser (client).

Only the parts of the SSE format gpusd uses: ``event:`` and ``data:`` fields, events separated by a
blank line, ``:`` comment lines ignored.  The parser never buffers more than ``max_event`` bytes:
a peer that sends an endless line is cut off with :class:`SSEError`.
"""

from __future__ import annotations

from typing import Any, Iterator

# re-exported: defined in gpusd.errors
from ..errors import SSEError as SSEError
from ..sanitize import dumps

# bytes; the same bound as an HTTP JSON answer
MAX_EVENT = 4 * 2**20


# A reader of a host's event stream may ask for a pace (``?pace=S``, docs/wire-format.md): changes of
# readings alone at most every S seconds.  Seconds, these bounds included.
PACE_MIN, PACE_MAX = 2.0, 60.0


def check_pace(value: str | float) -> float:
    """``value`` as a pace in seconds; ``ValueError`` with a one-line reason where it is not one."""
    try:
        pace = float(value)
    except (TypeError, ValueError):
        pace = float("nan")
    if not PACE_MIN <= pace <= PACE_MAX:
        raise ValueError(f"pace must be a number of seconds from {PACE_MIN:g} to {PACE_MAX:g}")
    return pace


def format_event(event: str, data: Any) -> bytes:
    """One event: ``event: NAME\\ndata: JSON\\n\\n`` (JSON never contains a raw newline)."""
    payload = data if isinstance(data, str) else dumps(data, separators=(",", ":"))
    return f"event: {event}\ndata: {payload}\n\n".encode()


class SSEParser:
    """Feed bytes, get ``(event, data)`` pairs (data: the joined ``data:`` lines, a string)."""

    def __init__(self, max_event: int = MAX_EVENT) -> None:
        self.max_event = max_event
        self._buf = bytearray()
        self._event = ""
        self._data: list[str] = []
        self._size = 0

    def feed(self, chunk: bytes) -> Iterator[tuple[str, str]]:
        self._buf.extend(chunk)
        while True:
            nl = self._buf.find(b"\n")
            if nl < 0:
                if len(self._buf) > self.max_event:
                    raise SSEError(f"SSE line longer than {self.max_event} bytes")
                return
            line = bytes(self._buf[:nl])
            del self._buf[: nl + 1]
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if self._data or self._event:
                    event = self._event or "message"
                    data = "\n".join(self._data)
                    self._event, self._data, self._size = "", [], 0
                    yield event, data
                continue
            if line.startswith(b":"):
                continue
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError:
                raise SSEError("SSE line is not UTF-8") from None
            name, _, value = text.partition(":")
            if value.startswith(" "):
                value = value[1:]
            self._size += len(line)
            if self._size > self.max_event:
                raise SSEError(f"SSE event larger than {self.max_event} bytes")
            if name == "event":
                self._event = value[:64]
            elif name == "data":
                self._data.append(value)
            # id:, retry: and unknown fields are ignored
