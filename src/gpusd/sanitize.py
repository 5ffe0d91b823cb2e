"""The one sanitising step for hostile data on its way to a terminal or into JSON output.

Every string that came from the network (a daemon's answer, an mDNS announcement), from another
user's file (a lease record) or from a GPU (its name) goes through :func:`for_terminal` before gpusd
prints it, whatever prints it (plain tables, ``gpusd top``, error messages):

* escape sequences are removed whole: CSI (``ESC [ ... m``, ``ESC [2J``), OSC (``ESC ] 0;title BEL``,
  which sets the window title, or OSC 52, which writes the clipboard), DCS/SOS/PM/APC strings, their
  8-bit C1 forms and two-character ``ESC x`` sequences;
* then every remaining control character: C0 (``\\x00``-``\\x1f``, tab and newline included: they
  become a space), DEL, C1 (``\\x80``-``\\x9f``);
* Unicode format characters (bidi overrides and isolates such as U+202E, zero-width characters),
  line and paragraph separators, and lone surrogates (which cannot even be encoded for output);
* the result is cut to ``max_len`` characters, the last one an ellipsis (``…``).

One rule per kind of output, applied where the output is made (the boundary), never earlier:

============  =============================================================================
terminal      :func:`for_terminal` (tables, ``top``, error messages)
logs          :func:`log_formatter` (every log line, whatever it quotes)
``/metrics``  :func:`for_exposition` over the whole text (a scrape is read with ``curl`` in a
              terminal too): no control or format character but the newlines; :func:`for_label`
              for a label value written by hand
HTML          :func:`for_html`: the terminal rule, then HTML's escapes (a saved report is ``cat``-ed)
JSON          :func:`dumps`: ASCII only, so every control character leaves as a ``\\u`` escape, never
              as the raw byte (and a JSON parser still gets the exact value)
============  =============================================================================

Rich markup is not this module's business: ``gpusd top`` hands data to rich only as
:class:`rich.text.Text` objects (never parsed as markup), and :func:`rich_text` builds one.

:func:`json_safe` and :func:`dumps` make JSON output valid for every parser: ``NaN`` and
``±Infinity`` (which Python writes but JavaScript's ``JSON.parse`` and most other parsers refuse)
become ``null``.
"""

# Imports inside functions: start-up (quick commands import this module).
from __future__ import annotations

import json
import math
import re
import unicodedata

# typing is not imported at run time: start-up time
TYPE_CHECKING = False

if TYPE_CHECKING:  # pragma: no cover
    import logging
    from typing import Any

    from rich.text import Text

# default bound for one string shown on a terminal
MAX_LEN = 256
ELLIPSIS = "…"

# ESC or its 8-bit C1 equivalent, then the rest of the sequence (ECMA-48).
_SEQUENCE = re.compile(
    r"""
    (?: \x1b\[ | \x9b ) [\x30-\x3f]* [\x20-\x2f]* [\x40-\x7e]?        # CSI ... final byte
  | (?: \x1b[\]PX^_] | [\x9d\x90\x98\x9e\x9f] )                        # OSC, DCS, SOS, PM, APC ...
      [^\x07\x1b\x9c]* (?: \x07 | \x1b\\ | \x9c )?                     # ... up to BEL or ST (or the end)
  | \x1b [\x20-\x2f]* [\x30-\x7e]?                                     # ESC ( B, ESC 7, ESC c ...
    """,
    re.VERBOSE,
)
# C0 (less tab and newline), DEL, C1
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_SPACE = re.compile(r"[\t\n\r\x0b\x0c\u2028\u2029]")  # shown as a space
_DROP_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def for_terminal(s: object, max_len: int = MAX_LEN) -> str:
    """``s`` made safe to print: no escape sequences, no control or bidi characters, at most
    ``max_len`` characters (cut with an ellipsis).  ``None`` gives ``""``; anything else not a
    string is converted with ``str()`` first."""
    if s is None:
        return ""
    text = s if isinstance(s, str) else str(s)
    max_len = max(1, max_len)
    # nothing to remove (the common case: 8,000 table cells of 1,000 hosts)
    if text.isascii() and text.isprintable():
        return text if len(text) <= max_len else text[:max_len - 1] + ELLIPSIS
    # Bound the work: removing sequences can only shorten the text, and a sequence cut here loses
    # its ESC below (what is left of it is shown as plain, harmless text).
    limit = 4 * max_len + 64
    if len(text) > limit:
        text = text[:limit]
    text = _clean(text)
    if len(text) > max_len:
        text = text[:max_len - 1] + ELLIPSIS
    return text


def _clean(text: str) -> str:
    text = _SEQUENCE.sub("", text)
    text = _SPACE.sub(" ", text)
    text = _CONTROL.sub("", text)
    if not text.isascii():
        text = "".join(c for c in text if unicodedata.category(c) not in _DROP_CATEGORIES)
    return text


