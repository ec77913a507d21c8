"""The top-k panel: the candidates of the latest step as bars, the chosen one marked, and the entropy.

Drawn by `render()` at a fixed height, so an update repaints this panel only.
"""

from __future__ import annotations

import math
from typing import Any

from textual.content import Content
from textual.widget import Widget

from engine.events import Candidate, ModelInfo, TokenSampled
from tui.fmt import entropy_bits, fixed, prob_color, visible_piece

PIECE_WIDTH = 12


def sampling_line(settings: Any) -> str:
    """The settings in effect (a change applies from the next token)."""
    s = settings
    return (
        f"T {s.temperature:g} · top-k {s.top_k or '–'} · top-p {s.top_p:g} · min-p {s.min_p:g}"
        f" · rep {s.repetition_penalty:g}"
    )


def is_chosen(candidate: Candidate, token: TokenSampled) -> bool:
    """The candidate is the token taken: by id, or by its text where a server sent no ids."""
    if candidate.id is not None and token.id is not None:
        return candidate.id == token.id
    return candidate.piece == token.piece


class TopKPanel(Widget):
    DEFAULT_CSS = """
    TopKPanel { height: 15; border: round $primary 50%; border-title-color: $text; padding: 0 1;
        text-wrap: nowrap; text-overflow: ellipsis; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.border_title = "Top-k: next-token candidates"
        self.token: TokenSampled | None = None
        self.sampling: Any = None

    def show_token(self, token: TokenSampled, repaint: bool = True) -> None:
        self.token = token
        if repaint:
            self.refresh()

    def set_model(self, info: ModelInfo) -> None:
        """From a server, the bottom border says which distribution its alternatives come from."""
        self.border_subtitle = info.server.top_k_note if info.server is not None else ""

    def set_sampling(self, settings: Any) -> None:
        self.sampling = settings
        self.refresh()

    def clear(self) -> None:
        self.token = None
        self.refresh()

    def render(self) -> Content:
        lines = (
            self._lines(self.token) if self.token else [Content.styled("no token sampled yet", "$text-muted")]
        )
        lines += [Content("")] * max(0, self.content_size.height - 1 - len(lines))
        if self.sampling is not None:
            lines.append(Content.styled(sampling_line(self.sampling), "$text-muted"))
        return Content("\n").join(lines)

    def _lines(self, token: TokenSampled) -> list[Content]:
        probs = [c.prob for c in token.top_k]
        lines = [_step_line(token, probs)]
        if not token.top_k:
            lines.append(Content.styled("the server sent no alternatives (no logprobs)", "$text-warning"))
            return lines
        width = max(6, self.content_size.width - PIECE_WIDTH - 12)
        top = probs[0] if probs else 1.0
        lines += [_bar(rank, c, is_chosen(c, token), width, top) for rank, c in enumerate(token.top_k, 1)]
        lines.append(_coverage(token, probs))
        return lines


def _bar(rank: int, c: Candidate, chosen: bool, width: int, top: float) -> Content:
    """One candidate: rank, piece, and a bar as long as its probability against the top one's."""
    filled = round(width * c.prob / top) if top > 0 else 0
    return Content.assemble(
        ("▶" if chosen else " ", "bold $accent"),
        (f"{rank:>2} ", "bold $accent" if chosen else "$text-muted"),
        (visible_piece(c.piece)[:PIECE_WIDTH].ljust(PIECE_WIDTH), "bold reverse" if chosen else ""),
        " ",
        ("█" * filled, prob_color(c.prob)),
        " " * (width - filled),
        f" {c.prob:6.1%}",
    )


def _coverage(token: TokenSampled, probs: list[float]) -> Content:
    """The line under the bars: what the candidates hold, or the chosen token when it is not among them."""
    if not any(is_chosen(c, token) for c in token.top_k):
        p = "?" if token.logprob is None else f"{math.exp(token.logprob):.2%}"
        return Content.styled(
            f"▶ chosen {visible_piece(token.piece)[:PIECE_WIDTH]} p={p}, not in the top {len(probs)}",
            "$text-warning",
        )
    these = "this one holds" if len(probs) == 1 else f"these {len(probs)} hold"
    return Content.styled(f"{these} {sum(probs):.0%}; the rest add entropy", "$text-muted")


def _step_line(token: TokenSampled, probs: list[float]) -> Content:
    """The step, its KV position, and the entropy of the distribution the token was drawn from:
    exact where the whole distribution is known (locally), else a lower bound from the candidates
    (a server's few alternatives)."""
    position = "–" if token.position is None else token.position
    if token.entropy is not None:
        entropy = f"{fixed(max(0.0, token.entropy / math.log(2)), 2)} bits"
    else:
        entropy = f"≥ {fixed(max(0.0, entropy_bits(probs)), 2)} bits (from these {len(probs)})"
    return Content.assemble(
        ("step ", "bold"),
        f"{token.index + 1} · position {position} · ",
        ("entropy ", "bold"),
        entropy,
    )
