"""Attention view: where the newest position looks, for one layer and head or averaged, by message.

Opening it switches the model to eager attention with hooks (`AttentionProbe.enable`) on the
inference thread; closing it switches back. While the engine is idle the view is filled by
one forward pass over the cached context (the pass that produced the last token). During an
answer it updates at each step in step mode, and when the answer ends.

While a step waits in step mode the inference thread is blocked at the gate, between two
forward passes, so the probe is switched on and read at once (`engine.call_at_gate`).
The probe itself belongs to the session (engine/instruments/attention.py `probe_of`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from textual.app import ComposeResult
from textual.binding import Binding
from textual.content import Content
from textual.widgets import Static

from engine.events import Event, StepPaused, TurnFinished
from engine.instruments.attention import AttentionView, enable_and_view, enabled_view, switch_off
from tui.fmt import subscript, visible_piece
from tui.screens.instrument import InstrumentScreen
from tui.screens.tokenizer import span_label

if TYPE_CHECKING:
    from tui.instruments import AnswerRef, Instruments

SLOW = (
    "⚠ eager attention while this view is open: every forward pass is slower. Closing it (Esc) switches back."
)
LEVELS = (
    (0.20, "$text-error on $error-muted"),
    (0.05, "$text-warning on $warning-muted"),
    (0.01, "$text-primary on $primary-muted"),
    (0.0, "$text-muted"),
)
"""Weight floors and chip styles: the more attention, the hotter."""


def weight_style(weight: float) -> str:
    return next(style for floor, style in LEVELS if weight >= floor)


def span_lines(view: AttentionView, width: int) -> list[Content]:
    lines = []
    for sw in view.spans:
        filled = round(width * sw.weight)
        lines.append(
            Content.assemble(
                (f"{span_label(sw.span):<22}", "bold"),
                f"{sw.span.tokens:>5} tokens  ",
                ("█" * filled, "$accent"),
                ("░" * (width - filled), "$text-muted 30%"),
                f" {sw.weight:6.1%}",
            )
        )
    return lines


def top_lines(view: AttentionView, pieces: list[str], count: int = 8) -> list[Content]:
    order = sorted(range(len(view.weights)), key=lambda i: view.weights[i], reverse=True)[:count]
    role_at = {}
    for sw in view.spans:
        for i in range(sw.span.start, sw.span.end):
            role_at[i] = span_label(sw.span)
    lines = [
        Content.assemble(
            ("position".rjust(8), "bold"),
            ("  piece".ljust(18), "bold"),
            ("weight".rjust(8), "bold"),
            ("  message", "bold"),
        )
    ]
    for i in order:
        lines.append(
            Content.assemble(
                f"{i:>8}  ",
                (visible_piece(pieces[i])[:15].ljust(16), weight_style(view.weights[i])),
                f"{view.weights[i]:8.2%}",
                f"  {role_at.get(i, '')}",
            )
        )
    return lines


def heat_chips(view: AttentionView, pieces: list[str]) -> Content:
    parts: list = []
    for i, (token, w) in enumerate(zip(view.ids, view.weights)):
        parts += [(visible_piece(pieces[i]), weight_style(w)), (subscript(token), "$text-muted"), " "]
    return Content.assemble(*parts)


class AttentionScreen(InstrumentScreen):
    INSTRUMENT = "attention"
    BINDINGS = [
        Binding("left", "layer(-1)", "Layer ←", show=False),
        Binding("right", "layer(1)", "Layer →"),
        Binding("up", "head(-1)", "Head ↑", show=False),
        Binding("down", "head(1)", "Head ↓"),
        Binding("a", "average", "Average all"),
    ]
    BODY_FOCUS = False

    def __init__(self, link: Instruments, step: int | None = None, answer: AnswerRef | None = None) -> None:
        super().__init__(link, step, answer)
        info = link.session.info
        self.n_layers, self.n_heads = info.layers, info.heads
        self.layer_no: int | None = None
        self.head_no: int | None = None
        self.view: AttentionView | None = None
        self._suspended = False

    def compose_body(self) -> ComposeResult:
        yield Static(SLOW, classes="warning")
        yield Static(id="selector")
        yield Static(id="status", classes="muted")
        yield Static("Attention by message", classes="section")
        yield Static(id="spans")
        yield Static("Most attended positions", classes="section")
        yield Static(id="top")
        yield Static("The context, shaded by attention", classes="section")
        yield Static(id="heat")

    def on_mount(self) -> None:
        self._selector()
        self.refresh_view()

    def on_unmount(self) -> None:
        self._switch_off()

    def on_screen_suspend(self) -> None:
        """Another screen covers this one (settings, the palette...): no eager attention while unseen.

        It also keeps a model switch from Settings from happening with the probe on."""
        self._suspended = True
        self._switch_off()

    def on_screen_resume(self) -> None:
        if self._suspended:  # not at the first showing: on_mount reads the probe then
            self._suspended = False
            self.refresh_view()

    def _switch_off(self) -> None:
        if self.link.session is not None:
            self.link.engine.call(switch_off)

    # -- choosing the layer and head ----------------------------------------------------
    @staticmethod
    def _cycle(value: int | None, delta: int, count: int) -> int | None:
        options = [None, *range(count)]
        return options[(options.index(value) + delta) % len(options)]

    def action_layer(self, delta: int) -> None:
        self.layer_no = self._cycle(self.layer_no, delta, self.n_layers)
        self._selector()
        self.refresh_view()

    def action_head(self, delta: int) -> None:
        self.head_no = self._cycle(self.head_no, delta, self.n_heads)
        self._selector()
        self.refresh_view()

    def action_average(self) -> None:
        self.layer_no = self.head_no = None
        self._selector()
        self.refresh_view()

    def _selector(self) -> None:
        layer = "average of all" if self.layer_no is None else f"{self.layer_no} (of 0–{self.n_layers - 1})"
        head = "average of all" if self.head_no is None else f"{self.head_no} (of 0–{self.n_heads - 1})"
        self.query_one("#selector", Static).update(
            Content.assemble(
                ("layer ", "bold"),
                layer,
                ("  ← →", "$text-muted"),
                ("   head ", "bold"),
                head,
                ("  ↑ ↓", "$text-muted"),
                ("   a averages both", "$text-muted"),
            )
        )

    # -- reading the probe -------------------------------------------------------------
    def refresh_view(self) -> None:
        session = self.link.session
        if session.step_gate.pending is not None:  # the inference thread waits at the gate
            layer, head = self.layer_no, self.head_no
            view = self.link.engine.call_at_gate(lambda s: enabled_view(s, layer, head))
            self.show(view, waiting="recorded from the next step on: take a token")
            return
        if getattr(self.app, "turns", None) is not None and self.app.turns.busy:
            self._status(
                "decoding at full speed: the view fills in when the answer ends "
                "(or at each step in step mode, F3)"
            )
        self.run_worker(self._fetch(), exclusive=True)

    async def _fetch(self) -> None:
        layer, head = self.layer_no, self.head_no
        try:
            view = await self.on_engine(self.link.engine.call(lambda s: enable_and_view(s, layer, head)))
        except Exception as e:
            self._status(f"✖ {e}")
            return
        self.show(view, waiting="no forward pass yet: send a prompt")

    def _status(self, text: str) -> None:
        self.query_one("#status", Static).update(text)

    def show(self, view: AttentionView | None, waiting: str) -> None:
        self.view = view
        if view is None:
            self._status(f"nothing recorded yet: {waiting}")
            return
        self._status(
            f"query position {view.query_position} "
            f"(its output predicts the token at {view.query_position + 1}) · "
            f"{len(view.ids)} positions in the context · the weights sum to {sum(view.weights):.3f}"
        )
        pieces = list(self.link.session.namer.pieces(view.ids))
        self.query_one("#spans", Static).update(Content("\n").join(span_lines(view, 30)))
        self.query_one("#top", Static).update(Content("\n").join(top_lines(view, pieces)))
        self.query_one("#heat", Static).update(heat_chips(view, pieces))

    def engine_said(self, event: Event) -> None:
        if isinstance(event, (StepPaused, TurnFinished)):
            self.refresh_view()
