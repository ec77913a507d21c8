"""The logit lens lesson: for one step, what the model would predict after each layer
(engine/instruments/logit_lens.py), and the layer where the chosen token appears."""

from __future__ import annotations

from rich.cells import cell_len, set_cell_size
from textual.app import ComposeResult
from textual.content import Content
from textual.widgets import Static

from engine.instruments.logit_lens import Guess, LayerReading, Lens, logit_lens
from tui.fmt import prob_style, visible_piece
from tui.screens.step_lesson import StepLessonScreen

PIECE = 9
"""Cells per guessed piece: three guesses, the entropy and the chosen token's share and rank fit
the 78 cells of an 80-column screen (at 10, a row's rank wrapped onto a line of its own)."""
GUESSES = 3


def guess_cell(guess: Guess, chosen: bool) -> Content:
    """A guess in PIECE cells and its probability; the chosen token underlined."""
    piece = visible_piece(guess.piece)
    piece = piece if cell_len(piece) <= PIECE else set_cell_size(piece, PIECE - 1) + "…"
    return Content.assemble(
        (piece, "bold underline" if chosen else "bold"),
        " " * (PIECE - cell_len(piece)),
        (f"{guess.prob:6.1%} ", prob_style(guess.prob)),
    )


def layer_row(reading: LayerReading, chosen: int, appears: int | None) -> Content:
    cells = [guess_cell(g, g.id == chosen) for g in reading.top[:GUESSES]]
    mark = (" ◀", "bold $text-success") if reading.layer == appears else ""  # the summary says where
    return Content.assemble(
        f"{reading.layer:>5}  ",
        *cells,
        f"{reading.entropy_bits:5.2f}  ",
        (f"{reading.chosen_prob:6.1%} #{reading.chosen_rank:,}", prob_style(reading.chosen_prob)),
        mark,
    )


def header() -> Content:
    return Content.styled(
        "layer  "
        + "".join(f"guess {n}".ljust(PIECE + 7) for n in range(1, GUESSES + 1))
        + "bits   chosen, rank",
        "bold",
    )


def summary(lens: Lens, layers: int) -> Content:
    chosen = visible_piece(lens.chosen.piece)
    if lens.appears is None:
        where = "it is not the top guess after the last layer (the answer drew another)"
    elif lens.appears == 0:
        where = "it is the top guess after every layer"
    else:
        where = f"it is the top guess from layer {lens.appears} on (of 0–{layers - 1})"
    return Content.assemble(
        ("the chosen token ", "bold"),
        (chosen, "bold $text-accent"),
        f" (the model's own {lens.chosen.prob:.1%}): {where}",
    )


def check(lens: Lens) -> Content:
    return Content.styled(
        f"After the last layer the lens is the model's own distribution (largest difference "
        f"{lens.final_gap:.1e}): the same final norm and LM head, applied to each layer's output at "
        f"position {lens.position:,}.",
        "$text-muted",
    )


class LensScreen(StepLessonScreen):
    INSTRUMENT = "lens"

    def compose_lesson(self) -> ComposeResult:
        yield Static(id="summary")
        yield Static("What the model would predict after each layer", classes="section")
        yield Static(id="table")
        yield Static(id="check")

    def run(self, session, ids, chosen, key) -> Lens:
        return logit_lens(session, ids, chosen)

    def show(self, lens: Lens) -> None:
        rows = [header(), *(layer_row(r, lens.chosen.id, lens.appears) for r in lens.layers)]
        self.query_one("#summary", Static).update(summary(lens, len(lens.layers)))
        self.query_one("#table", Static).update(Content("\n").join(rows))
        self.query_one("#check", Static).update(check(lens))
