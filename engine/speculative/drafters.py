"""Drafters: who proposes the next K tokens for the model to verify.

A drafter returns the drafted ids and, per drafted id, the probabilities it drew it from
(None for a deterministic drafter: a point mass on the id, which verify.py treats as such).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.fast import fused
from engine.fast.compiled import compiled_decode
from engine.forward import forward
from engine.kvcache import KVCache
from engine.models import LoadedModel
from engine.sampling import Sampler

MAX_DRAFT_TOKENS = 8


def check_draft_tokens(k: object) -> int:
    """K, the tokens a round drafts: a whole number in 1..8, else ValueError."""
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_DRAFT_TOKENS:
        raise ValueError(f"draft tokens must be a whole number from 1 to {MAX_DRAFT_TOKENS}, got {k!r}")
    return k


@dataclass(frozen=True)
class Drafts:
    ids: list[int]
    probs: list[torch.Tensor] | None
    """The draft distribution each id was drawn from; None: each id was certain (point mass)."""


class PromptLookup:
    """Draft by n-gram match: find the conversation's last n ids earlier in it, propose what followed.

    No second model; it pays when the answer repeats the prompt (repeat, edit, summarise, code).
    """

    name = "lookup"

    def __init__(self, longest: int = 3, shortest: int = 2):
        self.longest, self.shortest = longest, shortest

    def propose(self, context: list[int], k: int, sampler: Sampler) -> Drafts:
        for n in range(min(self.longest, len(context) - 1), self.shortest - 1, -1):
            follow = lookup(context, n, k)
            if follow:
                return Drafts(follow, None)
        return Drafts([], None)


def lookup(context: list[int], n: int, k: int) -> list[int]:
    """Up to k ids that followed the most recent earlier occurrence of the last n ids."""
    tail = context[-n:]
    for start in range(len(context) - n - 1, -1, -1):
        if context[start : start + n] == tail:
            return context[start + n : start + n + k]
    return []


class DraftModel:
    """Draft with a second, cheaper model that shares the tokenizer; it keeps its own KV cache.
    With `compile`, its one-token steps run its own compiled step once built (as the target's
    do): with the K-1 steps of a round after the first eager, a same-model w8 draft lost to the
    fp32 model it drafted for (0.95x; compiled, 1.48x: BENCHMARKS.md)."""

    def __init__(self, loaded: LoadedModel, target_vocab: int, target_tokenizer, compile: bool = False):
        problem = tokenizer_mismatch(loaded.tokenizer, target_tokenizer)
        if problem:
            raise ValueError(f"draft model {loaded.info.name}: {problem}")
        self.loaded = loaded
        self.name = f"{loaded.info.spec}@{loaded.info.precision}"
        self.vocab = target_vocab
        self.cache = KVCache.for_model(loaded.info)
        self.device = next(loaded.model.parameters()).device
        self.fast = None if fused.supports(loaded.model) else fused.for_model(loaded.model, compiled=compile)
        self.compiled = compiled_decode(self.fast, loaded.info) if compile and self.fast is not None else None
        self.forward_s = 0.0

    def wait_compiled(self, timeout: float | None = None) -> None:
        """Until its compiled step serves, or will not (a benchmark times the steady state)."""
        if self.compiled is not None:
            self.compiled.wait_settled(timeout)

    def propose(self, context: list[int], k: int, sampler: Sampler) -> Drafts:
        reused = self.cache.reuse(context)
        logits = self._forward(context[reused:])
        ids, probs = [], []
        no_ids = torch.empty(0, dtype=torch.long, device=self.device)
        for i in range(k):
            # The draft's own distribution under the same filters (no repetition penalty).
            q = sampler.distribution(self._target_vocab(logits), no_ids).exp()
            ids.append(int(torch.argmax(q)) if sampler.settings.temperature == 0.0 else sampler.draw(q))
            probs.append(q)
            if i < k - 1:
                logits = self._forward(ids[-1:])
        return Drafts(ids, probs)

    def _compiled_serves(self) -> bool:
        """Its compiled step is ready (built for its cache's dtype: the model's own, never switched)."""
        return self.compiled is not None and self.compiled.ready.is_set()

    def _target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits over the target's vocabulary (padding rows differ between models)."""
        if logits.numel() >= self.vocab:
            return logits[: self.vocab]
        return torch.cat([logits, logits.new_full((self.vocab - logits.numel(),), float("-inf"))])

    def _forward(self, ids: list[int]) -> torch.Tensor:
        started = time.perf_counter()
        compiled = self.compiled if self._compiled_serves() else None
        for start in range(0, len(ids), 512):
            chunk = ids[start : start + 512]
            logits = forward(self.loaded.model, self.fast, compiled, chunk, self.cache, self.device)
        self.forward_s += time.perf_counter() - started
        return logits.float()


def tokenizer_mismatch(draft, target) -> str | None:
    """Why a draft's tokenizer cannot draft for the target's, or None when they are the same."""
    if draft.get_vocab() != target.get_vocab():
        return "its tokenizer differs from the model's (a draft must share the tokenizer)"
    return None
