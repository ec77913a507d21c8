"""Two small modal questions: a line of text (rename) and yes or no (delete)."""

from __future__ import annotations

from textual import on
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Static

DIALOG_CSS = """
{name} {{ align: center middle; }}
{name} > Vertical {{ width: 70; max-width: 100%; height: auto; border: thick $primary; background: $surface;
    padding: 0 1; }}
{name} .question {{ margin: 1 0; }}
{name} .buttons {{ height: auto; align-horizontal: right; }}
{name} Button {{ margin-left: 1; }}
"""


class TextDialog(ModalScreen[str | None]):
    """Ask for a line of text; Enter gives it, Esc gives None."""

    DEFAULT_CSS = DIALOG_CSS.format(name="TextDialog")
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, question: str, value: str = "") -> None:
        super().__init__()
        self.question = question
        self.value = value

    def compose(self):
        with Vertical():
            yield Static(self.question, classes="question", markup=False)
            yield Input(self.value, select_on_focus=True)
            with Horizontal(classes="buttons"):
                yield Button("OK  enter", id="ok", variant="primary")
                yield Button("Cancel  esc", id="cancel")

    @on(Input.Submitted)
    @on(Button.Pressed, "#ok")
    def _ok(self) -> None:
        self.dismiss(self.query_one(Input).value)

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)


class ConfirmDialog(ModalScreen[bool]):
    """Ask yes or no; the safe answer (no) has the focus, so a stray Enter changes nothing."""

    DEFAULT_CSS = DIALOG_CSS.format(name="ConfirmDialog")
    BINDINGS = [Binding("y", "answer(True)", "Yes"), Binding("n,escape", "answer(False)", "No")]

    def __init__(self, question: str, yes: str = "Yes") -> None:
        super().__init__()
        self.question = question
        self.yes = yes

    def compose(self):
        with Vertical():
            yield Static(self.question, classes="question", markup=False)
            with Horizontal(classes="buttons"):
                yield Button(f"{self.yes}  y", id="yes", variant="error")
                yield Button("Cancel  n", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)