def for_exposition(text: str) -> str:
    """A whole Prometheus text exposition (``/metrics``) with each line cleaned as
    :func:`for_terminal` cleans (not cut): the format has no control byte but the newline ending each
    line, so none is lost but those a label value (a GPU's name from its driver, a host or user name
    from the network) smuggled in.  Applied where the text is made, whoever made each series."""
    if text.replace("\n", "").isprintable():
        # the common case: one C-speed scan
        return text
    return "\n".join(_clean(line) for line in text.split("\n"))


def printable(text: str, limit: int | None = None, replace: str = "?") -> str:
    """The first ``limit`` characters of ``text`` with every character Python does not print (controls,
    format and separator characters, lone surrogates) replaced by ``replace`` (``""``: dropped): the
    one per-character rule for a value that is stored or sent on (a TXT word, a record's host field, a
    tool's message), where :func:`for_terminal` is for what a terminal shows."""
    text = text if limit is None else text[:limit]
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else replace for c in text)


def optional(s: object, max_len: int = MAX_LEN) -> str | None:
    """:func:`for_terminal`, except that ``None`` stays ``None`` (for ``x or "-"`` idioms)."""
    return None if s is None else for_terminal(s, max_len)


def rich_text(s: object, max_len: int = MAX_LEN, style: str = "") -> Text:
    """A :class:`rich.text.Text` of the sanitised string: rich never parses it as markup."""
    from rich.text import Text

    return Text(for_terminal(s, max_len), style=style)


def log_formatter(fmt: str, max_len: int = 4000) -> logging.Formatter:
    """A :class:`logging.Formatter` whose messages go through :func:`for_terminal` (log lines quote
    host names and answers from the network; a traceback keeps its lines)."""
    import logging

    class _SafeFormatter(logging.Formatter):
        def formatMessage(self, record: logging.LogRecord) -> str:
            return for_terminal(super().formatMessage(record), max_len)

    return _SafeFormatter(fmt)


def for_label(s: object, max_len: int = MAX_LEN) -> str:
    """A Prometheus label value for the text exposition format: :func:`for_terminal` (no escape
    sequence, control or format character survives, at most ``max_len`` characters), then the
    format's own escapes (backslash and double quote; no newline is left to escape)."""
    return for_terminal(s, max_len).replace("\\", "\\\\").replace('"', '\\"')


def for_html(s: object, max_len: int = MAX_LEN) -> str:
    """Text for an HTML document: :func:`for_terminal`, then HTML's escapes (quotes included)."""
    import html

    return html.escape(for_terminal(s, max_len))


def json_safe(obj: Any) -> Any:
    """``obj`` with every non-finite float (NaN, ±Infinity) replaced by ``None``, recursively
    through dicts, lists and tuples (which become lists)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def json_object(raw: bytes | str, limit: int | None = None) -> dict[str, Any]:
    """Bytes from a peer, a file or another user, as the JSON object they must be: ValueError (one
    line: too long, not JSON, not an object) otherwise, never a RecursionError.  ``limit``: at most
    that many bytes (characters for ``str``)."""
    if limit is not None and len(raw) > limit:
        raise ValueError(f"more than {limit} bytes")
    try:
        d = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"not JSON ({str(exc)[:100]})") from None
    if not isinstance(d, dict):
        raise ValueError("not a JSON object")
    return d


def dumps(obj: Any, **kw: Any) -> str:
    """``json.dumps`` for output: strict JSON, never ``NaN`` or ``Infinity`` (they become ``null``),
    ASCII only (a control character leaves as its ``\\u`` escape, never as the raw byte)."""
    kw["ensure_ascii"] = True
    try:
        return json.dumps(obj, allow_nan=False, **kw)
    except ValueError:
        # a non-finite float somewhere (rare): copy without them
        return json.dumps(json_safe(obj), allow_nan=False, **kw)


__all__ = ["MAX_LEN", "dumps", "for_exposition", "for_html", "for_label", "for_terminal", "json_object", "json_safe",
           "log_formatter", "optional", "rich_text"]


# an IPv6 zone: an interface name or index (IFNAMSIZ - 1)
_SCOPE = re.compile(r"[A-Za-z0-9_.-]{1,15}")


def ip_word(text: object) -> bool:
    """Whether ``text`` is an IP address that is also one safe word: in a shell, a hostfile, an
    ssh argument.  Python's :mod:`ipaddress` accepts an IPv6 scope id of any characters but ``/``
    and ``%`` (``fe80::1%;reboot`` is an address to it); here a scope id is an interface name or
    index: letters, digits, ``_``, ``.``, ``-``, at most 15."""
    import ipaddress

    if not isinstance(text, str) or not text:
        return False
    _, pct, scope = text.partition("%")
    if pct and _SCOPE.fullmatch(scope) is None:
        return False
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True
