"""gpusd's one table renderer (rich): the plain output scripts and people read, aligned by terminal
cell width, every cell sanitised and never read as markup."""

from __future__ import annotations

from rich.cells import cell_len

from gpusd.views.tables import render_table


def test_plain_layout_header_dashes_rows_two_spaces_right_aligned() -> None:
    text = render_table(["HOST", "IDX", "NAME"], [["node-a", "1", "A100"], ["b", "10", "H100 80GB HBM3"]],
                        right=(1,))
    assert text.split("\n") == [
        "HOST    IDX  NAME",
        "------  ---  --------------",
        "node-a    1  A100",
        "b        10  H100 80GB HBM3",
    ]
    assert render_table(["A", "B"], []) == "A  B\n-  -"


def test_wide_characters_line_up_by_terminal_cells() -> None:
    lines = render_table(["USER", "GPUS"], [["名前だ", "2"], ["bob", "1"]]).split("\n")
    # the second column starts at the same terminal column on every line (str.ljust got this wrong)
    starts = {cell_len(line[: line.rindex(" ") + 1]) for line in lines}
    assert len(starts) == 1, lines


def test_hostile_cells_are_sanitised_and_never_markup() -> None:
    text = render_table(["CMD"], [["\x1b[2J\x1b]0;pwned\x07[bold red]x[/] " + "y" * 500]], max_cell=40)
    assert "\x1b" not in text and "\x07" not in text
    assert "[bold red]x[/]" in text  # shown as typed, not styled
    assert max(cell_len(line) for line in text.split("\n")) <= 40
    assert not any(line != line.rstrip() for line in text.split("\n"))
