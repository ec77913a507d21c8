"""The ablation lesson: one attention head or one layer's MLP turned off for a step, and the
next-token distribution beside the original (engine/instruments/ablation.py)."""

from __future__ import annotations

from rich.cells import cell_len, set_cell_size
from textual.app import ComposeResult
from textual.binding import Binding
from textual.content import Content
from textual.widgets import Static

from engine.instruments.ablation import MLP, Ablation, Part, ablate
from engine.instruments.logit_lens import Guess
from tui.fmt import prob_style, visible_piece
from tui.screens.step_lesson import StepLessonScreen

COLUMN = 28
"""Cells per distribution: two side by side fit 80 columns."""


def guess_line(guess: Guess, chosen: int) -> Content:
    """A guess in COLUMN cells; the chosen token underlined."""
    piece = visible_piece(guess.piece)
    piece = piece if cell_len(piece) <= COLUMN - 9 else set_cell_size(piece, COLUMN - 10) + "…"
    return Content.assemble(
        (piece, "bold underline" if guess.id == chosen else "bold"),
        " " * (COLUMN - 8 - cell_len(piece)),
        (f"{guess.prob:7.1%} ", prob_style(guess.prob)),
    )


def comparison(a: Ablation) -> list[Content]:
    chosen = a.chosen.id
    lines = [Content.styled("as it is".ljust(COLUMN) + f"with {a.part.describe()} off", "bold")]
    for before, after in zip(a.before, a.after):
        lines.append(Content.assemble(guess_line(before, chosen), guess_line(after, chosen)))
    return lines


def verdict(a: Ablation) -> Content:
    piece = visible_piece(a.chosen.piece)
    changed = (
        ("the top token changes", "bold $text-error")
        if a.top_changed
        else ("the top token stays", "bold $text-success")
    )
    return Content.assemble(
        ("KL(as it is ‖ off) ", "bold"),
        f"{a.kl_nats:.4f} nats · ",
        changed,
        f" · the chosen {piece}: {a.chosen.prob:.1%} → {a.chosen_after:.1%}",
    )


class AblationScreen(StepLessonScreen):
    INSTRUMENT = "ablation"
    BINDINGS = [
        Binding("left_square_bracket", "layer(-1)", "Layer", show=False),
        Binding("right_square_bracket", "layer(1)", "Layer"),
        Binding("up", "head(-1)", "Head/MLP", show=False),
        Binding("down", "head(1)", "Head/MLP"),
    ]

    def __init__(self, link, step=None, answer=None) -> None:
        super().__init__(link, step, answer)
        info = link.session.info
        self.layer_count, self.head_count = info.layers, info.heads
        self.part = Part(self.layer_count - 1, MLP)
        """The last layer's MLP first: the part that most often decides the token."""

    def compose_lesson(self) -> ComposeResult:
        yield Static(id="choice")
        yield Static(id="table")
        yield Static(id="verdict")

    def key(self):
        return (self.cursor, self.part)

    def run(self, session, ids, chosen, key) -> Ablation:
        return ablate(session, ids, chosen, key[1])

    def action_layer(self, delta: int) -> None:
        self.part = Part((self.part.layer + delta) % self.layer_count, self.part.head)
        self.compute()

    def action_head(self, delta: int) -> None:
        """↑↓ walk the layer's heads, then its MLP (MLP is -1: one before head 0)."""
        order = [MLP, *range(self.head_count)]
        self.part = Part(self.part.layer, order[(order.index(self.part.head) + delta) % len(order)])
        self.compute()

    def show(self, a: Ablation) -> None:
        self.query_one("#choice", Static).update(
            Content.assemble(
                ("off: ", "bold"),
                (a.part.describe(), "bold $text-accent"),
                (
                    f"   [ ] layer (0–{self.layer_count - 1}) · ↑↓ head (0–{self.head_count - 1}) or the MLP",
                    "$text-muted",
                ),
            )
        )
        self.query_one("#table", Static).update(Content("\n").join(comparison(a)))
        self.query_one("#verdict", Static).update(verdict(a))
