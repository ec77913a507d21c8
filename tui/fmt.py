"""Small formatting helpers shared by the panels: sizes, times, readable token pieces."""

from __future__ import annotations

import math
from typing import Sequence

PROB_LEVELS = ((0.9, "success"), (0.5, "primary"), (0.2, "warning"), (0.0, "error"))
"""Probability floors and the theme colour for each, so every theme gets its own."""


def prob_level(prob: float) -> str:
    return next((name for floor, name in PROB_LEVELS if prob >= floor), "error")


def prob_style(prob: float) -> str:
    """A chip's style: readable text on the muted theme colour for its probability."""
    level = prob_level(prob)
    return f"$text-{level} on ${level}-muted"


def logprob_style(logprob: float | None) -> str:
    """A token chip's style from its logprob; neutral where a server sent none."""
    return "$text-muted on $panel" if logprob is None else prob_style(math.exp(logprob))


def prob_color(prob: float) -> str:
    return f"${prob_level(prob)}"


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units, as memory is allocated)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def ms(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    value = seconds * 1000
    return f"{value:.0f} ms" if value >= 100 else f"{value:.1f} ms"


WHITESPACE = str.maketrans({" ": "␣", "\n": "↵", "\t": "⇥", "\r": "␍"})


def visible_piece(piece: str) -> str:
    """Make a token readable: ' Paris' -> '␣Paris', '\\n' -> '↵', other control characters as <0x0E>."""
    piece = piece.translate(WHITESPACE)
    if any(ord(ch) < 32 or 127 <= ord(ch) < 160 for ch in piece):
        piece = "".join(f"<0x{ord(ch):02X}>" if ord(ch) < 32 or 127 <= ord(ch) < 160 else ch for ch in piece)
    return piece or "∅"


def entropy_bits(probs: Sequence[float]) -> float:
    """Shannon entropy in bits of the given probabilities (zeros contribute nothing)."""
    return -sum(p * math.log2(p) for p in probs if p > 0)


SUBSCRIPT = str.maketrans("0123456789", "₀₁₂₃₄₅₆₇₈₉")
SPARK = " ▁▂▃▄▅▆▇█"


NO_ID = "₋"
"""Where a server sent a token's text but not its id."""


def subscript(number: int | None) -> str:
    """Token IDs as subscripts, so 'What₁₇₈₀' reads as piece and ID at a glance (₋: no id sent)."""
    return NO_ID if number is None else str(number).translate(SUBSCRIPT)


def sparkline(values: Sequence[float], width: int) -> str:
    """One column per value (newest on the right), heights from 0 to the largest value."""
    values = list(values)[-width:]
    top = max(values, default=0.0)
    if top <= 0:
        return " " * width
    bars = "".join(SPARK[max(1, round(v / top * (len(SPARK) - 1)))] for v in values)
    return bars.rjust(width)
