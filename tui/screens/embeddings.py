"""Embeddings: a token's row of the embedding table, its nearest tokens, and what RoPE does to it.

The token comes from an answer's chips (opened with e in the token inspector: its selected
step) or from text typed here and tokenized (Ctrl+P opens it asking for text). Everything
shown is computed from the live model on the inference thread
(engine/instruments/embeddings.py).
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.content import Content
from textual.widgets import Input, Static

from engine.instruments.embeddings import RopeEffect, RopeRow, TokenEmbedding, token_embedding, tokens_of
from tui.fmt import human_bytes, subscript, visible_controls, visible_piece
from tui.screens.instrument import InstrumentScreen
from tui.screens.step_lesson import ChipPicker
from tui.widgets.token_strip import StripToken, TokenStrip

if TYPE_CHECKING:
    from tui.instruments import AnswerRef, Instruments

BAR = 12


def fact_lines(e: TokenEmbedding, model: str) -> list[Content]:
    return [
        Content.assemble(
            ("token ", "bold"), (visible_piece(e.piece), "bold $text-accent"), f"  id {e.token_id:,}"
        ),
        Content.assemble(
            ("embedding row ", "bold"),
            f"{e.dim:,} numbers ({e.dtype}, {human_bytes(e.row_bytes)}) · ",
            ("L2 norm ", "bold"),
            f"{e.norm:.3f} · rank {e.norm_rank:,} of {e.vocab:,} by norm ",
            (
                f"(1 = largest; median {e.median_norm:.3f}, range {e.min_norm:.3f}–{e.max_norm:.3f})",
                "$text-muted",
            ),
        ),
        _tied_line(e, model),
    ]


def _tied_line(e: TokenEmbedding, model: str) -> Content:
    """Whether the row is also the LM head's row for the token."""
    if e.tied:
        return Content.assemble(
            ("tied ", "bold"),
            f"{model} ties its input and output embeddings: this same row is the LM head's row for "
            f"{visible_piece(e.piece)}, so its logit at every step is the final hidden state · this row.",
        )
    return Content.assemble(
        ("not tied ", "bold"),
        "the LM head has a matrix of its own; this row only feeds the model in.",
    )


def neighbour_lines(e: TokenEmbedding) -> list[Content]:
    lines = []
    for rank, n in enumerate(e.neighbours, 1):
        filled = max(0, min(BAR, round(n.cosine * BAR)))
        lines.append(
            Content.assemble(
                f"{rank:>3}  ",
                (f"{n.cosine:+.3f} ", "bold"),
                ("█" * filled + "·" * (BAR - filled), "$text-primary"),
                "  ",
                (visible_piece(n.piece), "bold"),
                (subscript(n.id), "$text-muted"),
            )
        )
    return lines


ROPE_LABEL = 12
ROPE_CELL = 6
"""The RoPE table's label and cell widths: 12 + 10 distances · 6 = 72 cells fits 80 columns."""


def rope_lines(rope: RopeEffect) -> list[Content]:
    lines = [
        Content.styled(
            "cos(x at position p, the same x at p + Δ), x rotated as the model rotates it:", "bold"
        ),
        Content.assemble(
            ("Δ =".ljust(ROPE_LABEL), "bold"), *((f"{d:,}".rjust(ROPE_CELL), "bold") for d in rope.distances)
        ),
        *(_rope_row(row) for row in rope.rows),
        _rope_how(rope),
    ]
    q_rows = [r for r in rope.rows if r.vector == "q"]
    if len(q_rows) > 1:
        lines.append(_relative_only(rope, q_rows))
    return lines


def _rope_row(row: RopeRow) -> Content:
    """A vector's cosines at each distance; near 1 (the rotation barely moved it) in green."""
    return Content.assemble(
        f"{row.vector}, p={row.start:,}".ljust(ROPE_LABEL),
        *((f"{c:.3f}".rjust(ROPE_CELL), "$text-success" if c > 0.9 else "") for c in row.cosines),
    )


def _rope_how(rope: RopeEffect) -> Content:
    """How the table's cosines were computed."""
    return Content.styled(
        f"Layer 0, this token alone: q = W_q · rmsnorm(row), k = W_k · rmsnorm(row); cosine of the same "
        f"vector rotated to two positions, mean over {rope.heads} query heads (k: {rope.kv_heads} KV "
        f"heads), with the model's rotary embedding: base θ {rope.base:,.0f}{_kind_note(rope)}, "
        f"head dim {rope.head_dim}.",
        "$text-muted",
    )


def _kind_note(rope: RopeEffect) -> str:
    """Which kind of layer the base is of, where kinds differ (Gemma 3's local and global layers)."""
    if rope.layer_kind is None:
        return ""
    return f" (layer 0 is a {rope.layer_kind.replace('_', ' ')} layer; each kind has its own base)"


def _relative_only(rope: RopeEffect, q_rows: list[RopeRow]) -> Content:
    """The lesson of two q rows at different starts: the same cosines, so only Δ matters."""
    same = all(math.isclose(a, b, abs_tol=1e-3) for a, b in zip(q_rows[0].cosines, q_rows[1].cosines))
    return Content.assemble(
        ("The two q rows are " + ("equal" if same else "NOT equal") + ": ", "bold"),
        "the rotation between two positions depends only on how far apart they are (Δ), not where "
        "they are, which is how RoPE makes attention's q·k depend on relative position. "
        f"The fastest pair of dimensions turns {rope.fastest_rad:.3f} rad "
        f"({math.degrees(rope.fastest_rad):.1f}°) per position; the slowest needs "
        f"{rope.slowest_period:,.0f} positions for one turn.",
    )


