"""What every instrument screen shares: a title line, the explanation that opens in place, Esc, a footer.

Each instrument reads from the engine through the `Instruments` link (tui/instruments.py):
data that is plain tokenizer or event work directly from `link.session` (a read-only
`SessionView`), anything that runs the model through `engine.call`, awaited here with
`asyncio.wrap_future` so the UI thread never waits on it.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.content import Content
from textual.screen import Screen
from textual.widgets import Footer, Static

from engine.events import Event
from engine.instruments.explain import explain
from tui.fmt import visible_controls
from tui.widgets.explanation import ExplanationPanel

if TYPE_CHECKING:
    from tui.instruments import AnswerRef, Instruments


class InstrumentScreen(Screen[None]):
    INSTRUMENT = ""
    """The key of the instrument's explanation in engine/instruments/explain.py."""

    DEFAULT_CSS = """
    InstrumentScreen > #title { dock: top; height: 1; background: $panel; }
    InstrumentScreen > #body { height: 1fr; padding: 0 1; scrollbar-size-vertical: 1; }
    InstrumentScreen .section { text-style: bold; color: $text-primary; margin-top: 1; }
    InstrumentScreen .muted { color: $text-muted; }
    InstrumentScreen .warning { color: $text-warning; }
    """
    BINDINGS = [
        Binding("escape", "close", "Close"),
        Binding("question_mark", "explain", "Explain"),
    ]

    BODY_FOCUS = True
    """False where the screen's own arrow keys matter more than scrolling the body."""

    def __init__(self, link: Instruments, step: int | None = None, answer: AnswerRef | None = None) -> None:
        """Every instrument screen opens this way (tui/instruments.py `SCREENS`): `step` and `answer`
        say where to look, for the screens that look at one step or answer; the others ignore them."""
        super().__init__()
        self.link = link

    def compose(self) -> ComposeResult:
        yield Static(self.title_line(), id="title")
        with VerticalScroll(id="body", can_focus=self.BODY_FOCUS):
            yield ExplanationPanel(explain(self.INSTRUMENT))
            yield from self.compose_body()
        yield Footer(compact=True)

    def compose_body(self) -> ComposeResult:
        yield from ()

    def title_line(self) -> Content:
        return Content.assemble((f" {explain(self.INSTRUMENT).title} ", "bold $background on $accent"))

    def set_title_line(self, *parts: Any) -> None:
        """The title, then `parts`; a plain string among them (a model's name, an answer's label) is
        shown with its control characters visible."""
        parts = tuple(visible_controls(p, one_line=True) if isinstance(p, str) else p for p in parts)
        self.query_one("#title", Static).update(Content.assemble(self.title_line(), " ", *parts))

    def action_close(self) -> None:
        self.dismiss()

    def action_explain(self) -> None:
        panel = self.query_one(ExplanationPanel)
        panel.toggle()
        if panel.is_open:
            self.query_one("#body", VerticalScroll).scroll_home(animate=False)

    def engine_said(self, event: Event) -> None:
        """An in-order engine event (step paused, fork, turn finished...) while this screen is open."""

    async def on_engine(self, future: Future) -> Any:
        """Await a result computed on the inference thread without blocking the UI."""
        return await asyncio.wrap_future(future)
