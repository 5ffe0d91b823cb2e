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