class EmbeddingsScreen(ChipPicker, InstrumentScreen):
    INSTRUMENT = "embeddings"
    DEFAULT_CSS = """
    EmbeddingsScreen #text { margin-top: 1; width: 60; max-width: 100%; }
    EmbeddingsScreen TokenStrip { margin: 1 0 0 0; }
    """
    BINDINGS = [
        Binding("left", "move(-1)", "Token ←", show=False),
        Binding("right", "move(1)", "Token →"),
        Binding("slash", "type", "Type text"),
        Binding("pagedown", "page(1)", "Page ↓", show=False),
        Binding("pageup", "page(-1)", "Page ↑", show=False),
    ]
    BODY_FOCUS = False
    AUTO_FOCUS = ""
    """The text box takes the focus only when asked for (the palette), so ← → move between chips."""

    def __init__(self, link: Instruments, step: int | None = None, answer: AnswerRef | None = None) -> None:
        super().__init__(link, step, answer)
        self.asking = step is None and answer is None
        """Opened from the palette: the text box has the focus."""
        self.tokens: list[StripToken] = []
        self.cursor = 0
        self.source = ""
        self.shown: TokenEmbedding | None = None
        self._results: dict[int, TokenEmbedding] = {}
        self._pick(answer, step)

    def _pick(self, answer: AnswerRef | None, step: int | None) -> None:
        """The tokens to choose from: the given answer's, else the last answer's."""
        if answer is None:
            from tui.instruments import answers

            refs = answers(self.link.session)
            answer = refs[-1] if refs else None
        if answer is None:
            return
        steps = answer.trace.steps
        self.tokens = [StripToken(s.id, s.piece, "") for s in steps if s.id is not None]
        self.cursor = max(0, min(len(self.tokens) - 1, len(self.tokens) - 1 if step is None else step))
        self.source = f"the tokens of {answer.label}"

    def compose_body(self) -> ComposeResult:
        yield Input(placeholder="type a word or text, Enter: its tokens appear below", id="text")
        yield Static(id="source", classes="muted")
        yield TokenStrip("screen.select({})", max_rows=3)
        yield Static(id="status")
        yield Static(id="facts")
        yield Static(
            "Nearest tokens by cosine similarity of their rows (the token itself left out)", classes="section"
        )
        yield Static(id="neighbours")
        yield Static("The same token at two positions: what the rotation (RoPE) does", classes="section")
        yield Static(id="rope")

    def on_mount(self) -> None:
        options = getattr(self.app, "options", None)
        self.query_one("#text", Input).cursor_blink = options.cursor_blink if options is not None else True
        self.set_title_line(self.link.session.info.name)
        if self.asking or not self.tokens:
            self.query_one("#text", Input).focus()
        self._show_tokens()

    # -- choosing ---------------------------------------------------------------------
    def _show_tokens(self) -> None:
        strip = self.query_one(TokenStrip)
        strip.set_tokens(self.tokens, self.cursor)
        hint = "  ← → or click a chip · / types text" if self.tokens else ""
        self.query_one("#source", Static).update(
            (self.source or "No answer yet: type text to see its tokens.") + hint
        )
        if self.tokens:
            self.compute()

    @on(Input.Submitted, "#text")
    def _typed(self, event: Input.Submitted) -> None:
        try:
            ids = tokens_of(self.link.session, event.value)
        except Exception as e:  # empty text, or text the tokenizer refuses
            self._status(f"✖ {e}", "$text-error")
            return
        namer = self.link.session.namer
        self.tokens = [StripToken(i, namer.piece(i), "") for i in ids]
        self.cursor = 0
        self.source = f"the {len(ids)} token{'s' if len(ids) != 1 else ''} of {event.value!r}"
        self.set_focus(None)  # ← → now move between the new chips
        self._show_tokens()

    def action_page(self, direction: int) -> None:
        body = self.query_one("#body")
        (body.scroll_page_down if direction > 0 else body.scroll_page_up)(animate=False)

    def action_type(self) -> None:
        self.query_one("#text", Input).focus()

    # -- computing --------------------------------------------------------------------
    def _status(self, text: str, style: str = "$text-muted") -> None:
        self.query_one("#status", Static).update(Content.styled(visible_controls(text), style))

    def compute(self) -> None:
        token_id = self.tokens[self.cursor].id
        if token_id in self._results:
            self.show(self._results[token_id])
            return
        busy = getattr(self.app, "turns", None) is not None and self.app.turns.busy
        self._status(
            "reading the embedding table on the inference thread"
            + (" (after the answer in progress)…" if busy else "…"),
            "$text-warning",
        )
        self.run_worker(functools.partial(self._fetch, token_id), exclusive=True)

    async def _fetch(self, token_id: int) -> None:
        try:
            result = await self.on_engine(self.link.engine.call(lambda s: token_embedding(s, token_id)))
        except Exception as e:
            self._status(f"✖ {e}", "$text-error")
            return
        self._results[token_id] = result
        if self.tokens and self.tokens[self.cursor].id == token_id:
            self.show(result)

    def show(self, e: TokenEmbedding) -> None:
        self.shown = e
        self._status("")
        info = self.link.session.info
        self.query_one("#facts", Static).update(Content("\n").join(fact_lines(e, info.name)))
        self.query_one("#neighbours", Static).update(Content("\n").join(neighbour_lines(e)))
        self.query_one("#rope", Static).update(Content("\n").join(rope_lines(e.rope)))
        self.set_title_line(f"{info.name} · {visible_piece(e.piece)}{subscript(e.token_id)}")
