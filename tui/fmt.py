"""Small formatting helpers shared by the panels: sizes, times, readable token pieces."""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Sequence

from rich.text import Text

if TYPE_CHECKING:
    from engine.events import SamplingResolved, TurnStats

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


def count(n: int, word: str, plural: str | None = None) -> str:
    """'1 token', '2 tokens', '1,024 tokens': the number and the word that agrees with it."""
    return f"{n:,} {word if n == 1 else plural or word + 's'}"


def decode_rate(tok_s: float) -> str:
    """'23.4 tok/s'; '–' where no gap between two tokens was measured (an answer of one token)."""
    return f"{tok_s:.1f} tok/s" if tok_s > 0 else "–"


def gap_ms(seconds: float) -> str:
    """A time between two tokens, as `ms`; '–' where there was none (TurnStats holds 0 then)."""
    return ms(seconds) if seconds > 0 else "–"


def fixed(value: float, digits: int) -> str:
    """`value` to `digits` decimals, never '-0.00': a value that rounds to zero is shown as zero."""
    text = f"{value:.{digits}f}"
    return text[1:] if text.startswith("-") and float(text) == 0 else text


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


def _visible(code: int) -> str:
    if code < 32:
        return chr(0x2400 + code)  # the Control Pictures block: ESC -> ␛, BEL -> ␇, LF -> ␊
    return f"\\u{code:04x}"  # DEL and C1 (no pictures): \u009b, which also reads right inside a JSON string


CONTROLS = {code: _visible(code) for code in (*range(32), *range(127, 160))}
"""C0 controls, DEL and C1 controls, each as something visible and inert."""
_LAYOUT = {code: shown for code, shown in CONTROLS.items() if chr(code) not in "\n\t"}
_WHITESPACE_RUN = re.compile(r"\s+")


def visible_controls(text: str, one_line: bool = False) -> str:
    """Text from the store or the model, safe to print: its control characters shown, never obeyed.

    An escape sequence in a title or an answer could otherwise retitle the window or clear the
    screen. Newlines and tabs stay, for layout; `one_line` (a table cell, a title, a question)
    turns each run of whitespace, newlines included, into one space instead.
    """
    if one_line:
        return _WHITESPACE_RUN.sub(" ", text).translate(CONTROLS)
    return text.translate(_LAYOUT)


def plain_text(text: object, one_line: bool = False, style: str = "") -> Text:
    """A string from outside (a server, a file, argv) for Rich or Textual: text, never markup
    (`[/]` would raise, `[link=...]` would make a hyperlink), its control characters shown."""
    return Text(visible_controls(str(text), one_line), style=style)


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


SLOWER_STEPS = {"fused": "eager step", "reference": "HF forward"}
"""A turn decoded on a slower step than the compiled one says which beside its speed (the
eager step serves while the compiled one builds, or for a model it cannot compile)."""


def si(value: float, unit: str) -> str:
    """1.2e9 -> '1.20 G' + unit."""
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.2f} {prefix}{unit}"
    return f"{value:.2f} {unit}"


def thinking_part(stats: TurnStats) -> str:
    """'thought 212 tok, first thought 118 ms, first answer 3412 ms' for an answer that thought
    (TTFT stays the first token's, thought or not); '' for one that did not."""
    if not stats.thought_tokens:
        return ""
    first = f"first thought {ms(stats.first_thought_s)}, first answer {ms(stats.first_answer_s)}"
    return f"thought {stats.thought_tokens:,} tok, {first}"


def prefill_rate(stats: TurnStats) -> str:
    """Prefill throughput; for a prefill of one token (a fork, a regeneration) its time instead,
    since a rate of one token is a latency in disguise. '–' where a server did not tell the count."""
    if stats.prefilled_tokens is None:
        return "–"
    if stats.prefilled_tokens >= 2 and stats.prefill_tok_s > 0:
        return f"{stats.prefill_tok_s:,.0f} tok/s"
    if stats.prefilled_tokens == 1 and stats.prefill_tok_s > 0:
        return f"1 token, {ms(1 / stats.prefill_tok_s)}"
    return "–"


def model_sampling_note(event: SamplingResolved) -> str:
    """'temperature 0.2, top-p 0.9: the model's own (SmolLM2's model card)'."""
    own = ", ".join(f"{name.replace('_', '-')} {_number(event.settings[name])}" for name in event.from_model)
    return f"{own}: the model's own ({event.source})"


def system_default_note(system: str) -> str:
    """'"You are ...": llmchat's default for the built-in model (...)', for the chat and `ask`."""
    return f"\"{system}\": llmchat's default for the built-in model (its template's own answered worse)"


def _number(value: float | int | None) -> str:
    return "random" if value is None else f"{value:g}" if isinstance(value, float) else str(value)
