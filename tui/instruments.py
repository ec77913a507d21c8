"""The teaching instruments as the app reaches them: keys, palette commands, and the engine link.

The app owns one `Instruments`. It opens each instrument's screen (tui/screens/), passes the
engine events an instrument reacts to (step mode, fork, a finished turn), and starts a fork.
Instruments read the running session in two ways only:

* plain reads of finished data (an answer's trace, the tokenizer) on the UI thread, through
  `engine.session`, a `SessionView` (engine/instruments/view.py); the step gate's pending
  step too, since the inference thread is blocked while it waits;
* anything that runs the model goes through `engine.call(fn)`, on the inference thread (or
  `engine.call_at_gate(fn)` while that thread waits at the step gate).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Awaitable, Iterable

from textual.binding import Binding

from engine.events import DraftRound, Event, Forked, PhaseChanged, StepPaused, TurnFinished, TurnStats
from engine.speculative.speedup import PlainBaseline, SpeedUp
from engine.thinking import split_saved
from tui.app_parts import InstrumentView

if TYPE_CHECKING:
    from textual.app import SystemCommand
    from textual.screen import Screen

    from engine.instruments.trace import AnswerTrace
    from engine.instruments.view import SessionView
    from tui.app_parts import AppParts
    from tui.engine_link import Engine


@dataclass(frozen=True)
class Instrument:
    name: str
    """Its key in engine/instruments/explain.py and in the `instrument` action."""
    key: str
    label: str
    """Short, for the footer."""
    title: str
    help: str
    """One line for the command palette."""
    guide: str
    """Its row in F1 help (Markdown)."""
    screen: str | None
    """Its screen as `module:Class`, taking `(link, step=None, answer=None)`; None for step mode,
    whose key toggles the gate (the gate opens `StepScreen` when it pauses)."""
    remote: bool = False
    """It works from what a server sent (the rest need the weights or the decode loop)."""


INSTRUMENTS = (
    Instrument(
        "inspector",
        "f2",
        "Inspect",
        "Token inspector",
        "Every step of an answer: ID, bytes, logprob, rank, entropy, KV slot, alternatives; fork from one",
        "token inspector: every step of any answer (←→, or click a chip in Tokens); **f** forks from "
        "the highlighted alternative",
        "tui.screens.inspector:InspectorScreen",
        remote=True,
    ),
    Instrument(
        "step",
        "f3",
        "Step mode",
        "Step mode (toggle)",
        "Pause before each token and choose it: sampled, greedy or any alternative",
        "step mode on/off: each token waits; **s** sampled, **g** greedy, **1–9** an alternative, **r** "
        "resume",
        None,
    ),
    Instrument(
        "stages",
        "f4",
        "Stages",
        "Sampler stages",
        "How penalty, temperature, top-k, top-p and min-p reshape one step's distribution",
        "sampler stages: how penalty, temperature, top-k, top-p, min-p reshape the step's distribution",
        "tui.screens.stages:StagesScreen",
    ),
    Instrument(
        "tokenizer",
        "f5",
        "Tokenizer",
        "Tokenizer view",
        "Prompt and answer as pieces with IDs, the chat template, cached vs new; "
        "compare the cost of two texts",
        "tokenizer view: pieces and IDs, chat template, cached vs new; compare the cost of two texts",
        "tui.screens.tokenizer:TokenizerScreen",
        remote=True,
    ),
    Instrument(
        "phases",
        "f6",
        "Phases",
        "Two phases, measured",
        "Prefill vs decode: FLOP/s, bytes/s and arithmetic intensity against this machine's peaks",
        "two phases measured: FLOP/s, bytes/s, arithmetic intensity against this machine's peaks",
        "tui.screens.phases:PhasesScreen",
    ),
    Instrument(
        "attention",
        "f7",
        "Attention",
        "Attention view",
        "Where the newest token looks, per layer and head, summed per message (slows decoding while open)",
        "attention view by layer and head, query heads grouped under their K/V head; **m** the whole "
        "prompt's causal matrix, ↑↓ choose the query row (slows decoding while open)",
        "tui.screens.attention:AttentionScreen",
    ),
    Instrument(
        "precision",
        "f8",
        "Precision",
        "Precision compare",
        "The last turn at two precisions: top-1 agreement, KL, first divergent token, speed and memory",
        "precision compare: the last turn at two precisions",
        "tui.screens.precision:PrecisionScreen",
    ),
    Instrument(
        "lab",
        "f9",
        "Lab",
        "Serving lab",
        "Continuous batching over a paged KV cache: three policies on one workload, a decode sweep over B",
        "serving lab: continuous batching over a paged KV cache, three policies and a decode sweep",
        "tui.screens.lab:LabScreen",
    ),
)
LESSONS = (
    Instrument(
        "context",
        "x in F6",
        "Context",
        "Context length is not free",
        "Prefill and decode at 16 ... 2,048 tokens: TTFT, ITL and when the KV cache outweighs the weights",
        "context length is not free: TTFT and ITL measured at 16 … 2,048 tokens, and when the KV cache "
        "outweighs the weights",
        "tui.screens.context:ContextScreen",
    ),
    Instrument(
        "embeddings",
        "e in F2",
        "Embeddings",
        "Embeddings",
        "A token's embedding row: its norm, its nearest tokens by cosine, and what RoPE does to it",
        "embeddings: the token's embedding row, its nearest tokens, what RoPE does to it",
        "tui.screens.embeddings:EmbeddingsScreen",
    ),
    Instrument(
        "lens",
        "l in F2",
        "Lens",
        "Logit lens",
        "What the model would predict after each layer, for one step: where the answer appears",
        "logit lens: the top guesses and entropy after every layer, for the selected step",
        "tui.screens.lens:LensScreen",
    ),
    Instrument(
        "ablation",
        "h in F2",
        "Ablate",
        "Ablation: turn off a head or an MLP",
        "One attention head or a layer's MLP off for one step: the next-token distribution beside "
        "the original, and the KL between them",
        "ablation: one head or a layer's MLP off, the next-token distribution beside the original",
        "tui.screens.ablation:AblationScreen",
    ),
)
"""Views without an F-key of their own: opened from another instrument (`key` says where) or Ctrl+P."""
BY_NAME = {i.name: i for i in INSTRUMENTS + LESSONS}
REMOTE = {i.name for i in INSTRUMENTS + LESSONS if i.remote}
SHOWN: set[str] = set()
"""Instruments whose key the main footer shows (the 80-column footer is full: all are in
F1 help and Ctrl+P)."""

INSTRUMENT_BINDINGS = [
    # priority: the prompt (a TextArea) binds F5-F7 to selections; the instruments win
    Binding(i.key, f"instrument('{i.name}')", i.label, show=i.name in SHOWN, priority=True)
    for i in INSTRUMENTS
]


SCREENS = {i.name: tuple(i.screen.split(":")) for i in INSTRUMENTS + LESSONS if i.screen}


def help_table() -> str:
    """F1 help's table of the instruments, from their records."""
    rows = [f"| {_key_markdown(i.key)} | {i.guide} |" for i in INSTRUMENTS + LESSONS]
    return "\n".join(["| Key | Instrument |", "|---|---|", *rows])


