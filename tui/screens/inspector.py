"""Token inspector: a cursor over the steps of any answer, what each step was, and fork from an alternative.

The steps come from the answer's trace (`session.messages[i].trace`), read as they were
emitted; nothing is recomputed. Forking goes through the engine (`engine.fork`) and the
chat shows the new continuation; the original stays as a branch (`b` shows it here).
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.widgets import Static

from engine.events import Candidate, Event, Forked, TurnFinished
from engine.instruments.trace import TokenRecord
from tui.fmt import count, fixed, logprob_style, visible_piece
from tui.instruments import AnswerRef, Instruments, answers
from tui.screens.instrument import InstrumentScreen
from tui.widgets.alternatives import AlternativesList
from tui.widgets.token_strip import StripToken, TokenStrip


def same_token(candidate: Candidate, record: TokenRecord) -> bool:
    """By id, or by text where a server sent no ids."""
    if candidate.id is not None and record.id is not None:
        return candidate.id == record.id
    return candidate.piece == record.piece


def byte_text(data: bytes | None, server: bool = False) -> str:
    if data is None:
        maybe = " (or not sent by the server)" if server else ""
        return f"none: a special token of the chat template{maybe}"
    return " ".join(f"{b:02x}" for b in data) + f"  ({len(data)} byte{'s' if len(data) != 1 else ''})"


NOT_SENT = ("not sent by the server", "$text-muted")


def step_text(record: TokenRecord, last: bool) -> str:
    """The text a step added; a special token and a split character each say why there is none."""
    if record.text:
        return repr(record.text)
    if record.bytes is None:
        what = f"none: {record.piece} is a special token, a marker of the chat template, not text"
        return what + (" (the model's end of the answer: decoding stops when it is drawn)" if last else "")
    return "nothing yet: it holds part of a UTF-8 character"


def record_lines(
    record: TokenRecord, steps: int, forked_here: bool, ended: bool = False, server: bool = False
) -> list[Content]:
    """What the inspector says about one step; `ended`: it is the last step of a finished answer.
    `server`: it came from a server, and what the server did not send is said so."""
    label = lambda name: (f"{name:<10}", "bold")  # noqa: E731
    text = step_text(record, ended)
    position = "not known" if record.position is None else f"{record.position}"
    return [
        Content.assemble(
            ("step ", "bold"), f"{record.step + 1} of {steps}", ("  · KV cache position ", "bold"), position
        ),
        Content.assemble(label("ID"), NOT_SENT if record.id is None else f"{record.id}"),
        Content.assemble(label("piece"), (visible_piece(record.piece), logprob_style(record.logprob))),
        Content.assemble(label("bytes"), byte_text(record.bytes, server)),
        _logprob_line(record, label),
        Content.assemble(label("rank"), f"{record.rank}", (f"  ({_rank_text(record)})", "$text-muted")),
        _entropy_line(record, label),
        Content.assemble(label("text"), text),
        *_step_notes(forked_here, ended, server),
    ]


def _rank_text(record: TokenRecord) -> str:
    """How many tokens were more probable than the one taken (rank 0: not known)."""
    if record.rank == 0:
        return "unknown"
    more = record.rank - 1
    were = "was" if more == 1 else "were"
    return f"{count(more, 'token')} {were} more probable" if more else "the most probable"


def _step_notes(forked_here: bool, ended: bool, server: bool) -> list[Content]:
    """The lines under a step: why the last token is not in the cache, and where a fork began."""
    notes = []
    if ended and not server:  # a server's cache is its own: it does not say what it fed back
        notes.append(
            Content.styled(
                "not in the cache at the time: decoding stopped on this token, so it was never fed back "
                "(the next turn prefills it)",
                "$text-muted",
            )
        )
    if forked_here:
        notes.append(
            Content.styled("⑂ forked here: this token was chosen from the alternatives", "$text-accent")
        )
    return notes


def _logprob_line(record: TokenRecord, label) -> Content:
    if record.logprob is None:
        return Content.assemble(label("logprob"), NOT_SENT)
    return Content.assemble(
        label("logprob"), fixed(record.logprob, 4), ("  p = ", "$text-muted"), f"{record.prob:.2%}"
    )


def _entropy_line(record: TokenRecord, label) -> Content:
    if record.entropy is None:
        return Content.assemble(
            label("entropy"), ("not known: the server sends only the top alternatives", "$text-muted")
        )
    return Content.assemble(
        label("entropy"),
        f"{fixed(max(0.0, record.entropy_bits), 3)} bits",
        (
            f"  ({fixed(max(0.0, record.entropy), 3)} nats)"
            f" ≈ a fair choice among {record.choices:.1f} tokens",
            "$text-muted",
        ),
    )


def fork_hint(can_fork: bool, finished: bool) -> str:
    """Under the alternatives: how to fork, or why this answer cannot be forked."""
    if not can_fork:
        return "Forking from a token needs the local engine (a server cannot continue from one)."
    if not finished:
        return "Only a finished answer in the conversation can be forked."
    return "↑↓ or click choose · f / Enter forks: the answer continues from the highlighted token"


def _show_alternatives(alternatives: AlternativesList, record: TokenRecord) -> None:
    """The step's candidates with the taken one marked (added below them when it was not among them)."""
    candidates = record.top_k
    taken = [c for c in candidates if same_token(c, record)]
    if not taken and record.prob is not None:  # drawn from outside the top-k shown
        candidates = (*candidates, Candidate(record.id, record.piece, record.prob))
    key = taken[0] if taken else record
    marks = {key.id if key.id is not None else key.piece: "◀ taken"}
    alternatives.set_candidates(candidates, marks, alternatives.cursor)


