"""How the commands' reports print (`bench`, `bench --server`, `lab batching`): no figure is cut.

Rich shortens a cell that does not fit to "23…" and folds a header mid-word; a report is read for
its digits. A table wider than the terminal prints as several, each with the first column again
(as a wide data frame prints); redirected to a file or a pipe (no edge to fit), the console is
wide enough for the widest table whole.
"""

from __future__ import annotations

from rich import box
from rich.cells import cell_len
from rich.console import Console, RenderableType
from rich.table import Column, Table
from rich.text import Text

REDIRECTED_WIDTH = 200
"""Columns for a report that goes to a file or a pipe: the widest table (13 columns) fits."""
SPACING = 3
"""Beside its widest cell a column takes a space of padding each side and a divider."""


def report_console() -> Console:
    console = Console()
    return console if console.is_terminal else Console(width=REDIRECTED_WIDTH)


def figures_table(title: str | Text, columns: tuple[str, ...] | list[str]) -> Table:
    """Right-aligned columns of figures; no inner rules, so a terminal has the room."""
    table = Table(title=title, box=box.SIMPLE_HEAD)
    for column in columns:
        table.add_column(column, justify="right")
    return table


def print_figures(console: Console, table: Table) -> None:
    """The table whole where it fits; else in parts that do, each led by the first column. Each
    column keeps the width it needs (Rich would squeeze a wide table's columns below it)."""
    widths = [_width(column) for column in table.columns]
    for part, columns in enumerate(_parts(widths[0], widths[1:], console.width - 1)):
        chosen = [0, *(1 + i for i in columns)]
        console.print(_part(table, chosen, [widths[i] - SPACING for i in chosen], continued=part > 0))


def _width(column: Column) -> int:
    """What the column needs: its longest cell, and its header's longest word (headers wrap)."""
    words = str(column.header).split() or [""]
    cells = [c.cell_len if isinstance(c, Text) else cell_len(str(c)) for c in column.cells]
    return max([*map(cell_len, words), *cells]) + SPACING


def _parts(lead: int, widths: list[int], room: int) -> list[list[int]]:
    """Runs of the other columns' indexes that fit beside the leading column (one at least; all
    of them in one run where the table fits whole)."""
    parts: list[list[int]] = [[]]
    used = lead
    for i, width in enumerate(widths):
        if parts[-1] and used + width > room:
            parts.append([])
            used = lead
        parts[-1].append(i)
        used += width
    return parts


def _part(table: Table, indexes: list[int], widths: list[int], continued: bool) -> Table:
    title: RenderableType = table.title or ""
    if continued:
        title = Text.assemble(title if isinstance(title, Text) else str(title), " (continued)")
    part = Table(title=title, box=table.box)
    columns = [table.columns[i] for i in indexes]
    for column, width in zip(columns, widths):
        part.add_column(column.header, justify=column.justify, min_width=width)
    for row in zip(*(list(column.cells) for column in columns)):
        part.add_row(*row)
    return part


def latency_table(title: str, runs: list[tuple[str, dict]], percentiles: list[float]) -> Table:
    """The serving metric set's latencies (engine/serving_metrics.py keys), one row per metric and
    run: mean, median, std and each percentile in ms ('-' where nothing was measured)."""
    from engine.serving_metrics import METRICS, percentile_word

    stats = ["mean", "median", "std", *(f"p{percentile_word(p)}" for p in percentiles)]
    table = figures_table(title, ("", *(f"{stat} ms" for stat in stats)))
    table.columns[0].justify = "left"
    for key, name in METRICS:
        for label, figures in runs:
            cells = [figures[f"{stat}_{key}_ms"] for stat in stats]
            table.add_row(f"{name} {label}".strip(), *("-" if v is None else f"{v:,.1f}" for v in cells))
    return table
