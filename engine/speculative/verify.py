"""Accept or reject drafted tokens so that the answer keeps the model's own distribution.

The model scored [x, d1..dK] in one forward pass: row i of `logits` is its distribution p_i for
the token after d_i (row 0: after x). Drafted token d_{i+1}, drawn from the draft's q_i, is kept
with probability min(1, p_i(d) / q_i(d)); the first rejection draws a correction from the
residual max(0, p_i - q_i), renormalised; if every draft is kept, row K gives a bonus token.
That is the rule of Leviathan et al. and Chen et al. (2023): each emitted token is distributed
exactly as p. At temperature 0 it reduces to: keep d while it is the model's argmax.
p is the sampler's own filtered distribution (penalty, temperature, top-k/p, min-p), so the
target is what plain decoding would draw from.
"""

from __future__ import annotations

from typing import Callable

import torch

from engine.sampling import Draw, Sampler
from engine.speculative.drafters import Drafts

Seen = Callable[[list[int]], torch.Tensor]
"""The ids the repetition penalty looks at, given the drafted ids kept so far."""


def verify(sampler: Sampler, logits: torch.Tensor, drafts: Drafts, seen: Seen) -> tuple[int, list[Draw]]:
    """(drafts accepted, the Draws to emit): the accepted drafts, then a correction or bonus token."""
    greedy = sampler.settings.temperature == 0.0
    draws: list[Draw] = []
    for i, d in enumerate(drafts.ids):
        logprobs = sampler.distribution(logits[i], seen(drafts.ids[:i]))
        if greedy:
            best = int(torch.argmax(logprobs))
            if best != d:
                return i, [*draws, sampler.describe(logprobs, best)]
        else:
            p = logprobs.exp()
            q = drafts.probs[i] if drafts.probs is not None else None
            if not _accept(sampler, p, q, d):
                return i, [*draws, sampler.describe(logprobs, sampler.draw(residual(p, q, d)))]
        draws.append(sampler.describe(logprobs, d))
    k = len(drafts.ids)
    bonus = sampler.sample(logits[k], seen(drafts.ids))
    return k, [*draws, bonus]


def _accept(sampler: Sampler, p: torch.Tensor, q: torch.Tensor | None, d: int) -> bool:
    """Keep d with probability min(1, p(d) / q(d)); q None is a point mass on d (q(d) = 1)."""
    q_d = 1.0 if q is None else float(q[d])
    p_d = float(p[d])
    if p_d >= q_d:
        return True
    return sampler.uniform() * q_d < p_d


def residual(p: torch.Tensor, q: torch.Tensor | None, d: int) -> torch.Tensor:
    """max(0, p - q), unnormalised (Sampler.draw scales by the sum); for a point mass, p without d."""
    if q is None:
        out = p.clone()
        out[d] = 0.0
    else:
        out = (p - q).clamp(min=0.0)
    if float(out.sum()) <= 0.0:  # p == q up to rounding: then a rejection cannot happen; stay safe
        return p
    return out
