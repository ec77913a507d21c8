"""Precision compare: the last turn at the loaded precision and at a second one, side by side.

The second precision is loaded on the inference thread, the turn runs teacher-forced, and
the second model is dropped again (`compare_turn_at` in engine/instruments/precision_compare.py);
the chat's model stays as it was. Or what is compared is the KV cache's precision: the same
model with an fp32 cache and with a quantized one (`compare_turn_kv_cache`). Below, the lesson
of the cache formula: how much context fits in a given memory at each cache precision.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.content import Content
from textual.widgets import Button, Input, Label, Select, Static

from engine.instruments import kv_budget
from engine.instruments.precision_compare import PrecisionComparison, compare_turn_at, compare_turn_kv_cache
from engine.kv_windows import most_held
from engine.quant.precision import PRECISIONS
from tui.fmt import human_bytes, ms, plain_text, subscript, visible_piece
from tui.screens.instrument import InstrumentScreen

if TYPE_CHECKING:
    from tui.instruments import AnswerRef, Instruments

DEFAULT_TOKENS = 32
KV = "kv:"
"""The prefix of a choice that compares KV cache precisions rather than weight precisions."""
KV_CHOICES = [(f"KV cache {p}", f"{KV}{p}") for p in ("int8", "bf16", "fp16")]
NAME_WIDTH = 24
CELL_WIDTH = 18
"""The context lesson's columns: it fits an 80-column terminal."""
BUDGET_GIB = 16
"""The memory the context lesson fills (a GPU's spare memory after the weights, say)."""


def intro(precision: str, sampling, step_path: str | None = None) -> str:
    """What is compared, and why its tokens need not be the chat's (`step_path`: how the chat's
    last answer was decoded; in step mode the student chose its tokens)."""
    text = (
        f"The last turn's prompt is answered again at {precision} (the reference) by plain greedy decoding "
        "(always the most probable token: repeatable), and the second precision is fed those same tokens "
        "(a KV cache precision: the same model with an fp32 cache answers, and is fed them with the "
        "rounded cache)."
    )
    if step_path == "step mode":
        return (
            text
            + " The chat's answer was chosen token by token in step mode, so these tokens can differ from it."
        )
    if sampling.temperature == 0 and sampling.repetition_penalty == 1:
        return text + " The chat answered greedily too, so they begin as the chat's answer did."
    return text + (
        f" The chat's answer was sampled (T {sampling.temperature:g}, repetition penalty "
        f"{sampling.repetition_penalty:g}), so these tokens can differ from it."
    )


def _side_row(name: str, left: str, right: str) -> Content:
    return Content.assemble((name.ljust(22), "bold"), left.rjust(18), right.rjust(18))


def side_by_side(result: PrecisionComparison) -> list[Content]:
    a, b = result.reference, result.other
    row = _side_row
    return [
        Content.assemble(
            "".ljust(22), (f"{a.precision} (reference)".rjust(18), "bold"), (b.precision.rjust(18), "bold")
        ),
        row("weights in memory", human_bytes(a.weight_bytes), human_bytes(b.weight_bytes)),
        row("KV cache per token", f"{a.kv_bytes_per_token:,} B", f"{b.kv_bytes_per_token:,} B"),
        row("prefill", ms(a.prefill_s), ms(b.prefill_s)),
        row("ITL (median)", ms(a.itl_p50_s), ms(b.itl_p50_s)),
        row("decode", f"{a.decode_tok_s:.1f} tok/s", f"{b.decode_tok_s:.1f} tok/s"),
        measured_at(result),
    ]


def measured_at(result: PrecisionComparison) -> Content:
    """Under the times: the step both sides ran, and the CPU share they were measured at."""
    note = (
        "both sides run the uncompiled forward, in turn for each token (the chat may run the compiled step)"
    )
    contention = result.contention
    if contention is None:
        return Content.styled(note, "$text-muted")
    if contention.busy:
        return Content.assemble(
            (f"⚠ {contention.describe()}: the times above are not the precisions' own", "bold $text-warning"),
            "\n",
            (note, "$text-muted"),
        )
    return Content.styled(f"measured at {contention.figures()}; {note}", "$text-muted")


def agreement_lines(result: PrecisionComparison, piece) -> list[Content]:
    steps = result.steps
    agree = sum(s.agree for s in steps)
    lines = [
        Content.assemble(
            ("top-1 agreement ", "bold"),
            f"{agree} of {len(steps)} steps ({result.agreement:.1%})",
            ("   mean KL ", "bold"),
            f"{result.mean_kl:.5f} nats",
            ("   max KL ", "bold"),
            f"{max((s.kl for s in steps), default=0.0):.5f} nats",
        )
    ]
    return [*lines, _first_divergence(result, piece)]


