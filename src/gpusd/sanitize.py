"""Make hostile strings safe to print.

Anything that came from the network, from another user's file or from a driver (a GPU name, a lease's
command line, a host name in a TXT record) may carry terminal escape sequences (retitle the window,
clear the screen, move the cursor, hide text), control characters, bidirectional overrides, rich
markup (``[/bold]`` crashes a rich renderer, ``[link=...]`` hides a link) or simply be enormous.
:func:`for_terminal` is the one step every such string passes through before it reaches a terminal.

>>> for_terminal("\\x1b]0;pwned\\x07A100\\x1b[2J [bold]x[/bold]\\x00", 40)
'A100 \\\\[bold]x\\\\[/bold]?'

It is pure (no imports beyond :mod:`re`), so the CLI pays nothing to use it.
"""

from __future__ import annotations

import re

__all__ = ["for_terminal", "escape_markup", "strip_escapes"]

# ECMA-48 sequences, 7-bit and 8-bit forms.  Order matters: string sequences (OSC, DCS, SOS, PM, APC)
# run to their terminator (BEL or ST), or to the end of the text when it never comes.
_ESCAPES = re.compile(
    r"""
      \x1b\[[\x30-\x3f]*[\x20-\x2f]*[\x40-\x7e]?          # CSI: ESC [ params intermediates final
    | \x9b[\x30-\x3f]*[\x20-\x2f]*[\x40-\x7e]?            # 8-bit CSI
    | (?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])             # OSC, DCS, SOS, PM, APC (7- and 8-bit)
      [^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?               #   ... up to BEL or ST
    | \x1b[\x20-\x2f]*[\x30-\x7e]?                        # any other ESC sequence (charset, keypad, RIS)
    """,
    re.VERBOSE,
)
# What is left: C0 and C1 controls, DEL, and the Unicode bidirectional overrides and isolates
# (they reorder what the reader sees, "Trojan Source"), and the line/paragraph separators.
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069\u2028\u2029]")
_WHITESPACE = re.compile("[\t\n\r\v\f]")
# rich's own markup-escaping rule (rich.markup.escape): a backslash before what could be a tag.
_MARKUP = re.compile(r"(\\*)(\[[a-z#/@][^[]*?])")


def strip_escapes(s: str) -> str:
    """``s`` without terminal escape sequences (7-bit and 8-bit CSI, OSC, DCS... and plain ESC x)."""
    return _ESCAPES.sub("", s)


def escape_markup(s: str) -> str:
    """Escape ``s`` so that rich prints it as written instead of reading ``[...]`` as markup
    (the same rule as :func:`rich.markup.escape`, without importing rich)."""
    s = _MARKUP.sub(lambda m: f"{m.group(1)}{m.group(1)}\\{m.group(2)}", s)
    if s.endswith("\\") and not s.endswith("\\\\"):
        s += "\\"
    return s


def for_terminal(s: object, max_len: int = 200, *, markup: bool = True, placeholder: str = "?") -> str:
    """``s`` made safe to show on a terminal, on one line of at most ``max_len`` characters.

    * Terminal escape sequences are removed whole (7-bit and 8-bit forms).
    * Tabs and line breaks become a space; every other control character (C0, DEL, C1) and every
      bidirectional override becomes ``placeholder``, so that something odd stays visible.
    * Longer text is cut to ``max_len`` characters, the last one an ellipsis (``…``).
    * With ``markup`` (the default), ``[`` that rich would read as markup is escaped with a
      backslash, so the result may be placed in rich markup as it is; pass ``markup=False`` for
      plain ``print``.  Escaping comes after cutting: it may add backslashes beyond ``max_len``.

    ``None`` gives ``""``; any other non-string is converted with :func:`str` first.  The cost is
    bounded whatever the input: at most a few times ``max_len`` characters of it are examined.
    """
    if s is None:
        return ""
    if not isinstance(s, str):
        s = str(s)
    if max_len < 1:
        raise ValueError("max_len must be at least 1")
    # Bound the work: an escape sequence cut in half here loses its ESC below, which is enough.
    limit = max_len * 4 + 64
    if len(s) > limit:
        s = s[:limit]
    s = _ESCAPES.sub("", s)
    s = _WHITESPACE.sub(" ", s)
    s = _CONTROLS.sub(placeholder, s)
    if len(s) > max_len:
        s = s[: max_len - 1] + "…"
    return escape_markup(s) if markup else s
