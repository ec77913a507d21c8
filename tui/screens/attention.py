"""Attention view: where the newest position looks, for one layer and head or averaged, by message,
with the query heads grouped under the K/V head they share; `m` switches to the whole prompt: the
causal matrix of one prefill (query × key) for a layer and head, a query row chosen with ↑↓.

Opening it switches the model to eager attention with hooks (`AttentionProbe.enable`) on the
inference thread; closing it switches back. While the engine is idle the view is filled by
one forward pass over the cached context (the pass that produced the last token). During an
answer it updates at each step in step mode, and when the answer ends.

While a step waits in step mode the inference thread is blocked at the gate, between two
forward passes, so the probe is switched on and read at once (`engine.call_at_gate`).
The probe itself belongs to the session (engine/instruments/attention.py `probe_of`).
The matrix is one more eager pass over the cached context (engine/instruments/attention_matrix.py),
run with `engine.call` between answers; at the gate it waits (the model is the step's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.content import Content
from textual.widgets import Static

from engine.events import Event, StepPaused, TurnFinished
from engine.instruments.attention import AttentionView, enable_and_view, enabled_view, switch_off
from engine.instruments.attention_matrix import PrefillMatrix, prefill_matrix
from engine.instruments.explain import explain
from tui.fmt import plain_text, subscript, visible_piece
from tui.screens.attention_matrix import (
    LABEL_WIDTH,
    Window,
    grid_lines,
    head_group_lines,
    legend,
    sink_groups,
    sink_line,
    window_for,
    window_line,
)
from tui.screens.instrument import InstrumentScreen
from tui.screens.tokenizer import span_label
from tui.widgets.explanation import ExplanationPanel, explanation_content

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
                f"{sw.span.tokens:>5} {'token ' if sw.span.tokens == 1 else 'tokens'}  ",
                ("█" * filled, "$accent"),
                ("░" * (width - filled), "$text-muted 30%"),
                f" {sw.weight:6.1%}",
            )
        )
    return lines


TOP_HEAD = Content.assemble(
    ("position".rjust(8), "bold"),
    ("  piece".ljust(18), "bold"),
    ("weight".rjust(8), "bold"),
    ("  message", "bold"),
)


def top_lines(view: AttentionView, pieces: list[str], count: int = 8) -> list[Content]:
    order = sorted(range(len(view.weights)), key=lambda i: view.weights[i], reverse=True)[:count]
    role_at = {i: span_label(sw.span) for sw in view.spans for i in range(sw.span.start, sw.span.end)}
    lines = [TOP_HEAD]
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
        Binding("up", "vertical(-1)", "Head/query ↑", show=False),
        Binding("down", "vertical(1)", "Head/query ↓"),
        Binding("left_square_bracket", "head(-1)", "Head [", show=False),
        Binding("right_square_bracket", "head(1)", "Head ]", show=False),
        Binding("pageup", "query(-10)", show=False),
        Binding("pagedown", "query(10)", show=False),
        Binding("home", "query_to(0)", show=False),
        Binding("end", "query_to(-1)", show=False),
        Binding("m", "mode", "Whole prompt / newest row"),
        Binding("a", "average", "Average all"),
    ]
    BODY_FOCUS = False

    def __init__(self, link: Instruments, step: int | None = None, answer: AnswerRef | None = None) -> None:
        super().__init__(link, step, answer)
        info = link.session.info
        self.n_layers, self.n_heads, self.n_kv_heads = info.layers, info.heads, info.kv_heads
        self.windows = info.layer_windows
        self.layer_no: int | None = None
        self.head_no: int | None = None
        self.view: AttentionView | None = None
        self.matrix_mode = False
        """False: the newest position's row; True: the whole prompt's causal matrix."""
        self.matrix: PrefillMatrix | None = None
        self.query_no: int | None = None
        """The matrix row chosen (None: the last)."""
        self._top = 0
        self.window: Window | None = None
        """The part of the matrix on screen."""
        self._suspended = False

    def compose_body(self) -> ComposeResult:
        yield Static(SLOW, classes="warning")
        yield Static(id="selector")
        yield Static(id="status", classes="muted")
        yield from self._newest_row()
        yield from self._whole_matrix()

    def _newest_row(self) -> ComposeResult:
        """The newest position's attention: by message, its strongest positions, by head, as heat."""
        with Vertical(id="newest"):
            yield Static("Attention by message", classes="section")
            yield Static(id="spans")
            yield Static("Most attended positions", classes="section")
            yield Static(id="top")
            yield Static("Query heads, grouped by the K/V head they share", classes="section")
            yield Static(id="groups")
            yield Static("The context, shaded by attention", classes="section")
            yield Static(id="heat")

    def _whole_matrix(self) -> ComposeResult:
        """The whole prompt's causal matrix (m), and the chosen query row under it."""
        with Vertical(id="matrix"):
            yield Static(id="window", classes="muted")
            yield Static(legend(), id="legend")
            yield Static(id="grid")
            yield Static(id="sink")
            yield Static(id="sink-groups")
            yield Static(id="row-title", classes="section")
            yield Static(id="row-spans")
            yield Static(id="row-top")

    def on_mount(self) -> None:
        self.query_one("#matrix").display = False
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

    def on_resize(self) -> None:
        if self.matrix_mode:
            self._draw_matrix()

    def _switch_off(self) -> None:
        if self.link.session is not None:
            self.link.engine.call(switch_off)

    # -- the two modes ------------------------------------------------------------------
    def title_line(self) -> Content:
        return Content.assemble((f" {explain(self._explained()).title} ", "bold $background on $accent"))

    def _explained(self) -> str:
        return "attention_matrix" if getattr(self, "matrix_mode", False) else "attention"

    def action_mode(self) -> None:
        self.matrix_mode = not self.matrix_mode
        if self.matrix_mode:  # a matrix is of one layer and one head
            self.layer_no = self.n_layers // 2 if self.layer_no is None else self.layer_no
            self.head_no = 0 if self.head_no is None else self.head_no
        self.query_one("#newest").display = not self.matrix_mode
        self.query_one("#matrix").display = self.matrix_mode
        self.query_one(ExplanationPanel).update(explanation_content(explain(self._explained())))
        self.query_one("#title", Static).update(self.title_line())
        self._selector()
        self.refresh_view()

    # -- choosing the layer, head and query -------------------------------------------
    def _cycle(self, value: int | None, delta: int, count: int) -> int | None:
        options = list(range(count)) if self.matrix_mode else [None, *range(count)]
        value = options[0] if value not in options else value
        return options[(options.index(value) + delta) % len(options)]

    def action_layer(self, delta: int) -> None:
        self.layer_no = self._cycle(self.layer_no, delta, self.n_layers)
        self._selector()
        self.refresh_view()

    def action_head(self, delta: int) -> None:
        self.head_no = self._cycle(self.head_no, delta, self.n_heads)
        self._selector()
        self.refresh_view()

    def action_vertical(self, delta: int) -> None:
        """↑↓: the head in the newest-row view, the query row in the matrix."""
        if self.matrix_mode:
            self.action_query(delta)
        else:
            self.action_head(delta)

    def action_query(self, delta: int) -> None:
        if self.matrix is not None:
            self._move_query(self._query() + delta)

    def action_query_to(self, position: int) -> None:
        if self.matrix is not None:
            self._move_query(position if position >= 0 else self.matrix.size - 1)

    def _move_query(self, position: int) -> None:
        self.query_no = max(0, min(position, self.matrix.size - 1))
        self._draw_matrix()

    def _query(self) -> int:
        last = self.matrix.size - 1
        return last if self.query_no is None else min(self.query_no, last)

    def action_average(self) -> None:
        if self.matrix_mode:
            self.notify("the matrix is of one layer and one head: m goes back to the averages", timeout=4)
            return
        self.layer_no = self.head_no = None
        self._selector()
        self.refresh_view()

    def _selector(self) -> None:
        layer = "average of all" if self.layer_no is None else f"{self.layer_no} (of 0–{self.n_layers - 1})"
        layer += self._window_note()
        head = "average of all" if self.head_no is None else f"{self.head_no} (of 0–{self.n_heads - 1})"
        if self.head_no is not None and self.n_kv_heads:
            head += f", reads K/V head {self.head_no // (self.n_heads // self.n_kv_heads)}"
        keys = (
            (("  [ ]", "$text-muted"), ("   query ↑↓ PgUp PgDn Home End", "$text-muted"))
            if self.matrix_mode
            else (("  ↑ ↓", "$text-muted"), ("   a averages both · m: the whole prompt", "$text-muted"))
        )
        keys = (("  ← →", "$text-muted"), ("   head ", "bold"), head, *keys)
        self.query_one("#selector", Static).update(Content.assemble(("layer ", "bold"), layer, *keys))

    def _window_note(self) -> str:
        """A sliding-window layer sees only its last positions (Gemma 3's local layers)."""
        if not self.windows:
            return ""
        if self.layer_no is None:
            local = sum(1 for w in self.windows if w)
            return f", {local} of them over a sliding window"
        window = self.windows[self.layer_no]
        return f", sliding window: the last {window:,} positions" if window else ", whole context"

    # -- reading the probe -------------------------------------------------------------
    def refresh_view(self) -> None:
        session = self.link.session
        if session.step_gate.pending is not None:  # the inference thread waits at the gate
            self._at_gate()
            return
        if getattr(self.app, "turns", None) is not None and self.app.turns.busy:
            self._status(
                "decoding at full speed: the view fills in when the answer ends "
                "(or at each step in step mode, F3)"
            )
        self.run_worker(self._fetch_matrix if self.matrix_mode else self._fetch, exclusive=True)

    def _at_gate(self) -> None:
        """Step mode: the newest row is read at the gate; the matrix would need a forward pass."""
        if self.matrix_mode:
            self._status(
                "a step waits at the gate (step mode): the matrix is one more forward pass, computed "
                "between answers; finish or resume the answer (F3), or m for the newest row"
            )
            return
        layer, head = self.layer_no, self.head_no
        view = self.link.engine.call_at_gate(lambda s: enabled_view(s, layer, head))
        self.show(view, waiting="recorded from the next step on: take a token")

    async def _fetch(self) -> None:
        layer, head = self.layer_no, self.head_no
        try:
            view = await self.on_engine(self.link.engine.call(lambda s: enable_and_view(s, layer, head)))
        except Exception as e:
            self._status(f"✖ {e}")
            return
        self.show(view, waiting="no forward pass yet: send a prompt")

    async def _fetch_matrix(self) -> None:
        layer, head = self.layer_no, self.head_no
        self._status(
            f"computing layer {layer}'s matrix: one eager pass over the context, on the inference thread…"
        )
        try:
            matrix = await self.on_engine(self.link.engine.call(lambda s: _matrix(s, layer, head)))
        except Exception as e:
            self._status(f"✖ {e}")
            return
        if matrix is None:
            self._status("nothing to show yet: send a prompt")
            return
        if self.matrix is None or self.matrix.ids != matrix.ids:
            self.query_no = None  # a new context: start at its last row
        self.matrix = matrix
        self._draw_matrix()

    def _status(self, text: str) -> None:
        self.query_one("#status", Static).update(plain_text(text))  # it may carry an error's words

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
        groups = head_group_lines(view, pieces, self.n_heads, self.n_kv_heads, self.head_no)
        self.query_one("#groups", Static).update(Content("\n").join(groups))
        self.query_one("#heat", Static).update(heat_chips(view, pieces))

    def _draw_matrix(self) -> None:
        matrix = self.matrix
        if matrix is None:
            return
        query = self._query()
        pieces = list(self.link.session.namer.pieces(matrix.ids))
        rows = max(8, self.size.height - 23)  # room below for the chosen row's top positions
        cols = max(16, self.size.width - LABEL_WIDTH - 4)
        window = self.window = window_for(matrix.size, query, self._top, rows, cols)
        self._top = window.top
        self._status(
            f"the causal matrix of one prefill over {matrix.context} cached positions{prefill_rows(matrix)}"
        )
        self.query_one("#window", Static).update(window_line(matrix, window))
        self.query_one("#grid", Static).update(Content("\n").join(grid_lines(matrix, window, query, pieces)))
        self.query_one("#sink", Static).update(sink_line(matrix, window))
        self.query_one("#sink-groups", Static).update(sink_groups(matrix, self.n_heads, self.n_kv_heads))
        self._show_row(matrix, query, pieces)

    def _show_row(self, matrix: PrefillMatrix, query: int, pieces: list[str]) -> None:
        """The chosen query row under the matrix: by message and its strongest positions."""
        row = matrix.row_view(query)
        self.query_one("#row-title", Static).update(
            Content.assemble(
                f"Query position {query} ",
                (visible_piece(pieces[query]), "$accent"),
                f" looks at positions 0–{query}; its weights sum to {sum(row.weights):.3f}",
            )
        )
        self.query_one("#row-spans", Static).update(Content("\n").join(span_lines(row, 30)))
        self.query_one("#row-top", Static).update(Content("\n").join(top_lines(row, pieces, count=5)))

    def engine_said(self, event: Event) -> None:
        if isinstance(event, (StepPaused, TurnFinished)):
            self.refresh_view()


def prefill_rows(matrix: PrefillMatrix) -> str:
    """Which rows the last turn's prefill computed, where the matrix knows."""
    if matrix.prefilled is None:
        return ""
    start, end = matrix.prefilled
    return f" · rows {start}–{end - 1}: the last turn's prefill" if end > start else ""


def _matrix(session, layer: int, head: int) -> PrefillMatrix | None:
    """On the inference thread: the probe stays on (this view's eager attention), then the matrix."""
    enable_and_view(session, layer, head)
    return prefill_matrix(session, layer, head)