class InspectorScreen(InstrumentScreen):
    INSTRUMENT = "inspector"
    DEFAULT_CSS = """
    InspectorScreen TokenStrip { margin: 1 0; }
    InspectorScreen #panes { height: auto; }
    InspectorScreen #record { width: 1fr; height: auto; padding-right: 2; }
    InspectorScreen #alts-pane { width: 1fr; height: auto; }
    InspectorScreen #alts-title { text-style: bold; color: $text-primary; }
    """
    BINDINGS = [
        Binding("left", "step(-1)", "Step ←", show=False),
        Binding("right", "step(1)", "Step →"),
        Binding("home", "step_to(0)", "First", show=False),
        Binding("end", "step_to(-1)", "Last", show=False),
        Binding("up", "alternative(-1)", "Alt ↑", show=False),
        Binding("down", "alternative(1)", "Alt ↓"),
        Binding("f,enter", "fork", "Fork"),
        Binding("left_square_bracket", "answer(-1)", "Prev answer"),
        Binding("right_square_bracket", "answer(1)", "Next answer"),
        Binding("b", "branch", "Branch"),
        Binding("t", "stages", "Stages"),
        Binding("k", "tokenizer", "Tokenizer"),
        Binding("e", "embeddings", "Embedding"),
        Binding("l", "lens", "Lens"),
        Binding("h", "ablation", "Ablate"),
    ]
    BODY_FOCUS = False

    def __init__(self, link: Instruments, step: int | None = None, answer: AnswerRef | None = None) -> None:
        super().__init__(link, step, answer)
        self.refs = answers(link.session)
        self.ref: AnswerRef | None = answer or (self.refs[-1] if self.refs else None)
        self.steps = list(self.ref.trace.steps) if self.ref else []
        self.step = self._clamp(len(self.steps) - 1 if step is None else step)

    def compose_body(self) -> ComposeResult:
        yield Static(id="which")
        yield TokenStrip("screen.select({})")
        with Horizontal(id="panes"):
            yield Static(id="record")
            with Vertical(id="alts-pane"):
                yield Static(f"Alternatives ({self._which_distribution()})", id="alts-title")
                yield AlternativesList("screen.choose({})")
                yield Static(id="fork-hint", classes="muted")

    def _which_distribution(self) -> str:
        info = getattr(self.link.session, "info", None)
        if info is not None and info.server is not None:
            return f"as the server reported them: {info.server.top_k_note}"
        return "top-k after your sampling settings"

    def on_mount(self) -> None:
        self._show_answer()
        self.set_interval(0.5, self._follow)

    def _follow(self) -> None:
        """The answer in progress grows: take its new steps, and keep the cursor on the newest if it was."""
        if self.ref is None or self.ref.message is not None or len(self.ref.trace) <= len(self.steps):
            return
        newest = self.step == len(self.steps) - 1
        self.steps = list(self.ref.trace.steps)
        if newest:
            self.step = len(self.steps) - 1
        self._show_answer()

    # -- drawing ----------------------------------------------------------------------
    def _clamp(self, step: int) -> int:
        return max(0, min(step, len(self.steps) - 1)) if self.steps else 0

    def _show_answer(self) -> None:
        which = self.query_one("#which", Static)
        if self.ref is None:
            which.update(
                Content.styled("No answer yet: send a prompt, then inspect its tokens here.", "$text-muted")
            )
            self.query_one(TokenStrip).set_tokens([])
            self._show_step()
            return
        which.update(self._which_line(self.ref))
        self.query_one(TokenStrip).set_tokens(
            [StripToken(s.id, s.piece, logprob_style(s.logprob)) for s in self.steps], self.step
        )
        self._show_step()

    def _which_line(self, ref: AnswerRef) -> Content:
        """Which answer is shown: its place among the conversation's answers, and the fork it came from."""
        trace = ref.trace
        number = next((i for i, r in enumerate(self.refs) if r.trace is trace), None)
        position = (
            f" · {number + 1} of {len(self.refs)} answers"
            if number is not None
            else " · not in the conversation now"
        )
        forked = trace.parent is not None
        branch = f" · forked at step {trace.fork_step + 1} (b shows the original)" if forked else ""
        return Content.assemble(
            (ref.label, "bold"),
            f" · {len(self.steps)} steps{position}",
            (branch, "$text-accent"),
            ("   [ ] other answers · ← → steps · click a chip", "$text-muted"),
        )

    def _show_step(self) -> None:
        record_view = self.query_one("#record", Static)
        alternatives = self.query_one(AlternativesList)
        hint = self.query_one("#fork-hint", Static)
        if not self.steps:
            record_view.update("")
            alternatives.set_candidates((), {})
            hint.update("")
            self.set_title_line("")
            return
        session = self.link.session
        record = self.ref.trace.record(self.step, session.namer)
        forked_here = self.ref.trace.fork_step == self.step
        ended = self.ref.message is not None and self.step == len(self.steps) - 1
        can = session.capabilities
        lines = record_lines(record, len(self.steps), forked_here, ended, can.on_server)
        record_view.update(Content("\n").join(lines))
        _show_alternatives(alternatives, record)
        self.query_one(TokenStrip).move_to(self.step)
        self.set_title_line(f"{self.ref.label} · step {self.step + 1} of {len(self.steps)}")
        hint.update(fork_hint(can.can_fork, self.ref.message is not None))

    # -- keys -------------------------------------------------------------------------
    def action_step(self, delta: int) -> None:
        self.action_select(self.step + delta)

    def action_step_to(self, step: int) -> None:
        self.action_select(step if step >= 0 else len(self.steps) - 1)

    def action_select(self, step: int) -> None:
        self.step = self._clamp(step)
        self.query_one(AlternativesList).cursor = 0
        self._show_step()

    def action_alternative(self, delta: int) -> None:
        self.query_one(AlternativesList).move(delta)

    def action_choose(self, row: int) -> None:
        alternatives = self.query_one(AlternativesList)
        alternatives.cursor = row
        alternatives.refresh()

    def action_answer(self, delta: int) -> None:
        if not self.refs:
            return
        at = next(
            (i for i, r in enumerate(self.refs) if self.ref is not None and r.trace is self.ref.trace),
            len(self.refs),
        )
        self._switch(self.refs[(at + delta) % len(self.refs)])

    def action_branch(self) -> None:
        if self.ref is None or self.ref.trace.parent is None:
            self.notify("This answer was not forked: it has no other branch.")
            return
        parent = self.ref.trace.parent
        self._switch(
            AnswerRef(f"the original branch of {self.ref.label}", None, parent), self.ref.trace.fork_step
        )

    def _switch(self, ref: AnswerRef, step: int | None = None) -> None:
        self.ref, self.steps = ref, list(ref.trace.steps)
        self.step = self._clamp(self.step if step is None else step)
        self.query_one(AlternativesList).cursor = 0
        self._show_answer()

    def action_fork(self) -> None:
        chosen = self.query_one(AlternativesList).highlighted
        if self.ref is None or chosen is None:
            return
        if self.link.fork(self.ref, self.step, chosen.id):
            self.dismiss()

    def action_stages(self) -> None:
        if self.ref is not None:
            self.link.open("stages", step=self.step, answer=self.ref)

    def action_tokenizer(self) -> None:
        self.link.open("tokenizer", answer=self.ref)

    def action_embeddings(self) -> None:
        """The selected step's token in the embeddings view (its row, neighbours, RoPE)."""
        if self.ref is not None and self.steps:
            self.link.open("embeddings", step=self.step, answer=self.ref)

    def action_lens(self) -> None:
        """The selected step through the logit lens: the guesses after every layer."""
        if self.ref is not None and self.steps:
            self.link.open("lens", step=self.step, answer=self.ref)

    def action_ablation(self) -> None:
        """The selected step with one head or MLP turned off."""
        if self.ref is not None and self.steps:
            self.link.open("ablation", step=self.step, answer=self.ref)

    # -- engine -----------------------------------------------------------------------
    def engine_said(self, event: Event) -> None:
        """A finished turn or a fork adds an answer: read the list again, keep what is shown."""
        if isinstance(event, (TurnFinished, Forked)):
            self.refs = answers(self.link.session)
            if self.ref is None and self.refs:
                self._switch(self.refs[-1])
            elif self.ref is not None and self.ref.message is None and self.refs:
                # the answer that was in progress is now a message of the conversation
                same = next((r for r in self.refs if r.trace is self.ref.trace), None)
                if same is not None:
                    self._switch(same)
