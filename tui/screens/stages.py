"""Sampler stages: one step's distribution after each filter of the chain, side by side.

The step waiting in step mode is read from its own logits (the inference thread is blocked
at the gate meanwhile). A finished answer's step is recomputed on the inference thread
(`stages_at`, one forward pass without the cache) at the current settings.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.content import Content
from textual.widgets import Static

from engine.events import Event, TurnFinished
from engine.instruments.stages import SamplerStages, Stage, pending_stages, stages_at
from tui.fmt import plain_text, prob_style, visible_piece
from tui.instruments import AnswerRef, Instruments, answers
from tui.screens.instrument import InstrumentScreen

SHORT = {
    "model": "model",
    "repetition penalty": "penalty",
    "temperature": "temp",
    "top-k": "top-k",
    "top-p": "top-p",
    "min-p": "min-p",
}
PIECE_WIDTH = 14
COLUMN = 9


def cell(stage: Stage, token: int, removed_before: bool) -> tuple[str, str]:
    """One token's probability after one stage, and its style."""
    if removed_before:
        return "·", "$text-muted"
    if any(c.id == token for c in stage.removed_top):
        return "✗ out", "bold $text-error"
    for c in stage.top:
        if c.id == token:
            return f"{c.prob:.2%}", prob_style(c.prob)
    return "…", "$text-muted"  # kept, but below the shown top


def table(stages: SamplerStages, rows: int = 12) -> list[Content]:
    """Rows: the most probable tokens (model's first, then any later stage's); columns: the stages."""
    head = Content.assemble(
        ("token".ljust(PIECE_WIDTH), "bold"),
        *(
            (
                SHORT.get(s.name, s.name)[: COLUMN - 1].rjust(COLUMN),
                "bold" if s.active or s.name == "model" else "$text-muted",
            )
            for s in stages.stages
        ),
    )
    kept = Content.assemble(
        ("kept".ljust(PIECE_WIDTH), "bold"), *((f"{s.kept:,}".rjust(COLUMN), "") for s in stages.stages)
    )
    return [head, *(_token_row(stages, token, piece) for token, piece in _tokens(stages)[:rows]), kept]


def _tokens(stages: SamplerStages) -> list[tuple[int, str]]:
    """Each stage's top tokens in order of first appearance, the model's first."""
    order: list[tuple[int, str]] = []
    for stage in stages.stages:
        for c in stage.top:
            if all(c.id != i for i, _ in order):
                order.append((c.id, c.piece))
    return order


def _token_row(stages: SamplerStages, token: int, piece: str) -> Content:
    """A token's probability after each stage, ✗ from the stage that removed it."""
    parts: list = [(visible_piece(piece)[: PIECE_WIDTH - 1].ljust(PIECE_WIDTH), "")]
    gone = False
    for stage in stages.stages:
        text, style = cell(stage, token, gone)
        gone = gone or text.startswith("✗")
        parts.append((text.rjust(COLUMN), style))
    return Content.assemble(*parts)


def stage_lines(stages: SamplerStages) -> list[Content]:
    """One line per stage: its setting, whether it did anything, what it removed."""
    lines = [_stage_line(stage) for stage in stages.stages[1:]]
    final = stages.final.top[0] if stages.final.top else None
    if final is not None:
        verdict = "takes the most probable" if stages.greedy else "draws from the last column"
        lines.append(
            Content.assemble(
                ("draw", "bold"),
                f"  the sampler {verdict}: {visible_piece(final.piece)} is at {final.prob:.2%}",
            )
        )
    return lines


def _stage_line(stage: Stage) -> Content:
    if not stage.active:
        return Content.styled(
            f"{stage.name:<19}{stage.setting}: off, the distribution passes unchanged", "$text-muted"
        )
    removed = ", ".join(f"{visible_piece(c.piece)} {c.prob:.2%}" for c in stage.removed_top[:5])
    what = f"removed {stage.removed:,} tokens" + (f" (the likeliest: {removed})" if removed else "")
    if stage.removed == 0:
        what = "reshaped the probabilities, removed none"
    return Content.assemble((f"{stage.name:<19}", "bold"), f"{stage.setting}: {what}; {stage.kept:,} left")


def recomputed_at(answer: AnswerRef, step: int, settings) -> str:
    """Which step is shown, and the settings it was recomputed at (today's, not the answer's)."""
    return (
        f"step {step + 1} of {answer.label} ({len(answer.trace)} steps), recomputed at the current "
        "settings "
        f"(T {settings.temperature:g}, top-k {settings.top_k}, top-p {settings.top_p:g}, "
        f"min-p {settings.min_p:g}, penalty {settings.repetition_penalty:g})  ← → other steps · "
        "[ ] other answers"
    )


