"""Why speculative decoding pays: a verify pass over K+1 tokens moves about one decode step's bytes.

A round feeds [the last token, K drafts] in one forward pass over the cache (engine/speculative/loop.py),
keeping the logits of every position (each draft is checked against the model's distribution
before it). Counted as engine/instruments/phases.py counts a phase, at context c:

    FLOPs(verify) = 2·P·(K+1) + 2·h·vocab·(K+1) + 4·layers·H·d·pairs      pairs = (K+1)·c + (K+1)(K+2)/2
    bytes(verify) = W + kv·(c + K+1) + kv·(K+1)
    one decode step: the same with K = 0

The weights W are read once either way and dwarf the few K/V rows the extra tokens add, so the
bytes barely grow while the FLOPs grow K+1 times. A decode step is memory-bound (its arithmetic
waits on those bytes), so the extra FLOPs ride along almost free: checking K drafts costs about
one step, and every kept draft is a token without a step of its own.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from engine.events import DraftRound
from engine.instruments.phases import ModelShape


@dataclass(frozen=True)
class VerifyCost:
    """The counted work of one verify pass and of one plain decode step at the same context."""

    k: int
    context: int
    verify_flops: int
    verify_bytes: int
    step_flops: int
    step_bytes: int

    @property
    def flops_ratio(self) -> float:
        return self.verify_flops / self.step_flops

    @property
    def bytes_ratio(self) -> float:
        return self.verify_bytes / self.step_bytes


def verify_cost(shape: ModelShape, k: int, context: int) -> VerifyCost:
    """A pass over K+1 tokens after `context` cached ones, with logits at every position."""
    n = k + 1
    flops = 2 * shape.matmul_params * n + 2 * shape.head_params * n + shape.attention_flops(n, context)
    return VerifyCost(
        k=k,
        context=context,
        verify_flops=flops,
        verify_bytes=shape.prefill_bytes(n, context, chunks=1),
        step_flops=shape.decode_flops(context),
        step_bytes=shape.decode_bytes(context),
    )


@dataclass(frozen=True)
class MeasuredRounds:
    """The verify time of an answer's rounds that drafted the usual K (fewer drafts, a cheaper pass)."""

    k: int
    rounds: int
    verify_s: float
    """Median verify time of those rounds: the forward over K+1 tokens, accept/reject, cache crop."""
    draft_s: float


def measured_rounds(rounds: Sequence[DraftRound]) -> MeasuredRounds | None:
    if not rounds:
        return None
    k = Counter(len(r.drafted) for r in rounds).most_common(1)[0][0]
    usual = [r for r in rounds if len(r.drafted) == k]
    return MeasuredRounds(
        k=k,
        rounds=len(usual),
        verify_s=statistics.median(r.verify_s for r in usual),
        draft_s=statistics.median(r.draft_s for r in usual),
    )
