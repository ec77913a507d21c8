"""The commands' reports (tui/cli/report.py): a figure is never shortened to "23…" nor split, at
an 80-column terminal or redirected to a file (issue 35: `bench`'s table printed "fp…", "26…")."""

from __future__ import annotations

import io

from rich.console import Console

from tui.cli.bench_table import DECODE_COLUMNS
from tui.cli.report import REDIRECTED_WIDTH, figures_table, print_figures, report_console

ROW = (
    "fp32",
    "26.41",
    "27.93",
    "18.27",
    "10.55",
    "2.50x",
    "2.48x",
    "38.12",
    "43.90",
    "22",
    "117%",
    "513M",
    "994M",
)


def decode_table():
    table = figures_table("Decode tok/s", DECODE_COLUMNS)
    table.add_row(*ROW)
    return table


def test_a_decode_table_wider_than_80_columns_prints_in_parts_with_every_figure_whole():
    out = io.StringIO()
    print_figures(Console(file=out, width=80), decode_table())
    text = out.getvalue()
    assert "…" not in text and all(len(line) <= 80 for line in text.splitlines())
    words = text.split()
    assert all(figure in words for figure in ROW)
    assert all(word in words for header in DECODE_COLUMNS for word in header.split())
    rows = [line for line in text.splitlines() if line.split()[:1] == ["fp32"]]
    assert len(rows) == 2 and "(continued)" in words  # each part led by the precision


def test_a_report_redirected_is_one_table_wide_enough_for_all(monkeypatch):
    monkeypatch.setattr("sys.stdout", io.StringIO())
    console = report_console()
    assert not console.is_terminal and console.width == REDIRECTED_WIDTH
    print_figures(console, decode_table())
    rows = [line.split() for line in console.file.getvalue().splitlines() if line.split()[:1] == ["fp32"]]
    assert rows == [list(ROW)]
