"""gpusd.sanitize.for_terminal: what a hostile string may not do to a terminal."""

from __future__ import annotations

import pytest

from gpusd.sanitize import escape_markup, for_terminal, strip_escapes

ATTACKS = {
    "window title (OSC, BEL)": ("\x1b]0;owned\x07A100", "A100"),
    "window title (OSC, ST)": ("\x1b]2;owned\x1b\\A100", "A100"),
    "hyperlink (OSC 8)": ("\x1b]8;;http://evil/\x1b\\click\x1b]8;;\x1b\\", "click"),
    "clear screen (CSI)": ("\x1b[2J\x1b[HA100", "A100"),
    "colour and hidden text": ("\x1b[31;8msecret\x1b[0m", "secret"),
    "8-bit CSI": ("\x9b2JA100", "A100"),
    "8-bit OSC": ("\x9d0;owned\x9cA100", "A100"),
    "DCS": ("\x1bPq#0;2;0;0;0\x1b\\A100", "A100"),
    "reset (RIS)": ("\x1bcA100", "A100"),
    "charset switch": ("\x1b(0A100", "A100"),
    "unterminated OSC eats the rest, not the terminal": ("A100\x1b]0;owned", "A100"),
}


@pytest.mark.parametrize("raw,shown", list(ATTACKS.values()), ids=list(ATTACKS))
def test_escape_sequences_are_removed(raw, shown):
    assert for_terminal(raw, 80, markup=False) == shown


def test_controls_and_bidi_overrides_stay_visible_but_harmless():
    assert for_terminal("a\x00b\x7fc\x85d\x08e", 80, markup=False) == "a?b?c?d?e"
    assert for_terminal("line1\nline2\r\tx", 80, markup=False) == "line1 line2  x"
    assert for_terminal("evil\u202etxt.exe", 80, markup=False) == "evil?txt.exe"
    assert for_terminal("\x07bell", 80, markup=False, placeholder="") == "bell"


def test_length_is_bounded_whatever_the_input():
    assert for_terminal("x" * 100_000, 40) == "x" * 39 + "…"
    assert len(for_terminal("\x1b[" * 50_000 + "y" * 50_000, 40)) <= 40
    assert for_terminal("\x1b[31m" + "y" * 50_000, 40) == "y" * 39 + "…"
    assert for_terminal("short", 40) == "short"
    with pytest.raises(ValueError):
        for_terminal("x", 0)


def test_markup_is_escaped_so_rich_shows_it_as_written():
    from rich.console import Console
    from rich.text import Text

    for raw in ("[/bold]x", "[bold]big[/bold]", "[link=http://evil]ok[/link]", "a\\[b]", "ends\\", "[@click=quit]"):
        safe = for_terminal(raw, 80)
        # no MarkupError, no style taken from it, the text itself, also inside the caller's markup
        assert Text.from_markup(f"[bold]{safe}[/bold]").plain == raw
        console = Console(record=True, width=120, color_system=None)
        console.print(f"[dim]{safe}[/dim]")
        assert console.export_text().rstrip("\n") == raw
    assert for_terminal("[bold]x", 80, markup=False) == "[bold]x"


def test_none_and_non_strings():
    assert for_terminal(None) == ""
    assert for_terminal(42) == "42"
    assert strip_escapes("\x1b[1mA\x1b[0m") == "A"
    assert escape_markup("[red]") == "\\[red]"
