"""The logit lens: what the model would predict after each of its layers, for one step.

A decoder layer adds its attention and MLP outputs to the residual stream, a vector per position
that the last layer hands to the final norm and the LM head. Applying that same norm and head
to the stream after an earlier layer reads what the model "would say" if it stopped there
(nostalgebraist's logit lens). The top tokens and the entropy per layer show where the answer
appears: early layers predict generic or input-like tokens, and the chosen token rises to the
top somewhere in the stack. After the last layer the lens is the model's own distribution,
which is checked (`final_gap`).

One forward pass over the context before the step (the transformers forward, no cache) keeps
each layer's output at the last position through forward hooks. Call on the inference thread
(`engine.call`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from engine.instruments.trace import AnswerTrace
    from engine.session import ChatSession

TOP = 5


@dataclass(frozen=True)
class Guess:
    id: int
    piece: str
    prob: float


@dataclass(frozen=True)
class LayerReading:
    layer: int
    """The decoder layer whose output was read (0-based)."""
    top: tuple[Guess, ...]
    entropy_bits: float
    chosen_prob: float
    chosen_rank: int
    """1 = the chosen token is this layer's top guess."""


@dataclass(frozen=True)
class Lens:
    position: int
    """The position read: its output predicts the chosen token."""
    chosen: Guess
    """The token the answer took at this step, with the model's final probability for it."""
    layers: tuple[LayerReading, ...]
    final_gap: float
    """max |lens after the last layer − the model's own probabilities|: ~0 when the lens reads the
    stream as the model's own head does."""

    @property
    def appears(self) -> int | None:
        """The first layer from which the chosen token is the top guess at every later layer."""
        first = None
        for reading in self.layers:
            if reading.chosen_rank == 1:
                first = reading.layer if first is None else first
            else:
                first = None
        return first


def context_before(trace: AnswerTrace, step: int) -> tuple[list[int], int]:
    """The ids the model saw before `step` of the answer, and the token it took there."""
    if not 0 <= step < len(trace.steps) or trace.steps[step].id is None:
        raise ValueError(f"no token at step {step} of this answer")
    return [*trace.prompt_ids, *(s.id for s in trace.steps[:step])], trace.steps[step].id


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return list(model.model.layers)


def final_head(model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The model's own way from the residual stream to logits: the final norm, the LM head, and
    the family's logit soft-cap where it has one (Gemma)."""
    norm, head = model.model.norm, model.get_output_embeddings()
    cap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)

    def logits(stream: torch.Tensor) -> torch.Tensor:
        out = head(norm(stream)).float()
        return cap * torch.tanh(out / cap) if cap else out

    return logits


def layer_outputs(session: ChatSession, ids: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each decoder layer's output at the last position, and the model's own logits there."""
    from engine.instruments.attention import existing_probe

    model = session.model
    layers = decoder_layers(model)
    kept: list[torch.Tensor | None] = [None] * len(layers)

    def keeper(index: int):
        def keep(module, args, output) -> None:
            stream = output[0] if isinstance(output, tuple) else output
            kept[index] = stream[:, -1:].detach()

        return keep

    hooks = [layer.register_forward_hook(keeper(i)) for i, layer in enumerate(layers)]
    probe = existing_probe(session)
    try:
        if probe is not None:
            probe.quiet = True  # this pass's rows are not the newest step's
        with torch.inference_mode():
            out = model(
                input_ids=torch.tensor([ids], device=session.device), use_cache=False, logits_to_keep=1
            )
    finally:
        for hook in hooks:
            hook.remove()
        if probe is not None:
            probe.quiet = False
    return [k for k in kept if k is not None], out.logits[0, -1].float()


def read(logits: torch.Tensor, layer: int, chosen: int, namer) -> LayerReading:
    probs = torch.softmax(logits, dim=-1)
    top = torch.topk(probs, TOP)
    logp = torch.log_softmax(logits, dim=-1)
    entropy = float(-(probs * logp).sum()) / math.log(2)
    return LayerReading(
        layer=layer,
        top=tuple(Guess(int(i), namer.piece(int(i)), float(p)) for p, i in zip(top.values, top.indices)),
        entropy_bits=entropy,
        chosen_prob=float(probs[chosen]),
        chosen_rank=int((probs > probs[chosen]).sum()) + 1,
    )


def logit_lens(session: ChatSession, ids: list[int], chosen: int) -> Lens:
    """The lens at the last of `ids`, for the token `chosen` taken after them."""
    model = session.model
    outputs, final = layer_outputs(session, ids)
    head = final_head(model)
    with torch.inference_mode():
        readings = tuple(read(head(h)[0, -1], i, chosen, session.namer) for i, h in enumerate(outputs))
        own = torch.softmax(final, dim=-1)
        last = torch.softmax(head(outputs[-1])[0, -1], dim=-1)
        gap = float((own - last).abs().max())
    return Lens(
        position=len(ids) - 1,
        chosen=Guess(chosen, session.namer.piece(chosen), float(own[chosen])),
        layers=readings,
        final_gap=gap,
    )
