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


def test_a_matrix_has_no_rule_and_devices_topology_uses_the_one_renderer() -> None:
    from gpusd.cli.devices import render_topology
    from gpusd.inventory.simulated import SimulatedBackend

    assert render_table(["", "GPU0"], [["GPU0", " X "]], rule=False) == "      GPU0\nGPU0   X"
    out = render_topology(SimulatedBackend("2xA6000").snapshot()).splitlines()
    assert out[:3] == ["      GPU0  GPU1  CPU Affinity  NUMA Affinity  GPU NUMA ID",
                       "GPU0   X    NV4   0-31          0              N/A",
                       "GPU1  NV4    X    0-31          0              N/A"]


def test_the_written_out_layout_is_rich_s_layout() -> None:
    """The renderer writes rich's layout out itself (rich's Table took 4 s for 8,000 rows); both give
    the same text, for cells of every width: wide, zero-width and combining characters, white space at
    the edges, cells cut to ``max_cell``, empty cells, short rows, right-aligned columns, with and
    without the rule."""
    import random

    from gpusd.sanitize import for_terminal
    from gpusd.views import tables

    alphabet = ["a", "Z", "1", " ", "-", "名", "前", "é", "e\u0301", "😀", "\u200b", "[b]", "\t", "ß", "ｱ", "\u3000",
                "\u00a0", "\x1b[31m", "\u202e", "\r"]
    rng = random.Random(24)
    for _ in range(300):
        cols = rng.randint(1, 6)
        head = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 5))) for _ in range(cols)]
        rows = [["".join(rng.choice(alphabet) for _ in range(rng.randint(0, rng.choice((8, 90)))))
                 for _ in range(rng.randint(0, cols))] for _ in range(rng.randint(0, 6))]
        right = {i for i in range(cols) if rng.random() < 0.4}
        rule = rng.random() < 0.7
        h = [for_terminal(x, tables.MAX_CELL) for x in head]
        b = [[for_terminal(x, tables.MAX_CELL) for x in r] for r in rows]
        widths = [max([cell_len(h[i])] + [cell_len(r[i]) for r in b if i < len(r)]) for i in range(cols)]
        assert render_table(head, rows, right=right, rule=rule) == tables._rich_table(h, b, widths, right, rule), (
            head, rows, right, rule)