def _first_divergence(result: PrecisionComparison, piece) -> Content:
    """The first step where the other precision's top-1 is not the reference's token, if any."""
    first = result.first_divergence
    if first is None:
        return Content.assemble(
            ("first divergent token ", "bold"),
            (
                f"none: at every one of the {len(result.steps)} steps "
                f"the {result.other.precision} model would pick the same token",
                "$text-success",
            ),
        )
    return Content.assemble(
        ("first divergent token ", "bold"),
        f"step {first.step + 1}: {result.reference.precision} takes ",
        (visible_piece(piece(first.token)), "bold"),
        f" (p {first.ref_prob:.1%}); {result.other.precision} would take ",
        (visible_piece(piece(first.other_top)), "bold $text-error"),
        f" (it gave {visible_piece(piece(first.token))} "
        f"p {first.other_prob:.1%}). A free-running {result.other.precision} answer parts ways here.",
    )


def step_chips(result: PrecisionComparison, piece) -> Content:
    parts: list = []
    for s in result.steps:
        style = "$text-success on $success-muted" if s.agree else "$text-error on $error-muted"
        parts += [(visible_piece(piece(s.token)), style), (subscript(s.token), "$text-muted"), " "]
    return Content.assemble(*parts)


def budget_lines(info, gib: int = BUDGET_GIB) -> list[Content]:
    """Tokens of context whose KV cache fits in `gib` GiB, for this model and, by the same formula,
    for a 7B and a 70B model, at each cache precision (engine/instruments/kv_budget.py)."""
    memory = gib * kv_budget.GIB
    shapes = [kv_budget.shape_of(info), *kv_budget.OTHERS]
    columns = {"fp32": "fp32", "bf16": "bf16/fp16", "int8": "int8"}
    rows = [[budget_cell(shape, memory, p) for p in columns] for shape in shapes]
    # As wide as the widest cell: a small model's millions of tokens ran into the next column.
    width = max(CELL_WIDTH, *(len(cell) + 2 for row in rows for cell in row))
    header = Content.assemble(
        "".ljust(NAME_WIDTH), *((title.rjust(width), "bold") for title in columns.values())
    )
    lines = [header]
    for shape, row in zip(shapes, rows):
        name = shape.name if len(shape.name) < NAME_WIDTH else shape.name[: NAME_WIDTH - 2] + "…"
        lines.append(Content.assemble((name.ljust(NAME_WIDTH), "bold"), *(cell.rjust(width) for cell in row)))
    return [*lines, *_windows_note(shapes[0]), _budget_note(gib)]


def budget_cell(shape: kv_budget.Shape, memory: int, precision: str) -> str:
    """Bytes per token → tokens that fit; a model with sliding windows counts the bytes each token
    adds past them."""
    tokens = shape.tokens_in(memory, precision)
    fit = "any length" if tokens is None else f"{tokens:,}"
    return f"{shape.growing_bytes_per_token(precision):,} → {fit}"


def _windows_note(shape: kv_budget.Shape) -> list[Content]:
    """For a model with sliding windows: which layers hold only their window."""
    if not shape.windowed_layers:
        return []
    sizes = sorted({w for w in shape.windows if w})
    windows, past = ", ".join(f"{w:,}" for w in sizes), most_held(sizes[0]) - sizes[0]
    return [
        Content.styled(
            f"{shape.windowed_layers} of its {shape.layers} layers attend over a sliding window "
            f"({windows} positions) and hold at most it, at any context: its bytes per token are "
            f"the other {shape.layers - shape.windowed_layers} layers', and its tokens count both. "
            f"(llmchat's cache keeps up to {past} positions more in a windowed layer, so that a "
            f"speculative crop can be served and the oldest are moved out in batches, not per token.)",
            "$text-muted",
        )
    ]


def _budget_note(gib: int) -> Content:
    """How a cell is computed, and where the 7B and 70B configs come from."""
    others = "; ".join(f"{s.name}: {s.source}" for s in kv_budget.OTHERS)
    return Content.styled(
        f"Each cell: bytes per token → tokens that fit. The first row is the loaded model. Bytes per "
        f"token = 2 (K,V) × layers × kv heads × (head_dim × element bytes + scale: 4 B for int8); "
        f"{gib} GiB ÷ that. The 7B and 70B rows are computed from this formula with the configs "
        f"named, not measured ({others}).",
        "$text-muted",
    )


