"""Extension points are records: a precision or an instrument is declared once, and the CLI's
help, Settings, F1 help, the palette and the screens are derived from it."""

from __future__ import annotations

import importlib

from typer.testing import CliRunner

from engine.instruments.explain import EXPLANATIONS
from engine.quant.precision import KINDS, PRECISIONS, PrecisionError, precision_for
from tui.instruments import INSTRUMENTS, LESSONS, REMOTE, SCREENS, help_table


def test_every_precision_record_is_offered_by_the_cli_and_checked_on_its_device():
    shown = CliRunner().invoke(
        importlib.import_module("tui.cli").app, ["ask", "--help"], env={"COLUMNS": "400"}
    )
    for kind in KINDS.values():
        assert kind.name in shown.output
        if kind.cpu_only:
            try:
                precision_for(kind.name, "cuda")
            except PrecisionError as e:
                assert str(e) == kind.cpu_only
            else:
                raise AssertionError(f"{kind.name} loaded on a GPU")
    assert PRECISIONS == tuple(KINDS) and precision_for("fp32", "cpu").bits == 32


def test_every_instrument_record_has_its_screen_its_explanation_and_its_help_row():
    table = help_table()
    for instrument in INSTRUMENTS + LESSONS:
        assert instrument.guide in table
        assert instrument.name in EXPLANATIONS, f"{instrument.name} has no '?' explanation"
        if instrument.screen is not None:
            module, name = SCREENS[instrument.name]
            assert hasattr(importlib.import_module(module), name)
    assert REMOTE == {"inspector", "tokenizer"}


def test_each_command_is_one_line_in_llmchat_help():
    """`llmchat --help` lists each command by its docstring's first paragraph; it kept the
    docstring's line breaks there, so a wide terminal showed `lecture` over two lines broken at "the"."""
    app = importlib.import_module("tui.cli").app
    listed = {}
    for group in ("", "conversations", "lab"):
        shown = CliRunner().invoke(app, [*group.split(), "--help"], env={"COLUMNS": "400"}).output
        panel = shown[shown.index("─ Commands ─") :].split("╰")[0]
        rows = [row.strip("│ ") for row in panel.splitlines()[1:]]
        listed[group] = [row.split()[0] for row in rows]  # a row that continues a line has no name
    assert listed[""] == ["lecture", "demo", "web", "ask", "bench", "top", "conversations", "lab"]
    assert listed["conversations"] == ["list", "show", "export", "rename", "delete"]
    assert listed["lab"] == ["batching"]
