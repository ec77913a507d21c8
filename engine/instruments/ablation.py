"""Ablation, a what-if: turn off one attention head, or a whole layer's MLP, for one step.

The step's context goes through the model twice (the transformers forward, no cache): as it is,
and with one part silenced. A head is silenced by zeroing its slice of the attention output
before the output projection (o_proj), so it adds nothing to the residual stream, at every
position of the pass; an MLP by returning zeros for its output. The two next-token
distributions, their top tokens side by side and the KL divergence between them, show how much
that part mattered to this prediction: most heads change little, a few change the answer.

Call on the inference thread (`engine.call`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.instruments.logit_lens import TOP, Guess, decoder_layers

if TYPE_CHECKING:
    from engine.session import ChatSession

MLP = -1
"""`Part.head` for the layer's whole MLP."""


@dataclass(frozen=True)
class Part:
    layer: int
    head: int
    """A query head, or MLP for the layer's MLP."""

    def describe(self) -> str:
        return f"layer {self.layer}'s MLP" if self.head == MLP else f"layer {self.layer}, head {self.head}"


@dataclass(frozen=True)
class Ablation:
    part: Part
    before: tuple[Guess, ...]
    after: tuple[Guess, ...]
    kl_nats: float
    """KL(before ‖ after): how far the silenced model's distribution moved, in nats."""
    chosen: Guess
    chosen_after: float
    """The chosen token's probability with the part silenced."""

    @property
    def top_changed(self) -> bool:
        return self.before[0].id != self.after[0].id


def head_dim(model: torch.nn.Module) -> int:
    config = model.config.get_text_config()
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def silence(model: torch.nn.Module, part: Part) -> torch.utils.hooks.RemovableHandle:
    """Hook `part` off for the passes that follow; remove the handle to turn it back on."""
    layers = decoder_layers(model)
    if not 0 <= part.layer < len(layers):
        raise ValueError(f"layer must be in [0, {len(layers) - 1}], got {part.layer}")
    layer = layers[part.layer]
    if part.head == MLP:
        return layer.mlp.register_forward_hook(lambda module, args, output: torch.zeros_like(output))
    heads = model.config.get_text_config().num_attention_heads
    if not 0 <= part.head < heads:
        raise ValueError(f"head must be in [0, {heads - 1}], got {part.head}")
    size = head_dim(model)
    start = part.head * size

    def zero_head(module, args):
        (x, *rest) = args
        x = x.clone()
        x[..., start : start + size] = 0
        return (x, *rest)

    return layer.self_attn.o_proj.register_forward_pre_hook(zero_head)


def next_token_probs(session: ChatSession, ids: list[int]) -> torch.Tensor:
    from engine.instruments.attention import existing_probe

    probe = existing_probe(session)
    try:
        if probe is not None:
            probe.quiet = True
        with torch.inference_mode():
            out = session.model(
                input_ids=torch.tensor([ids], device=session.device), use_cache=False, logits_to_keep=1
            )
    finally:
        if probe is not None:
            probe.quiet = False
    return torch.softmax(out.logits[0, -1].float(), dim=-1)


def ablate(session: ChatSession, ids: list[int], chosen: int, part: Part) -> Ablation:
    """The next-token distribution after `ids`, as it is and with `part` silenced."""
    before = next_token_probs(session, ids)
    handle = silence(session.model, part)
    try:
        after = next_token_probs(session, ids)
    finally:
        handle.remove()
    kl = float((before * (torch.log(before.clamp_min(1e-30)) - torch.log(after.clamp_min(1e-30)))).sum())
    return Ablation(
        part=part,
        before=_top(before, session),
        after=_top(after, session),
        kl_nats=max(0.0, kl) if math.isfinite(kl) else float("inf"),
        chosen=Guess(chosen, session.namer.piece(chosen), float(before[chosen])),
        chosen_after=float(after[chosen]),
    )


def _top(probs: torch.Tensor, session: ChatSession) -> tuple[Guess, ...]:
    top = torch.topk(probs, TOP)
    return tuple(
        Guess(int(i), session.namer.piece(int(i)), float(p)) for p, i in zip(top.values, top.indices)
    )
