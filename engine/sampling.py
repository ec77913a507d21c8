"""Sampling settings and the sampler, built from small pure filters over logits.

Every filter takes and returns a 1-D float32 logits tensor; removed entries become -inf.
The sampler returns the chosen id together with the distribution it was drawn from, so
the top-k the panels show and the chosen token's logprob come from one tensor. On a CPU, once
llmchat's kernels are loaded (engine/fast/kernels.py), one call of `sample_summary.cpp` does
the softmax, the draw and that summary; elsewhere torch's ops compute the same
(tests/test_sampling.py holds the two equal).
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass, fields

import torch

from engine.fast import kernels


@dataclass(frozen=True)
class SamplingSettings:
    temperature: float = 0.7
    """0 is greedy: always the most probable token."""
    top_k: int = 0
    """Keep only the k most probable tokens; 0 keeps all."""
    top_p: float = 1.0
    """Keep the smallest set whose probabilities sum to at least p; 1 keeps all."""
    min_p: float = 0.0
    """Drop tokens less probable than min_p times the most probable one; 0 keeps all."""
    repetition_penalty: float = 1.0
    """Divide positive (multiply negative) logits of tokens already in the context; 1 is off."""
    seed: int | None = None
    """Seed for each turn's random draws; None draws a fresh one."""
    max_new_tokens: int = 512
    """Stop an answer after this many tokens."""

    def __post_init__(self) -> None:
        _check("temperature", self.temperature, 0.0, 5.0)
        _check("top_k", self.top_k, 0, 1_000_000)
        _check("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check("min_p", self.min_p, 0.0, 1.0)
        _check("repetition_penalty", self.repetition_penalty, 0.0, 10.0, low_open=True)
        _check("max_new_tokens", self.max_new_tokens, 1, 1_000_000)
        if self.seed is not None:
            _check("seed", self.seed, 0, 2**63 - 1)
        for name in ("top_k", "max_new_tokens", "seed"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, int):
                raise ValueError(f"{name} must be a whole number, got {value!r}")

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def _check(name: str, value: float, low: float, high: float, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    bad_low = value <= low if low_open else value < low
    if bad_low or value > high:
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be in {bracket}{low:g}, {high:g}], got {value:g}")


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL-style penalty on every token id in `seen`."""
    if penalty == 1.0 or seen.numel() == 0:
        return logits
    picked = logits[seen]
    logits = logits.clone()
    logits[seen] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Divide by the temperature; 0 (greedy) leaves the model's own distribution."""
    return logits if temperature in (0.0, 1.0) else logits / temperature


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k <= 0 or k >= logits.numel():
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
    # Drop a token when the mass before it already reaches p; the top token always stays.
    drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= p
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    if min_p <= 0.0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))


@dataclass(frozen=True)
class Draw:
    """A sampled token and the top of the distribution it came from (on the host)."""

    id: int
    logprob: float
    top_ids: list[int]
    top_probs: list[float]
    entropy: float = 0.0
    """Entropy of the whole distribution the token was drawn from, in nats: -sum p ln p."""
    rank: int = 0
    """1 for the most probable token, 2 for the next...; 0 when unknown."""

    @property
    def greedy_id(self) -> int:
        """The most probable token (what temperature 0 would take)."""
        return self.top_ids[0] if self.top_ids else self.id

    def take(self, token_id: int) -> Draw:
        """The same distribution with `token_id` taken instead: the sampled token or one of the top."""
        if token_id == self.id:
            return self
        if token_id not in self.top_ids:
            raise ValueError(
                f"token {token_id} is neither the sampled token nor among the top {len(self.top_ids)}"
            )
        at = self.top_ids.index(token_id)
        prob = self.top_probs[at]
        if prob <= 0.0:
            raise ValueError(f"token {token_id} was removed by the sampling filters (probability 0)")
        return dataclasses.replace(self, id=token_id, logprob=math.log(prob), rank=at + 1)