def _key_markdown(key: str) -> str:
    """`f2` -> **F2**; `x in F6` -> **x** in F6."""
    first, _, rest = key.partition(" ")
    return f"**{first.upper() if first.startswith('f') else first}**" + (f" {rest}" if rest else "")


@dataclass(frozen=True)
class AnswerRef:
    """One answer the instruments can look at."""

    label: str
    message: int | None
    """Its index in session.messages; None for the answer in progress and for a kept branch."""
    trace: AnswerTrace


def answers(session: SessionView) -> list[AnswerRef]:
    """The answers generated in this session that have a token history, oldest first.

    Reads finished traces (never changed once the answer is in `messages`); the answer in
    progress comes last, as far as it has got.
    """
    refs: list[AnswerRef] = []
    messages = list(session.messages)
    number = 0
    for index, message in enumerate(messages):
        if message.role != "assistant":
            continue
        number += 1
        if message.trace is not None:
            forked = (
                f", forked at step {message.trace.fork_step + 1}"
                if message.trace.fork_step is not None
                else ""
            )
            refs.append(AnswerRef(f"answer {number} (message {index + 1}{forked})", index, message.trace))
    current = session.trace
    if current is not None and len(current) and all(r.trace is not current for r in refs):
        refs.append(AnswerRef("the answer in progress", None, current))
    return refs


@dataclass(frozen=True)
class PendingFork:
    message: int
    trace: AnswerTrace
    step: int
    token_id: int
    last: bool
    """The forked answer is the last message (its box in the chat becomes the kept branch)."""


