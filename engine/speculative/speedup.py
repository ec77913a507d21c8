"""The speed-up of a speculative answer against plain decoding measured in the same session.

A plain answer's decode tok/s is remembered per model, precision, KV cache precision and step
path (compiled, the eager fast path, the HF reference). A speculative answer is compared only
with a like one: the same model, precision and cache precision, measured on a quiet machine;
the newest decoded the same way, or else the compiled step's (a round's verify runs the eager
path until its own compiled step is built, so the compiled step is the faster, stricter
baseline, and is labelled as such). Anything
else ("7.29x" against an eager answer with an fp32 cache on a busy machine, while the
speculative one had an int8 cache) says there is no comparable plain answer. Step-mode answers
are never a baseline: their times include the user's choosing.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.events import ModelInfo, TurnStats

MIN_TOKENS = 3
"""A plain answer needs two inter-token gaps at least to give a decode rate."""
NONE_COMPARABLE = "no comparable plain answer yet (same precision and KV cache, a quiet machine)"


@dataclass(frozen=True)
class PlainRun:
    """One plain answer's decode speed, and which answer of the session it was."""

    tok_s: float
    itl_s: float
    step_path: str
    answer: int
    """1-based count of finished answers in this session."""


@dataclass(frozen=True)
class SpeedUp:
    """A speculative answer's decode rate against a plain one of this session (None: none yet)."""

    tok_s: float
    plain: PlainRun | None
    same_path: bool

    @property
    def ratio(self) -> float | None:
        return self.tok_s / self.plain.tok_s if self.plain and self.plain.tok_s > 0 else None

    def describe(self) -> str:
        """One sentence: what was compared with what."""
        if self.plain is None:
            return f"{self.tok_s:.1f} tok/s; {NONE_COMPARABLE}"
        other = "" if self.same_path else f", ran {self.plain.step_path}"
        return (
            f"{self.ratio:.2f}× plain: {self.tok_s:.1f} vs {self.plain.tok_s:.1f} tok/s "
            f"(plain answer {self.plain.answer}{other})"
        )

    def short(self) -> str:
        """The phase panel's line (its decode line above shows this answer's tok/s)."""
        if self.plain is None:
            return NONE_COMPARABLE
        other = "" if self.same_path else f", {self.plain.step_path}"
        return f"{self.ratio:.2f}× vs plain {self.plain.tok_s:.1f} tok/s (#{self.plain.answer}{other})"


class PlainBaseline:
    """Plain answers' decode rates in this session, newest per model, precision, KV cache
    precision and step path; an answer measured on a busy machine is no baseline."""

    def __init__(self) -> None:
        self.answers = 0
        self._plain: dict[tuple[str, str, str, str], PlainRun] = {}

    def finished(self, stats: TurnStats, info: ModelInfo | None) -> SpeedUp | None:
        """Note a finished answer; for a speculative one, its speed-up against plain decoding."""
        self.answers += 1
        if info is None or info.server is not None or stats.step_path in (None, "step mode"):
            return None
        if stats.speculative is not None:
            return self.compare(stats, info) if stats.decode_tok_s > 0 else None
        busy = stats.contention is not None and stats.contention.busy
        if (
            stats.generated_tokens >= MIN_TOKENS
            and stats.decode_tok_s > 0
            and stats.stop != "error"
            and not busy
        ):
            run = PlainRun(stats.decode_tok_s, stats.itl_p50_s, stats.step_path, self.answers)
            self._plain[_key(info, stats.step_path)] = run
        return None

    def compare(self, stats: TurnStats, info: ModelInfo) -> SpeedUp:
        same = self.plain_for(info, stats.step_path)
        plain = same or self.plain_for(info, "compiled")
        return SpeedUp(stats.decode_tok_s, plain, same is not None)

    def plain_for(self, info: ModelInfo, step_path: str | None) -> PlainRun | None:
        return self._plain.get(_key(info, step_path or ""))


def _key(info: ModelInfo, step_path: str) -> tuple[str, str, str, str]:
    return (info.spec, info.precision, info.cache_dtype or "", step_path)