class Sampler:
    """Turns one step's logits into a token, given the current settings."""

    def __init__(self, settings: SamplingSettings, show_top_k: int = 10, fused: bool = True):
        self.settings = settings
        self.show_top_k = show_top_k
        self.fused = fused
        """Summarize a step in one call of the kernel (engine/fast/sample_summary.cpp) where it is
        loaded; False, or until it is, torch's ops compute the same."""
        self.random = random.Random()
        """The draws' uniform numbers: on the host, so a draw costs no tensor op (and no device
        sync) for them; seeded, they repeat."""
        self.reseed()

    def reseed(self) -> None:
        self.random.seed(self.settings.seed)  # None seeds afresh from the OS

    def uniform(self) -> float:
        """u ~ U[0, 1) from this sampler's seeded stream."""
        return self.random.random()

    def filtered(self, logits: torch.Tensor, seen: torch.Tensor) -> tuple[torch.Tensor, float]:
        """The float32 logits after every filter (removed tokens -inf), and the factor the final
        distribution still scales them by: 1/temperature, or 1 where top-p or min-p, which
        depend on the temperature, had it applied first."""
        s = self.settings
        logits = apply_repetition_penalty(logits.float(), seen, s.repetition_penalty)
        logits = apply_top_k(logits, s.top_k)  # by order alone: the same before the temperature
        if s.top_p >= 1.0 and s.min_p <= 0.0:
            return logits, 1.0 if s.temperature in (0.0, 1.0) else 1.0 / s.temperature
        logits = apply_temperature(logits, s.temperature)
        return apply_min_p(apply_top_p(logits, s.top_p), s.min_p), 1.0

    def distribution(self, logits: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        """Log-probabilities of the final distribution (after every filter)."""
        logits, scale = self.filtered(logits, seen)
        return torch.log_softmax(logits if scale == 1.0 else logits * scale, dim=-1)

    def _draw(self, probs: torch.Tensor) -> torch.Tensor:
        """Inverse-CDF sampling: the first token whose cumulative probability exceeds u ~ U[0, 1).

        Same distribution as torch.multinomial, and an order of magnitude cheaper on a CPU for one
        draw over a whole vocabulary (docs/benchmarks-history.md). A filtered token (p = 0) adds no
        width to the CDF, so `right=True` can never land on it.
        """
        cdf = torch.cumsum(probs, dim=0)
        target = (cdf[-1] * self.uniform()).view(1)
        return torch.searchsorted(cdf, target, right=True).clamp(max=probs.numel() - 1)[0]

    def draw(self, probs: torch.Tensor) -> int:
        """One id drawn from `probs` (need not sum to 1) with this sampler's random stream."""
        return int(self._draw(probs))

    def sample(self, logits: torch.Tensor, seen: torch.Tensor) -> Draw:
        greedy = self.settings.temperature == 0.0
        if self._summarized_in_one_call(logits):
            filtered, scale = self.filtered(logits, seen)
            return self._summary(filtered, scale, -1, None if greedy else self.uniform())
        logprobs = self.distribution(logits, seen)
        chosen = torch.argmax(logprobs) if greedy else self._draw(logprobs.exp())
        return self.describe(logprobs, chosen)

    def _summarized_in_one_call(self, logits: torch.Tensor) -> bool:
        return self.fused and logits.device.type == "cpu" and kernels.is_loaded("sampling")

    def _summary(self, logits: torch.Tensor, scale: float, chosen: int, u: float | None) -> Draw:
        """The Draw by the kernel: of `chosen`, else drawn with `u` in [0, 1), else the top."""
        k = min(self.show_top_k, logits.numel())
        packed = torch.ops.llmchat.sample_summary(logits.contiguous(), scale, chosen, u, k)
        return _unpacked(packed.tolist(), k)

    def describe(self, logprobs: torch.Tensor, chosen: torch.Tensor | int) -> Draw:
        """The Draw of token `chosen` from the distribution `logprobs` (from `distribution`)."""
        if self._summarized_in_one_call(logprobs):
            return self._summary(logprobs.float(), 1.0, int(chosen), None)
        chosen = torch.as_tensor(chosen, device=logprobs.device)
        probs = logprobs.exp()
        greedy = self.settings.temperature == 0.0
        top = torch.topk(logprobs, min(self.show_top_k, logprobs.numel()))
        chosen_logprob = logprobs[chosen].view(1)
        # Entropy -sum p ln p and rank stay on the device. A removed token has p = 0 and
        # ln p = -inf; clamping ln p to the lowest finite float makes its term 0, not NaN.
        entropy = -torch.dot(probs, logprobs.clamp(min=torch.finfo(logprobs.dtype).min)).view(1)
        rank = (
            torch.ones_like(chosen_logprob)
            if greedy
            else torch.count_nonzero(logprobs > chosen_logprob).view(1) + 1
        )
        # One host copy per step, packed as the kernel packs it (ids and ranks are exact in
        # float32 below 2**24, far above any vocabulary size).
        dtype = logprobs.dtype
        packed = torch.cat(
            [
                chosen.view(1).to(dtype),
                chosen_logprob,
                entropy,
                rank.to(dtype),
                top.values.exp(),
                top.indices.to(dtype),
            ]
        )
        return _unpacked(packed.tolist(), top.values.numel())


def _unpacked(values: list[float], k: int) -> Draw:
    """A Draw from [id, logprob, entropy, rank, k top probabilities, k top ids]."""
    return Draw(
        id=int(values[0]),
        logprob=values[1],
        entropy=values[2],
        rank=int(values[3]),
        top_probs=values[4 : 4 + k],
        top_ids=[int(v) for v in values[4 + k :]],
    )
