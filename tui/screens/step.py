"""Step mode: the paused step's candidates at the bottom of the screen; the student picks the token.

The decode loop waits at the session's step gate (engine/instruments/stepping.py) after
drawing each token; this sheet shows that draw (`StepPaused`) and answers the gate with the
sampled token, the greedy one, or any alternative. The answer keeps growing in the chat above.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Static

from engine.events import Candidate, StepPaused
from engine.instruments.explain import explain
from tui.fmt import visible_piece
from tui.widgets.alternatives import AlternativesList
from tui.widgets.explanation import ExplanationPanel

HINT = (
    "s sampled · g greedy · 1–9 or ↑↓ Enter an alternative · t stages of this step · "
    "r resume full speed · x stop the answer · ? explain"
)


def candidates_of(event: StepPaused) -> tuple[Candidate, ...]:
    """The step's top-k, with the sampled token added where it fell outside it."""
    if any(c.id == event.sampled.id for c in event.top_k):
        return event.top_k
    return (*event.top_k, event.sampled)


def marks_of(event: StepPaused) -> dict[int, str]:
    if event.sampled.id == event.greedy.id:
        return {event.sampled.id: "◀ sampled = greedy"}
    return {event.sampled.id: "◀ sampled", event.greedy.id: "◀ greedy"}


def waiting_line(event: StepPaused) -> Content:
    """The waiting step: where it is, what the sampler drew, and what greedy would take."""
    s, g = event.sampled, event.greedy
    model = event.model_probs
    return Content.assemble(
        ("step ", "bold"),
        f"{event.index + 1}",
        (" · KV position ", "bold"),
        f"{event.position}",
        " · ",
        ("the sampler drew ", "bold"),
        f"{visible_piece(s.piece)} ({_probs(s.prob, model and model[0])})",
        " · ",
        ("greedy would take ", "bold"),
        f"{visible_piece(g.piece)} ({_probs(g.prob, model and model[1])})",
    )


def _probs(drawn: float, model: float | None) -> str:
    """The probability the sampler drew from (after temperature and the filters) beside the model's
    own (F4's): 'drew five (100.0%)' read as the model's certainty where it was 91.91%."""
    if model is None:
        return f"{drawn:.1%}"
    return f"{drawn:.1%} as sampled, model {model:.2%}"


def held_back(steps: list) -> list[str]:
    """The pieces of the last steps that add no text yet: they hold part of a UTF-8 character."""
    held: list[str] = []
    for step in reversed(steps):
        if step.text:
            break
        held.insert(0, visible_piece(step.piece))
    return held


class StepScreen(ModalScreen[None]):
    DEFAULT_CSS = """
    StepScreen { align: center top; }
    StepScreen > #sheet { width: 100%; height: auto; max-height: 80%; border: thick $accent;
        border-title-color: $text; background: $surface; padding: 0 1; }
    StepScreen #hint { color: $text-muted; }
    StepScreen #state { margin-top: 1; }
    StepScreen #so-far { color: $text-muted; text-wrap: nowrap; text-overflow: ellipsis; }
    """
    BINDINGS = [
        Binding("s", "take_sampled", "Sampled"),
        Binding("g", "take_greedy", "Greedy"),
        *(Binding(str(n), f"take_rank({n})", f"Rank {n}", show=False) for n in range(1, 10)),
        Binding("up", "move(-1)", "Up", show=False),
        Binding("down", "move(1)", "Down", show=False),
        Binding("enter", "take_highlighted", "Take"),
        Binding("t", "stages", "Stages"),
        Binding("r,escape", "resume", "Resume"),
        Binding("x", "stop", "Stop answer"),
        Binding("question_mark", "explain", "Explain"),
    ]

    def __init__(self, link, event: StepPaused) -> None:
        super().__init__()
        self.link = link
        self.event = event
        self.waiting = True
        """A step waits for a choice (False between a choice and the next StepPaused)."""

    def compose(self) -> ComposeResult:
        with Vertical(id="sheet"):
            yield ExplanationPanel(explain("step"))
            yield Static(id="so-far")
            yield Static(id="state")
            yield AlternativesList("screen.take_row({})")
            yield Static(HINT, id="hint")

    def on_mount(self) -> None:
        self.query_one("#sheet").border_title = "Step mode: you choose each token"
        self.show(self.event)

    def show(self, event: StepPaused) -> None:
        self.event, self.waiting = event, True
        self._so_far()
        self.query_one("#state", Static).update(waiting_line(event))
        candidates = candidates_of(event)
        cursor = next((i for i, c in enumerate(candidates) if c.id == event.sampled.id), 0)
        self.query_one(AlternativesList).set_candidates(candidates, marks_of(event), cursor)

    def _so_far(self) -> None:
        """The answer up to the waiting step (the inference thread is blocked at the gate: a safe read).

        Tokens that hold part of a UTF-8 character add no text yet; they are shown as pieces.
        """
        trace = self.link.session.trace
        steps = list(trace.steps) if trace is not None else []
        held = held_back(steps)
        text = "".join(step.text for step in steps).replace("\n", " ↵ ")
        tail = text[-max(20, self.size.width - 40) :]
        parts: list = [("answer so far ", "bold"), repr(tail) if tail else "(no text yet)"]
        if held:
            parts.append((" + held back (part of a character): " + " ".join(held), "$text-warning"))
        self.query_one("#so-far", Static).update(Content.assemble(*parts))

    # -- choosing -----------------------------------------------------------------------
    def _take(self, token_id: int | None, greedy: bool = False) -> None:
        if not self.waiting:
            return
        gate = self.link.session.step_gate
        try:
            draw = gate.take_greedy() if greedy else gate.take(token_id)
        except (RuntimeError, ValueError) as e:
            self.notify(str(e), severity="warning")
            return
        self.waiting = False
        self.link.answer_note(f"step mode: token {self.event.index + 1} taken; the model computes the next…")
        piece = visible_piece(self.link.session.namer.piece(draw.id))
        computing = (" · the model is computing the next step…", "$text-muted")
        self.query_one("#state", Static).update(Content.assemble(("took ", "bold"), piece, computing))

    def action_take_sampled(self) -> None:
        self._take(None)

    def action_take_greedy(self) -> None:
        self._take(None, greedy=True)

    def action_take_rank(self, rank: int) -> None:
        candidates = self.query_one(AlternativesList).candidates
        if rank <= len(candidates):
            self._take(candidates[rank - 1].id)

    def action_take_row(self, row: int) -> None:
        self.action_take_rank(row + 1)

    def action_take_highlighted(self) -> None:
        chosen = self.query_one(AlternativesList).highlighted
        if chosen is not None:
            self._take(chosen.id)

    def action_move(self, delta: int) -> None:
        self.query_one(AlternativesList).move(delta)

    def action_stages(self) -> None:
        if self.waiting:
            self.link.open("stages")

    def action_resume(self) -> None:
        self.link.resume()

    def action_stop(self) -> None:
        self.link.app.action_stop()

    def action_explain(self) -> None:
        self.query_one(ExplanationPanel).toggle()
