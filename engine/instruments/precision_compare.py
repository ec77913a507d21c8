"""Precision compare: the same turn at two precisions, the second teacher-forced on the first.

What differs is the weights' precision (a second copy of the model is loaded), or the KV cache's
(`compare_kv_cache`: one model, an fp32 cache against a quantized one).

The reference model answers greedily; the other model is fed exactly the reference's tokens
(teacher forcing), so at every step both predict the next token from the same context and
their distributions can be compared position by position:

    agree_t = argmax P_other(· | x_<t) == x_t                  (top-1 agreement)
    KL_t    = Σ_v P_ref(v | x_<t) · (ln P_ref(v | x_<t) − ln P_other(v | x_<t))   (nats)

The two run interleaved, step by step, so a noisy machine slows both alike; each keeps its
own KV cache. This is an instrument, not the chat loop: it syncs with the host every step.
"""

from __future__ import annotations

import gc
import statistics
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from engine import models
from engine.contention import ContentionMeter
from engine.events import Contention
from engine.fast import fused
from engine.kvcache import KVCache, with_cache_precision
from engine.models import LoadedModel

if TYPE_CHECKING:
    from engine.session import ChatSession


@dataclass(frozen=True)
class StepCompare:
    step: int
    token: int
    """The reference's (greedy) token, fed to both."""
    other_top: int
    """The other model's most probable token at this step."""
    kl: float
    """KL(P_ref ‖ P_other) at this position, in nats."""
    ref_prob: float
    """P_ref(token)."""
    other_prob: float
    """P_other(token)."""

    @property
    def agree(self) -> bool:
        return self.other_top == self.token


@dataclass(frozen=True)
class SideStats:
    precision: str
    """What this side is: a weight precision, or 'fp32 · int8 KV cache' when caches are compared."""
    weight_bytes: int
    prefill_s: float
    itl_p50_s: float
    kv_bytes_per_token: int = 0

    @property
    def decode_tok_s(self) -> float:
        return 1.0 / self.itl_p50_s if self.itl_p50_s > 0 else 0.0


@dataclass(frozen=True)
class PrecisionComparison:
    reference: SideStats
    other: SideStats
    steps: tuple[StepCompare, ...]
    prompt_tokens: int
    contention: Contention | None = None
    """The CPU share the comparison got: on a busy machine its times are not the precisions' own."""

    @property
    def agreement(self) -> float:
        """Fraction of steps where the other model's top-1 is the reference's token."""
        return sum(s.agree for s in self.steps) / len(self.steps) if self.steps else 1.0

    @property
    def mean_kl(self) -> float:
        return statistics.fmean(s.kl for s in self.steps) if self.steps else 0.0

    @property
    def first_divergence(self) -> StepCompare | None:
        """The first step where the other model would have chosen another token; None if never."""
        return next((s for s in self.steps if not s.agree), None)


class _Runner:
    """One model with its own cache: feed ids, get the last position's log-probabilities."""

    def __init__(self, loaded: LoadedModel, chunk: int, cache_precision: str | None = None):
        self.model = loaded.model
        # The forward the chat loop runs, so the comparison measures what the user gets.
        self.fast = fused.for_model(loaded.model) if fused.supports(loaded.model) is None else None
        self.device = next(loaded.model.parameters()).device
        self.info = (
            loaded.info if cache_precision is None else with_cache_precision(loaded.info, cache_precision)
        )
        self.cache = KVCache.for_model(self.info)
        self.chunk = chunk
        self.prefill_s = 0.0
        self.itl: list[float] = []

    def prefill(self, ids: list[int]) -> torch.Tensor:
        logprobs, self.prefill_s = self.feed(ids)
        return logprobs

    def step(self, token: int) -> torch.Tensor:
        logprobs, seconds = self.feed([token])
        self.itl.append(seconds)
        return logprobs

    def feed(self, ids: list[int]) -> tuple[torch.Tensor, float]:
        started = time.perf_counter()
        for start in range(0, len(ids), self.chunk):
            part = ids[start : start + self.chunk]
            inputs = torch.tensor([part], device=self.device)
            if self.fast is not None:
                logits = self.fast.forward(inputs, self.cache)
            else:
                logits = self.model(
                    input_ids=inputs, cache=self.cache.hf, use_cache=True, logits_to_keep=1
                ).logits[0, -1]
            self.cache.appended(part)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return logprobs, time.perf_counter() - started


def compare_precisions(
    reference: LoadedModel,
    other: LoadedModel,
    prompt_ids: list[int],
    max_new_tokens: int = 32,
    stop_ids: set[int] | frozenset[int] = frozenset(),
    cancel: threading.Event | None = None,
    progress: Callable[[int, int], None] | None = None,
    caches: tuple[str | None, str | None] = (None, None),
) -> PrecisionComparison:
    """Answer `prompt_ids` greedily with `reference`, teacher-force `other` on its tokens, compare.
    `caches`: each side's KV cache precision (None: its precision's own)."""
    if not prompt_ids:
        raise ValueError("nothing to answer: the prompt is empty")
    if reference.info.vocab_size != other.info.vocab_size:
        raise ValueError("the two models have different vocabularies; compare one model at two precisions")
    from engine.session import PREFILL_CHUNK

    ref, oth = _Runner(reference, PREFILL_CHUNK, caches[0]), _Runner(other, PREFILL_CHUNK, caches[1])
    meter = ContentionMeter()
    with torch.inference_mode():
        steps = _teacher_force(
            ref, oth, prompt_ids, _Stop(max_new_tokens, frozenset(stop_ids), cancel, progress)
        )
    return PrecisionComparison(
        reference=_side(ref, caches[0]),
        other=_side(oth, caches[1]),
        steps=tuple(steps),
        prompt_tokens=len(prompt_ids),
        contention=meter.stop(),
    )


