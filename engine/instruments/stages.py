"""Sampler stages: how one step's distribution changes through the sampler chain.

The stages are the filters of `engine/sampling.py`, applied in the order `Sampler.distribution`
applies them (a test holds the two to the same final distribution):

    model logits -> repetition penalty -> temperature -> top-k -> top-p -> min-p -> softmax

After each stage the probabilities are softmax(logits so far); a filter "removes" a token by
setting its logit to -inf, so its probability becomes exactly 0 (a kept token may still round
to 0 in float32; it is counted as kept).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from engine.events import Candidate
from engine.sampling import (
    SamplingSettings,
    apply_min_p,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k,
    apply_top_p,
)

if TYPE_CHECKING:
    from engine.instruments.trace import AnswerTrace
    from engine.instruments.view import SessionView
    from engine.session import ChatSession

PieceName = Callable[[int], str]


@dataclass(frozen=True)
class Stage:
    """The distribution after one stage of the chain."""

    name: str
    setting: str
    """The setting as the user sets it, e.g. `top_k=40`."""
    active: bool
    """False when the setting leaves the distribution as it was (e.g. top_k=0)."""
    kept: int
    """Tokens with a probability above 0 after this stage."""
    removed: int
    """Tokens this stage took out (probability above 0 before, 0 after)."""
    removed_top: tuple[Candidate, ...]
    """The most probable of those, with the probability they had before this stage."""
    top: tuple[Candidate, ...]
    """The most probable tokens after this stage, renormalized."""


@dataclass(frozen=True)
class SamplerStages:
    stages: tuple[Stage, ...]
    """The model's own distribution first, then one entry per filter."""
    greedy: bool
    """Temperature 0: the most probable token of the final distribution is taken."""

    @property
    def final(self) -> Stage:
        return self.stages[-1]


def _chain(
    s: SamplingSettings,
) -> list[tuple[str, str, bool, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]]:
    """(name, setting, active, filter) in `Sampler.distribution`'s order."""
    return [
        (
            "repetition penalty",
            f"repetition_penalty={s.repetition_penalty:g}",
            s.repetition_penalty != 1.0,
            lambda x, seen: apply_repetition_penalty(x, seen, s.repetition_penalty),
        ),
        (
            "temperature",
            f"temperature={s.temperature:g}" + (" (greedy)" if s.temperature == 0 else ""),
            s.temperature not in (0.0, 1.0),
            lambda x, seen: apply_temperature(x, s.temperature),
        ),
        ("top-k", f"top_k={s.top_k}", s.top_k > 0, lambda x, seen: apply_top_k(x, s.top_k)),
        ("top-p", f"top_p={s.top_p:g}", s.top_p < 1.0, lambda x, seen: apply_top_p(x, s.top_p)),
        ("min-p", f"min_p={s.min_p:g}", s.min_p > 0.0, lambda x, seen: apply_min_p(x, s.min_p)),
    ]


def sampler_stages(
    logits: torch.Tensor,
    seen: torch.Tensor,
    settings: SamplingSettings,
    piece: PieceName = str,
    show: int = 10,
) -> SamplerStages:
    """For one step's raw logits, the distribution after each stage of the sampler chain.

    `seen` holds the token ids the repetition penalty looks at (the context so far); `piece`
    names a token id for display; `show` bounds the candidate lists.
    """
    current = logits.detach().float().reshape(-1)
    stages = [_stage("model", "raw logits", False, current, current, piece, show)]
    for name, setting, active, apply in _chain(settings):
        after = apply(current, seen)
        stages.append(_stage(name, setting, active, current, after, piece, show))
        current = after
    return SamplerStages(tuple(stages), greedy=settings.temperature == 0.0)


def _stage(
    name: str,
    setting: str,
    active: bool,
    before: torch.Tensor,
    after: torch.Tensor,
    piece: PieceName,
    show: int,
) -> Stage:
    probs_before = torch.softmax(before, dim=-1)
    probs = torch.softmax(after, dim=-1)
    alive = torch.isfinite(after)  # a filter removes a token by setting its logit to -inf
    gone = torch.isfinite(before) & ~alive
    kept, removed = int(alive.sum()), int(gone.sum())
    return Stage(
        name=name,
        setting=setting,
        active=active,
        kept=kept,
        removed=removed,
        removed_top=_top(probs_before.masked_fill(~gone, -1.0), min(show, removed), piece),
        top=_top(probs.masked_fill(~alive, -1.0), min(show, kept), piece),
    )


def _top(probs: torch.Tensor, k: int, piece: PieceName) -> tuple[Candidate, ...]:
    if k <= 0:
        return ()
    values, ids = torch.topk(probs, k)
    return tuple(Candidate(int(i), piece(int(i)), float(p)) for p, i in zip(values.tolist(), ids.tolist()))


def step_inputs(session: ChatSession, trace: AnswerTrace, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Recompute step `step`'s raw logits of a finished answer, and the ids the penalty saw.

    One forward pass over the prompt and the answer's first `step` tokens, without the
    session's cache (it is left untouched). Run it on the thread that owns the model.
    """
    ids = [*trace.prompt_ids, *trace.ids[:step]]
    with torch.inference_mode():
        inputs = torch.tensor([ids], device=session.device)
        logits = session.model(input_ids=inputs, use_cache=False, logits_to_keep=1).logits[0, -1]
    seen = torch.tensor(ids, device=session.device)
    return logits, seen


def stages_at(session: ChatSession, step: int, answer: int | None = None, show: int = 10) -> SamplerStages:
    """The sampler stages of step `step` of an answer (default: the last), at the current settings."""
    trace = session.trace if answer is None else session.messages[answer].trace
    if trace is None or not 0 <= step < len(trace):
        raise ValueError(f"no step {step} in that answer")
    logits, seen = step_inputs(session, trace, step)
    return sampler_stages(logits, seen, session.sampling, session.namer.piece, show)


def pending_stages(session: SessionView, show: int = 10) -> SamplerStages | None:
    """The stages of the step waiting in step mode (from its own logits), or None if none waits.

    Safe from any thread while the step waits: the inference thread is blocked at the gate.
    """
    pending = session.step_gate.pending
    if pending is None:
        return None
    return sampler_stages(pending.logits, pending.seen, pending.settings, session.namer.piece, show)
