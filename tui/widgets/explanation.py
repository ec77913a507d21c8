"""The paragraph a student opens in place (`?`) on each instrument: what it shows, and the formula."""

from __future__ import annotations

from textual.content import Content
from textual.widgets import Static

from engine.instruments.explain import Explanation


def explanation_content(explanation: Explanation, closes: bool = True) -> Content:
    """`closes`: end with the `?` hint (not where it is part of a page, as in Help)."""
    hint = ("\n", ("? closes this", "$text-muted")) if closes else ()
    return Content.assemble(
        (explanation.title, "bold $text-primary"),
        "\n",
        explanation.text,
        "\n",
        ("formula  ", "bold"),
        (explanation.formula, "$text-accent"),
        *hint,
    )


class ExplanationPanel(Static):
    """Hidden until `toggle()`; shown above the instrument it explains."""

    DEFAULT_CSS = """
    ExplanationPanel { display: none; height: auto; margin: 0 0 1 0; padding: 0 1;
        border: round $accent; background: $boost; }
    ExplanationPanel.-open { display: block; }
    """

    def __init__(self, explanation: Explanation, **kwargs) -> None:
        super().__init__(explanation_content(explanation), **kwargs)
        self.explanation = explanation

    @property
    def is_open(self) -> bool:
        return self.has_class("-open")

    def toggle(self) -> None:
        self.toggle_class("-open")