class StagesScreen(InstrumentScreen):
    INSTRUMENT = "stages"
    BINDINGS = [
        # priority: the body scrolls sideways on ← → otherwise
        Binding("left", "step(-1)", "Step ←", priority=True),
        Binding("right", "step(1)", "Step →", priority=True),
        Binding("left_square_bracket", "answer(-1)", "Prev answer"),
        Binding("right_square_bracket", "answer(1)", "Next answer"),
    ]

    def __init__(self, link: Instruments, step: int | None = None, answer: AnswerRef | None = None) -> None:
        super().__init__(link, step, answer)
        self.step = step
        self.answer = answer
        self.stages: SamplerStages | None = None
        self.pending = False
        """Showing the step waiting in step mode (its neighbours need the model, which waits for a choice)."""

    def compose_body(self) -> ComposeResult:
        yield Static(id="source", classes="muted")
        yield Static(
            "Probability of each candidate after each stage (✗ = removed by that stage)", classes="section"
        )
        yield Static(id="table")
        yield Static("What each stage did", classes="section")
        yield Static(id="stages")

    def on_mount(self) -> None:
        self.load()

    def load(self) -> None:
        session = self.link.session
        if self.step is None and self.answer is None and session.step_gate.pending is not None:
            self._show_pending()
            return
        if self.answer is None:
            refs = answers(session)
            self.answer = refs[-1] if refs else None
        if self.answer is None:
            self.query_one("#source", Static).update(
                "No answer yet: send a prompt (or use step mode, F3), then open this view."
            )
            return
        if self.step is None:
            self.step = len(self.answer.trace) - 1
        self._recompute_shown()

    def _show_pending(self) -> None:
        """The step waiting in step mode, from its own logits (no forward pass needed)."""
        session = self.link.session
        self.pending = True
        where = (
            f"the step waiting in step mode: step {session.step_gate.pending.index + 1}, from its own logits"
        )
        self.show(pending_stages(session), where)

    def _recompute_shown(self) -> None:
        answer, step = self.answer, self.step
        where = f"step {step + 1} of {answer.label} ({len(answer.trace)} steps)"
        if self.link.app.turns.busy:  # engine.call queues behind the answer being written
            why = (
                f"{where}: recomputing it needs the model, which is busy answering; it runs as soon as "
                "the answer ends (Esc in the chat stops it; F3 step mode shows a waiting step at once)."
            )
            self.query_one("#source", Static).update(Content.styled(why, "$text-warning"))
        else:
            self.query_one("#source", Static).update(f"recomputing {where} on the inference thread…")
        self.run_worker(self._recompute(answer, step), exclusive=True)

    def action_step(self, delta: int) -> None:
        """Another step of the same answer (each is recomputed: one forward pass)."""
        if self.pending or self.answer is None or self.step is None:
            if self.pending:
                self.notify("Step mode shows the waiting step; choose a token (s, g, 1–9) to move on.")
            return
        step = max(0, min(self.step + delta, len(self.answer.trace) - 1))
        if step != self.step:
            self.step = step
            self._recompute_shown()

    def action_answer(self, delta: int) -> None:
        """The same view for another answer of the conversation (its last step)."""
        refs = answers(self.link.session)
        if self.pending or not refs:
            return
        at = next((i for i, r in enumerate(refs) if self.answer and r.trace is self.answer.trace), len(refs))
        self.answer = refs[(at + delta) % len(refs)]
        self.step = len(self.answer.trace) - 1
        self._recompute_shown()

    async def _recompute(self, answer: AnswerRef, step: int) -> None:
        message = answer.message
        if message is None and answer.trace is not self.link.session.trace:
            self.query_one("#source", Static).update(
                "A kept branch cannot be recomputed: its context is no longer the conversation's."
            )
            return
        try:
            stages = await self.on_engine(self.link.engine.call(lambda s: stages_at(s, step, message)))
        except Exception as e:  # the engine said why (e.g. no such step)
            self.query_one("#source", Static).update(plain_text(f"✖ {e}"))
            return
        self.show(stages, recomputed_at(answer, step, self.link.session.sampling))

    def show(self, stages: SamplerStages, source: str) -> None:
        self.stages = stages
        self.query_one("#source", Static).update(source)
        self.query_one("#table", Static).update(Content("\n").join(table(stages)))
        self.query_one("#stages", Static).update(Content("\n").join(stage_lines(stages)))
        self.set_title_line(source.split(",")[0])

    def engine_said(self, event: Event) -> None:
        if isinstance(event, TurnFinished) and self.stages is None:
            self.load()
