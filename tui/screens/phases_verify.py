"""The phases view's speculative-decoding section: a verify pass of K+1 tokens against one decode
step, counted (engine/instruments/verify_cost.py) and, where this session measured them, timed.

Shown always, as a lesson: with speculation off it counts the setting's K at the last turn's
context and says what is not measured yet.
"""

from __future__ import annotations

from textual.content import Content

from engine.events import TurnStats
from engine.instruments.phases import ModelShape
from engine.instruments.verify_cost import MeasuredRounds, VerifyCost, verify_cost
from engine.speculative.speedup import PlainRun
from tui.fmt import human_bytes, ms, si

WIDTH = 26


def _row(name: str, *values: str, style: str = "") -> Content:
    return Content.assemble((name.ljust(18), "bold"), *((v.rjust(WIDTH), style) for v in values))


def verify_lines(
    shape: ModelShape,
    k: int,
    stats: TurnStats | None,
    rounds: MeasuredRounds | None,
    plain: PlainRun | None,
) -> list[Content]:
    """The verify pass of the measured K (else the setting's) at the last turn's mean context."""
    k = rounds.k if rounds is not None else k
    context = stats.prompt_tokens + stats.generated_tokens // 2 if stats and stats.prompt_tokens else 0
    cost = verify_cost(shape, k, context)
    return [
        Content.assemble(
            f"K = {k} drafts: one forward pass feeds the last token and the drafts, {k + 1} tokens, "
            f"at context {context:,}",
            (" (the last turn's mean)" if stats else " (no turn yet)", "$text-muted"),
        ),
        *_cost_rows(cost, k),
        _time_row(rounds, plain),
        *_speculative_note(stats),
        _why_it_pays(shape, k, cost.verify_bytes - cost.step_bytes),
    ]


def _speculative_note(stats: TurnStats | None) -> list[Content]:
    """After a speculative answer: why the table times no plain decode step."""
    if stats is None or stats.speculative is None:
        return []
    return [
        Content.styled(
            f"The last answer was speculative ({stats.speculative}): its tokens came a round at a time, "
            "so the table above times no plain decode step; its verify passes are timed here.",
            "$text-warning",
        )
    ]


def _cost_rows(cost: VerifyCost, k: int) -> list[Content]:
    """The counted rows: FLOPs and bytes of one decode step against one verify pass."""
    return [
        _row("", "one decode step", f"verify pass ({k + 1} tokens)", "verify / step", style="bold"),
        _row("FLOPs", si(cost.step_flops, "FLOP"), si(cost.verify_flops, "FLOP"), f"{cost.flops_ratio:.2f}×"),
        _row(
            "bytes moved",
            human_bytes(cost.step_bytes),
            human_bytes(cost.verify_bytes),
            f"{cost.bytes_ratio:.4f}×",
        ),
    ]


def _why_it_pays(shape: ModelShape, k: int, extra: int) -> Content:
    """The lesson under the table: the weights are read once either way."""
    return Content.styled(
        f"The weights (W = {human_bytes(shape.streamed_weight_bytes)}) are read once either way; the {k} "
        f"extra tokens add {human_bytes(extra)} of K/V. Counted in bytes, checking {k} drafts is one "
        "decode step: a step waits on its bytes, not its arithmetic, so the extra work rides along, and "
        "each kept draft is a token without a step of its own. That is the reason speculation pays. "
        "Where the measured ratio is well above 1, this machine does not run a few-row matmul at memory "
        "speed (CPUs often do not): the pass then costs more than its bytes.",
        "$text-muted",
    )


def _time_row(rounds: MeasuredRounds | None, plain: PlainRun | None) -> Content:
    step = f"{ms(plain.itl_s)} (answer {plain.answer}, {plain.step_path})" if plain else "no plain answer yet"
    if rounds is None:
        return _row("time (measured)", step, "no speculative round yet", "–")
    verify = f"{ms(rounds.verify_s)} (median of {rounds.rounds})"
    ratio = f"{rounds.verify_s / plain.itl_s:.2f}×" if plain and plain.itl_s > 0 else "–"
    return _row("time (measured)", step, verify, ratio)
