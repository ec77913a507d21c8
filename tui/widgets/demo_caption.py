"""The scripted demo's caption: which step, what to look at, and the keys that move on."""

from __future__ import annotations

from textual.content import Content
from textual.widgets import Static

KEYS = "→ Space PgDn next · ← PgUp back · q ends the demo"


class DemoCaption(Static):
    """The last widget in the flow of whatever screen is on top (the chat or an instrument), above
    its footer (docked: it would cover the footer), so the class always reads what the step is about."""

    DEFAULT_CSS = """
    DemoCaption {
        height: auto;
        max-height: 6;
        padding: 0 1;
        background: $primary-muted;
        color: $text;
        border-top: tall $primary;
    }
    """

    def __init__(self, text: Content | None = None) -> None:
        super().__init__(text or "", markup=False)

    def show(self, number: int, steps: int, caption: str, state: str = "") -> None:
        """Step `number` of `steps` with its caption; `state` says what the step still waits for."""
        self.update(caption_text(number, steps, caption, state))


def caption_text(number: int, steps: int, caption: str, state: str = "") -> Content:
    return Content.assemble(
        (f"{number}/{steps} ", "bold $accent"),
        (caption, "bold"),
        "\n",
        (state + " · " if state else "", "$text-warning"),
        (KEYS, "$text-muted"),
    )