class PrecisionScreen(InstrumentScreen):
    INSTRUMENT = "precision"
    DEFAULT_CSS = """
    PrecisionScreen #controls { height: auto; margin-top: 1; }
    PrecisionScreen #controls > Label { padding: 0 1 0 0; }
    PrecisionScreen #controls > Select { width: 18; }
    PrecisionScreen #controls > Input { width: 8; }
    PrecisionScreen #controls > Button { margin-left: 2; min-width: 11; }
    """
    BINDINGS = [Binding("r", "run", "Run")]

    def __init__(self, link: Instruments, step: int | None = None, answer: AnswerRef | None = None) -> None:
        super().__init__(link, step, answer)
        self.result: PrecisionComparison | None = None
        self.cancel = threading.Event()
        """Set when the screen closes: a comparison still running stops at its next step."""

    def compose_body(self) -> ComposeResult:
        current = self.link.session.info.precision
        last = self.link.last_stats
        yield Static(intro(current, self.link.session.sampling, last.step_path if last else None))
        yield from self._controls(current)
        yield Static(id="status", classes="muted")
        yield Static("Speed and memory", classes="section")
        yield Static(id="sides")
        yield Static("Do they agree?", classes="section")
        yield Static(id="agreement")
        yield Static(
            "The reference's tokens (green: the other model's top-1 agrees · red: it does not)",
            classes="section",
        )
        yield Static(id="chips")
        title = f"Context that fits in {BUDGET_GIB} GiB of KV cache, by cache precision"
        yield Static(title, classes="section")
        yield Static(Content("\n").join(budget_lines(self.link.session.info)), id="budget")

    def _controls(self, current: str) -> ComposeResult:
        """The second precision (a weight precision or a KV cache one), the tokens to run, and Run."""
        others = [p for p in PRECISIONS if p != current]
        default = "bf16" if "bf16" in others else others[0]
        with Horizontal(id="controls"):
            yield Label("second precision")
            choices = [(p, p) for p in others] + KV_CHOICES
            yield Select(choices, value=default, allow_blank=False, id="other", compact=True)
            yield Label("  tokens")
            yield Input(str(DEFAULT_TOKENS), id="tokens", type="integer", compact=True)
            yield Button("Run (r)", id="run", variant="primary", compact=True)

    def on_mount(self) -> None:
        options = getattr(self.app, "options", None)
        self.query_one("#tokens", Input).cursor_blink = options.cursor_blink if options is not None else True
        self.query_one("#other", Select).focus()
        self.set_title_line(f"reference {self.link.session.info.precision}")
        self._status(
            "choose a second precision and press r (or the button); it loads that precision for a moment"
        )

    def on_unmount(self) -> None:
        self.cancel.set()

    def _status(self, text: str) -> None:
        self.query_one("#status", Static).update(plain_text(text))  # it may carry an error's words

    @on(Button.Pressed, "#run")
    @on(Input.Submitted, "#tokens")
    def action_run(self) -> None:
        precision = self.query_one("#other", Select).value
        tokens = whole_at_least_1(self.query_one("#tokens", Input).value)
        if tokens is None:
            self._status("✖ tokens must be a whole number of at least 1")
            return
        busy = getattr(self.app, "turns", None) is not None and self.app.turns.busy
        what = (
            f"running the last turn with an fp32 and a {str(precision).removeprefix(KV)} KV cache"
            if str(precision).startswith(KV)
            else f"loading {precision} and running the last turn at both precisions"
        )
        self._status(what + (" (after the answer in progress)…" if busy else "…"))
        self.run_worker(self._run(str(precision), tokens), exclusive=True)

    async def _run(self, precision: str, tokens: int) -> None:
        compare = (
            (lambda s: compare_turn_kv_cache(s, precision.removeprefix(KV), tokens, self.cancel))
            if precision.startswith(KV)
            else (lambda s: compare_turn_at(s, precision, tokens, self.cancel))
        )
        try:
            result = await self.on_engine(self.link.engine.call(compare))
        except Exception as e:  # a precision this machine cannot load, or no turn yet
            self._status(f"✖ {e}")
            return
        self.show(result)

    def show(self, result: PrecisionComparison) -> None:
        self.result = result
        piece = self.link.session.namer.piece
        self._status(f"{len(result.steps)} steps after a {result.prompt_tokens}-token prompt · r runs again")
        self.query_one("#sides", Static).update(Content("\n").join(side_by_side(result)))
        self.query_one("#agreement", Static).update(Content("\n").join(agreement_lines(result, piece)))
        self.query_one("#chips", Static).update(step_chips(result, piece))
        self.set_title_line(f"{result.reference.precision} vs {result.other.precision}")


def whole_at_least_1(text: str) -> int | None:
    try:
        number = int(text)
    except ValueError:
        return None
    return number if number >= 1 else None
