"""What the lessons about one step of an answer share (the logit lens, ablation): the answer's
tokens as chips to pick the step from (← →, a click), and one computation per step on the
inference thread, kept so that going back to a step shows it at once.

Opened with a key in the token inspector (its selected step and answer) or from Ctrl+P (the last
answer's last step).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Hashable

from textual.app import ComposeResult
from textual.binding import Binding
from textual.content import Content
from textual.widgets import Static

from engine.instruments.logit_lens import context_before
from tui.fmt import subscript, visible_controls, visible_piece
from tui.screens.instrument import InstrumentScreen
from tui.widgets.token_strip import StripToken, TokenStrip

if TYPE_CHECKING:
    from engine.instruments.trace import AnswerTrace
    from engine.session import ChatSession
    from tui.instruments import AnswerRef, Instruments


class ChipPicker:
    """← → and a click move a screen's cursor over its TokenStrip's chips, then `compute`."""

    tokens: list[StripToken]
    cursor: int

    def action_move(self, delta: int) -> None:
        if self.tokens:
            self.action_select(max(0, min(len(self.tokens) - 1, self.cursor + delta)))

    def action_select(self, index: int) -> None:
        self.cursor = index
        self.query_one(TokenStrip).move_to(index)
        self.compute()

    def compute(self) -> None:
        raise NotImplementedError


class StepLessonScreen(ChipPicker, InstrumentScreen):
    DEFAULT_CSS = """
    StepLessonScreen TokenStrip { margin: 1 0 0 0; }
    """
    BINDINGS = [
        Binding("left", "move(-1)", "Step", show=False),
        Binding("right", "move(1)", "Step"),
    ]
    BODY_FOCUS = False

    def __init__(self, link: Instruments, step: int | None = None, answer: AnswerRef | None = None) -> None:
        super().__init__(link, step, answer)
        if answer is None:
            from tui.instruments import answers

            refs = answers(link.session)
            answer = refs[-1] if refs else None
        self.trace: AnswerTrace | None = answer.trace if answer is not None else None
        self.label = answer.label if answer is not None else ""
        steps = self.trace.steps if self.trace is not None else []
        self.tokens = [StripToken(s.id, s.piece, "") for s in steps]
        self.cursor = max(0, len(self.tokens) - 1 if step is None else min(step, len(self.tokens) - 1))
        self._results: dict[Hashable, Any] = {}
        self.shown: Any = None
        """The result on screen (a test waits for it)."""

    def compose_body(self) -> ComposeResult:
        yield Static(id="source", classes="muted")
        yield TokenStrip("screen.select({})", max_rows=3)
        yield Static(id="status")
        yield from self.compose_lesson()

    def compose_lesson(self) -> ComposeResult:
        yield from ()

    def on_mount(self) -> None:
        self.set_title_line(self.link.session.info.name)
        if not self.tokens:
            self._status("No answer yet: ask something first, then open this again.")
            return
        self.query_one(TokenStrip).set_tokens(self.tokens, self.cursor)
        self.query_one("#source", Static).update(f"the steps of {self.label}  ← → or click a chip")
        self.compute()

    @property
    def step_token(self) -> StripToken:
        return self.tokens[self.cursor]

    # -- computing --------------------------------------------------------------------
    def key(self) -> Hashable:
        """What a result depends on: the step (a lesson adds its own choices)."""
        return self.cursor

    def run(self, session: ChatSession, ids: list[int], chosen: int, key: Any) -> Any:
        """On the inference thread: the lesson's computation for the step's context, as `key` (what
        the screen showed when it was asked for) says."""
        raise NotImplementedError

    def show(self, result: Any) -> None:
        raise NotImplementedError

    def _status(self, text: str, style: str = "$text-muted") -> None:
        self.query_one("#status", Static).update(Content.styled(visible_controls(text), style))

    def compute(self) -> None:
        if not self.tokens or self.trace is None:
            return
        key = self.key()
        if key in self._results:
            self._shown(self._results[key])
            return
        try:
            ids, chosen = context_before(self.trace, self.cursor)
        except ValueError as e:
            self._status(f"✖ {e}", "$text-error")
            return
        busy = getattr(self.app, "turns", None) is not None and self.app.turns.busy
        self._status(
            f"one forward pass over the {len(ids):,} tokens before this step, on the inference thread"
            + (" (after the answer in progress)…" if busy else "…"),
            "$text-warning",
        )
        self.run_worker(functools.partial(self._fetch, key, ids, chosen), exclusive=True)

    async def _fetch(self, key: Hashable, ids: list[int], chosen: int) -> None:
        try:
            result = await self.on_engine(self.link.engine.call(lambda s: self.run(s, ids, chosen, key)))
        except Exception as e:
            self._status(f"✖ {e}", "$text-error")
            return
        self._results[key] = result
        if self.key() == key:
            self._shown(result)

    def _shown(self, result: Any) -> None:
        self.shown = result
        self._status("")
        token = self.step_token
        self.set_title_line(
            f"{self.link.session.info.name} · step {self.cursor + 1}: {visible_piece(token.piece)}"
            f"{subscript(token.id) if token.id is not None else ''}"
        )
        self.show(result)