@dataclass(frozen=True)
class _Stop:
    """When a comparison ends: a stop token, a cancel, or `max_new_tokens` compared."""

    max_new_tokens: int
    stop_ids: frozenset[int]
    cancel: threading.Event | None
    progress: Callable[[int, int], None] | None

    def after(self, step: int, token: int) -> bool:
        """Report step `step` done; whether the comparison ends with its `token`."""
        if self.progress:
            self.progress(step + 1, self.max_new_tokens)
        cancelled = self.cancel is not None and self.cancel.is_set()
        return token in self.stop_ids or cancelled or step + 1 == self.max_new_tokens


def _teacher_force(ref: _Runner, oth: _Runner, prompt_ids: list[int], stop: _Stop) -> list[StepCompare]:
    """Prefill both sides, then compare them step by step, feeding both the reference's greedy
    token, until `stop` says so; each runner keeps its own timings."""
    ref_lp, oth_lp = ref.prefill(prompt_ids), oth.prefill(prompt_ids)
    steps: list[StepCompare] = []
    for step in range(stop.max_new_tokens):
        steps.append(_compare_step(step, ref_lp, oth_lp))
        if stop.after(step, steps[-1].token):
            break
        ref_lp, oth_lp = ref.step(steps[-1].token), oth.step(steps[-1].token)
    return steps


def _compare_step(step: int, ref_lp: torch.Tensor, oth_lp: torch.Tensor) -> StepCompare:
    """One step's comparison: the reference's greedy token, the other's top token, KL(ref || other)
    and each side's probability of the token (read back in one transfer)."""
    token = torch.argmax(ref_lp)
    kl = (ref_lp.exp() * (ref_lp - oth_lp)).sum()
    values = torch.stack(
        [token.float(), torch.argmax(oth_lp).float(), kl, ref_lp[token].exp(), oth_lp[token].exp()]
    )
    t, top, kl_value, p_ref, p_oth = values.tolist()
    return StepCompare(step, int(t), int(top), max(kl_value, 0.0), p_ref, p_oth)


def _side(runner: _Runner, cache: str | None) -> SideStats:
    info, prefill_s, itl = runner.info, runner.prefill_s, runner.itl
    label = info.precision if cache is None else f"{cache} KV cache"
    return SideStats(
        label,
        info.weight_bytes,
        prefill_s,
        statistics.median(itl) if itl else 0.0,
        info.kv_bytes_per_token or 0,
    )


def compare_kv_cache(
    loaded: LoadedModel,
    prompt_ids: list[int],
    cache_precision: str,
    max_new_tokens: int = 32,
    stop_ids: set[int] | frozenset[int] = frozenset(),
    cancel: threading.Event | None = None,
) -> PrecisionComparison:
    """One model, the turn answered greedily with an fp32 KV cache and teacher-forced with a
    `cache_precision` one: what the cache's rounding alone does to the distribution. Both sides
    run the same forward (the fast path's eager step; the compiled step serves fp32 only)."""
    return compare_precisions(
        loaded, loaded, prompt_ids, max_new_tokens, stop_ids, cancel, caches=("fp32", cache_precision)
    )


def compare_turn_kv_cache(
    session: ChatSession,
    cache_precision: str,
    max_new_tokens: int = 32,
    cancel: threading.Event | None = None,
) -> PrecisionComparison:
    """For `engine.call`: the session's last turn with an fp32 cache against a `cache_precision` one."""
    if cancel is not None and cancel.is_set():
        raise RuntimeError("cancelled")
    return compare_kv_cache(
        session.loaded, turn_ids(session), cache_precision, max_new_tokens, session.stop_ids, cancel
    )


def turn_ids(session: ChatSession) -> list[int]:
    """The templated conversation up to its last user message: the turn to answer again."""
    messages = list(session.messages)
    while messages and messages[-1].role == "assistant":
        messages.pop()
    if not messages:
        raise ValueError("no user message to answer yet")
    return session.template(messages)


def compare_turn(
    session: ChatSession, other: LoadedModel, max_new_tokens: int = 32, cancel: threading.Event | None = None
) -> PrecisionComparison:
    """The session's last turn, its model as the reference against `other` (same model, another precision)."""
    return compare_precisions(
        session.loaded, other, turn_ids(session), max_new_tokens, session.stop_ids, cancel
    )


def compare_turn_at(
    session: ChatSession, precision: str, max_new_tokens: int = 32, cancel: threading.Event | None = None
) -> PrecisionComparison:
    """For `engine.call`: load the session's model at `precision`, compare the last turn, free it again."""
    if cancel is not None and cancel.is_set():
        raise RuntimeError("cancelled")
    # Fed the turn's ids only: a base model without a chat template loads as well.
    other = models.load(session.info.spec, precision, session.info.device, chat=False)
    try:
        return compare_turn(session, other, max_new_tokens, cancel)
    finally:
        del other
        gc.collect()  # the second model's weights go before the chat's next turn