class Instruments:
    def __init__(self, app: AppParts) -> None:
        self.app = app
        self.last_stats: TurnStats | None = None
        """The newest finished turn's measurements (for the two phases)."""
        self._fork: PendingFork | None = None
        self.plain = PlainBaseline()
        """Plain answers' decode speeds in this session: what speculation is measured against."""
        self.speedup: SpeedUp | None = None
        """The newest answer's speed-up over plain decoding, when it was speculative."""
        self.spec_rounds: tuple[DraftRound, ...] = ()
        """The rounds of the newest answer that had any (the phases view times a verify pass)."""
        self._rounds: list[DraftRound] = []

    # -- the engine ----------------------------------------------------------------
    @property
    def engine(self) -> Engine:
        """The started engine; instruments open only once it has a session (see `_ready`)."""
        if self.app.engine is None:
            raise RuntimeError("the engine has not started")
        return self.app.engine

    @property
    def session(self) -> SessionView | None:
        """The running session, once a model has loaded (the fake engines of some tests have none)."""
        return None if self.app.engine is None else self.app.engine.session

    @property
    def local(self) -> bool:
        """The weights are in this process: the session's capabilities say once there is one; before,
        the options do (a server is chosen before it answers)."""
        session = self.session
        return not self.app.options.remote if session is None else session.capabilities.has_weights

    def _ready(self, name: str) -> bool:
        if not self.local and name not in REMOTE:  # weights, cache and decode loop: on the server
            title = BY_NAME[name].title if name in BY_NAME else "This instrument"
            self.app.notify(
                f"{title} reads the model's weights, KV cache or decode loop: it needs the local engine "
                "(run llmchat without --server). The Tokens, Phase, KV cache and Top-k panels show "
                "what the server reports.",
                severity="warning",
                timeout=8,
            )
            return False
        if self.session is None:
            self.app.notify(
                "The instruments read the loaded model: wait until it has loaded.", severity="warning"
            )
            return False
        return True

    # -- opening -------------------------------------------------------------------
    def open(self, name: str, step: int | None = None, answer: AnswerRef | None = None) -> Awaitable | None:
        """Open instrument `name` (the `instrument` action, a palette command, a chip click): what
        to await for its screen to be mounted, or None where it did not open (said why)."""
        if name == "step":
            self.toggle_step()
            return None
        if not self._ready(name):
            return None
        screen = self._screen(name, step, answer)
        if isinstance(self.app.screen, InstrumentView):
            return self.app.switch_screen(screen)
        return self.app.push_screen(screen)

    def _screen(self, name: str, step: int | None, answer: AnswerRef | None) -> Screen[None]:
        if name not in SCREENS:
            raise ValueError(f"no instrument {name!r}")
        # Imported only now: each screen imports torch-backed engine modules, loaded with the model.
        module, class_name = SCREENS[name]
        screen_class = getattr(importlib.import_module(module), class_name)
        return screen_class(self, step=step, answer=answer)

    def commands(self) -> Iterable[SystemCommand]:
        from textual.app import SystemCommand

        for instrument in INSTRUMENTS:
            yield SystemCommand(
                f"Instrument: {instrument.title}",
                f"{instrument.help} ({instrument.key.upper()})",
                lambda name=instrument.name: self.open(name),
            )
        for lesson in LESSONS:
            yield SystemCommand(
                f"Lesson: {lesson.title}",
                f"{lesson.help} ({lesson.key})",
                lambda name=lesson.name: self.open(name),
            )
        if isinstance(self.app.screen, InstrumentView):
            screen = self.app.screen
            yield SystemCommand(
                "Explain this instrument", "What it shows, and the formula (?)", screen.action_explain
            )

    # -- events ---------------------------------------------------------------------
    async def on_event(self, event: Event) -> None:
        """Every in-order engine event passes here before the main panels show it."""
        match event:
            case StepPaused():
                self._step_paused(event)
            case Forked():
                await self._forked(event)
            case TurnFinished(stats):
                self.last_stats = stats
                self._measure_speculation(stats)
                self._turn_finished()
            case DraftRound():
                self._rounds.append(event)
            case PhaseChanged(phase="prefill"):
                self._rounds = []
        for screen in self.app.screen_stack:
            if isinstance(screen, InstrumentView):
                screen.engine_said(event)

    def _measure_speculation(self, stats: TurnStats) -> None:
        session = self.session
        self.speedup = self.plain.finished(stats, session.info if session is not None else None)
        if self._rounds:
            self.spec_rounds, self._rounds = tuple(self._rounds), []

    # -- step mode --------------------------------------------------------------------
    @property
    def stepping(self) -> bool:
        session = self.session
        return session is not None and session.capabilities.can_step and session.step_gate.enabled

    def toggle_step(self) -> None:
        if not self._ready("step"):
            return
        gate = self.session.step_gate
        if gate.enabled:
            self.resume()
            return
        gate.pause()
        self.app.notify(
            "Each next token now waits for your choice: "
            "s sampled · g greedy · 1–9 an alternative · r resume.",
            title="Step mode on",
        )

    def resume(self) -> None:
        """Step mode off; a waiting step takes its sampled token and decoding runs at full speed."""
        if self.session is not None:
            self.session.step_gate.resume()
        self.answer_note("decoding… (Esc stops)")
        from tui.screens.step import StepScreen

        if isinstance(self.app.screen, StepScreen):
            self.app.pop_screen()
        self.app.notify("Decoding runs at full speed again.", title="Step mode off")

    def answer_note(self, note: str) -> None:
        """The line under the answer in progress, if one is."""
        from tui.widgets.chat_log import ChatLog

        current = self.app.part(ChatLog).current
        if current is not None:
            current.set_note(note)

    def _step_paused(self, event: StepPaused) -> None:
        from tui.screens.step import StepScreen
        from tui.widgets.phase import PhasePanel

        self.answer_note(f"⏸ step mode: token {event.index + 1} waits for your choice (F3 turns it off)")
        self.app.part(PhasePanel).step_waiting(event.index)

        for screen in self.app.screen_stack:
            if isinstance(screen, StepScreen):
                screen.show(event)
                return
        self.app.push_screen(StepScreen(self, event))

    def _turn_finished(self) -> None:
        from tui.screens.step import StepScreen

        if isinstance(self.app.screen, StepScreen):
            self.app.pop_screen()
            if self.stepping:
                self.app.notify(
                    "The answer ended. Step mode stays on: "
                    "the next answer pauses at its first token (F3 turns it off)."
                )

    # -- fork ---------------------------------------------------------------------------
    def fork(self, answer: AnswerRef, step: int, token_id: int) -> bool:
        """Continue `answer` from `step` with `token_id`; False (and why, in a notice) if it cannot now."""
        turns, session = self.app.turns, self.session
        if not (self.local if session is None else session.capabilities.can_fork):
            self.app.notify(
                "Forking needs the local engine: a server cannot continue from a chosen token.",
                severity="warning",
            )
            return False
        if answer.message is None:
            self.app.notify("Only a finished answer can be forked.", severity="warning")
            return False
        if not turns.ready or turns.busy:
            self.app.notify(
                "Wait for the answer in progress to end (or press Esc), then fork.", severity="warning"
            )
            return False
        turns.start_other()
        last = answer.message == len(self.session.messages) - 1
        self._fork = PendingFork(answer.message, answer.trace, step, token_id, last)
        self.engine.fork(step, token_id, answer.message)
        self.app.refresh_bindings()
        return True

    async def _forked(self, event: Forked) -> None:
        """Show the fork in the chat: where the original went, the counts, and the new answer's first text.

        With saving on, the forked answer is a new version of the answer it replaces (the log
        drops the old box, as for an edit; its arrows step back to the original). Otherwise
        the old box stays above, marked as the kept branch.
        """
        from tui.widgets.chat_log import Answer, ChatLog

        pending, self._fork = self._fork, None
        chat = self.app.query_one(ChatLog)
        session = self.session
        kept = "the original is kept as a branch (b in the inspector shows it)"
        if pending is not None and await chat.truncate_from(pending.message):
            kept = (
                "the original is kept as the answer's previous version "
                "(← → on the answer; b in the inspector)"
            )
        elif pending is not None and pending.last and chat.query(Answer):
            chat.query(Answer).last().set_note(
                f"⑂ the original continuation, kept as a branch (forked at step {event.step + 1})"
            )
            kept = "the original is kept above as a branch"
        old = pending.trace.steps[event.step] if pending is not None else None
        took = session.namer.piece(event.token_id)
        instead = f" instead of {old.piece!r}" if old is not None and old.id != event.token_id else ""
        chat.add_note(
            f"⑂ Fork at step {event.step + 1}: took {took!r}{instead}. "
            f"The KV cache kept {event.reused} positions "
            f"(the prompt and the answer's first {event.step} tokens) and fed {event.new} new; {kept}."
        )
        answer = await chat.expect_answer(f"⑂ forked: {event.reused} positions reused, {event.new} fed…")
        if pending is not None:
            thought, said = split_saved(event.start_text)  # the kept text and the chosen token's
            if thought:
                await answer.write(thought, thinking=True)
            await answer.write(said)
