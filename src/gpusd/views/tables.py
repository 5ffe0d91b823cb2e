"""gpusd's one table renderer: plain-text tables laid out by rich, for the CLI's lists and the usage
report.

The output is what scripts and people read: a header, a line of dashes under each column, the rows,
columns two spaces apart, the columns ``right`` right-aligned, no trailing spaces and no styling.
rich measures cells by their width on a terminal (a CJK user name takes two columns a character), so
the columns line up where ``str.ljust`` did not.  Every cell is hostile data (names from the network,
users and commands from other users' files): it is passed through :func:`gpusd.sanitize.for_terminal`,
bounded to ``max_cell`` characters, and given to rich as plain text (never as markup), so no escape
sequence reaches the terminal and no line is unbounded.
"""

# Imports inside functions: start-up (quick commands import this module).
from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from ..sanitize import for_terminal

# characters shown of one cell
MAX_CELL = 80


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Collection[int] = (),
                 max_cell: int = MAX_CELL, rule: bool = True) -> str:
    """``headers`` and ``rows`` laid out (module docstring); ``rule=False`` leaves out the dashes under
    the header (a matrix such as ``gpusd devices --topology``, as ``nvidia-smi topo -m`` prints it)."""
    from rich.cells import cell_len

    head = [for_terminal(h, max_cell) for h in headers]
    body = [[for_terminal(c, max_cell) for c in row] for row in rows]
    widths = [max([cell_len(head[i])] + [cell_len(r[i]) for r in body if i < len(r)]) for i in range(len(head))]
    if all(len(r) <= len(head) for r in body):
        # The layout rich gives this table (no box, no wrapping, two spaces after each column but the
        # last, cells padded by their terminal width), written out: rich's Table takes ~0.5 ms a row,
        # 4 s for the 8,000 GPUs of 1,000 hosts (bench/bench_fleet_scale.py); this, ~2 us a cell.
        # tests/views/test_tables.py checks the two give the same text.
        lines = [_line(head, widths, right, cell_len)]
        if rule:
            lines.append("  ".join("-" * w for w in widths).rstrip())
        lines += [_line(r, widths, right, cell_len) for r in body]
        return "\n".join(lines)
    return _rich_table(head, body, widths, right, rule)


def _line(cells: Sequence[str], widths: list[int], right: Collection[int], cell_len: Callable[[str], int]) -> str:
    out = []
    for i, w in enumerate(widths):
        c = cells[i] if i < len(cells) else ""
        if i in right:
            # as rich right-justifies: without the cell's trailing white space
            c = c.rstrip()
            out.append(" " * (w - cell_len(c)) + c)
        else:
            out.append(c + " " * (w - cell_len(c)))
    return "  ".join(out).rstrip()


def _rich_table(head: list[str], body: list[list[str]], widths: list[int], right: Collection[int], rule: bool) -> str:
    """The same table laid out by rich (also for rows with more cells than there are headers)."""
    import io

    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(box=None, show_header=False, show_edge=False, pad_edge=False, padding=(0, 2, 0, 0))
    for i in range(len(head)):
        table.add_column(justify="right" if i in right else "left", no_wrap=True)
    for cells in (head, *([["-" * w for w in widths]] if rule else []), *body):
        table.add_row(*(Text(c) for c in cells))
    out = io.StringIO()
    console = Console(file=out, width=sum(widths) + 2 * len(widths) + 8, color_system=None, force_terminal=False,
                      highlight=False, markup=False, emoji=False, soft_wrap=False, no_color=True)
    console.print(table)
    return "\n".join(line.rstrip() for line in out.getvalue().rstrip("\n").split("\n"))


def container_tag(p: object) -> str:
    """`` [docker 0123456789ab of alice]``: a GPU process's container (its runtime, the id's first 12
    characters, who started it where a gpusd job did); "" for a process of the host."""
    cid = getattr(p, "container", None)
    if not cid:
        return ""
    runtime = for_terminal(getattr(p, "container_runtime", None), 16) or "container"
    owner = for_terminal(getattr(p, "container_owner", None), 32)
    return f" [{runtime} {for_terminal(str(cid)[:12], 12)}{f' of {owner}' if owner else ''}]"
