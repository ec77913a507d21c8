"""Attention over the whole prompt: the causal matrix (query × key) of one prefill, per layer and head.

A prefill feeds every prompt position at once, so each layer and head computes a whole
matrix of weights, softmax(QKᵀ/√d + mask): row q is where position q looks, and the causal
mask zeroes every key after q (the upper triangle). Here one eager forward pass over the
cached context computes it, as one prefill of the whole conversation would. A causal row
depends only on the positions up to it, so the rows are the ones computed turn by turn
(earlier turns' rows came from the cache, this turn's prompt was prefilled, the answer was
decoded a row at a time); `prefilled` marks the last turn's prefill.

The pass stops after the chosen layer (an exception from its hook: later layers cannot change
it) and keeps that layer's [heads, n, n] weights on the probe, so another head is a slice,
not another pass. Call these on the thread that owns the model (`engine.call`).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from engine.instruments.attention import (
    AttentionView,
    SpanWeight,
    attention_implementation,
    attention_modules,
    existing_probe,
    kv_head_of,
    probe_of,
)
from engine.instruments.tokview import Span, message_spans

if TYPE_CHECKING:
    from engine.session import ChatSession

MAX_POSITIONS = 2048
"""The matrix covers at most the first this many positions: a layer's weights are heads × n²
floats (2,048: 151 MB for SmolLM2's 9 heads). Causal rows make the first n exact."""

SINK_SHARE = 0.3
"""Position 0 is named an attention sink where it takes at least this mean share of the rows…"""
SINK_OVER_UNIFORM = 3.0
"""…and at least this many times what spreading each row evenly would give it."""


@dataclass(frozen=True)
class PrefillMatrix:
    """One layer and head's causal attention matrix, as plain numbers the UI thread may hold."""

    layer: int
    head: int
    kv_head: int
    """The K/V head this query head reads (its group)."""
    ids: tuple[int, ...]
    rows: tuple[array, ...]
    """Row q holds the weights of keys 0..q (q + 1 floats, summing to 1); keys after q are masked: 0."""
    context: int
    """Positions in the cache; more than len(ids) where the matrix stops at MAX_POSITIONS."""
    spans: tuple[Span, ...]
    prefilled: tuple[int, int] | None
    """The last turn's prefill rows [start, end), where the cache still begins with its prompt."""
    sink_shares: tuple[float, ...]
    """Per head of this layer: the mean weight position 0 gets over the rows 1..n−1."""
    uniform_share: float
    """What position 0 would get on average if each row spread its weight evenly: mean 1/(q+1)."""

    @property
    def size(self) -> int:
        return len(self.ids)

    @property
    def sink_share(self) -> float:
        return self.sink_shares[self.head]

    @property
    def is_sink(self) -> bool:
        return is_sink(self.sink_share, self.uniform_share)

    def weight(self, query: int, key: int) -> float:
        """0 above the diagonal: the mask."""
        return self.rows[query][key] if key <= query else 0.0

    def row_view(self, query: int) -> AttentionView:
        """Row `query` as the newest-row view shows a row (its context is positions 0..query)."""
        if not 0 <= query < self.size:
            raise ValueError(f"query must be in [0, {self.size - 1}], got {query}")
        weights = tuple(self.rows[query])
        spans = [replace(s, end=min(s.end, query + 1)) for s in self.spans if s.start <= query]
        return AttentionView(
            layer=self.layer,
            head=self.head,
            query_position=query,
            ids=self.ids[: query + 1],
            weights=weights,
            spans=tuple(SpanWeight(s, sum(weights[s.start : s.end])) for s in spans),
        )


def is_sink(share: float, uniform: float) -> bool:
    return share >= SINK_SHARE and share >= SINK_OVER_UNIFORM * uniform


class _Stop(Exception):
    """Raised by the chosen layer's hook: the layers after it cannot change its weights."""


@dataclass
class _LayerWeights:
    ids: tuple[int, ...]
    layer: int
    weights: torch.Tensor
    """[heads, n, n] float32 on the host."""


def layer_weights(session: ChatSession, ids: tuple[int, ...], layer: int) -> torch.Tensor:
    """[heads, n, n]: softmax(QKᵀ/√d + causal mask) of `layer` over `ids`, from one eager pass."""
    model = session.model
    modules = attention_modules(model)
    if not 0 <= layer < len(modules):
        raise ValueError(f"layer must be in [0, {len(modules) - 1}], got {layer}")
    kept: dict[str, torch.Tensor] = {}

    def keep(module, args, output) -> None:
        kept["weights"] = output[1][0].detach().float().cpu()
        raise _Stop

    probe = existing_probe(session)
    previous = attention_implementation(model)
    hook = modules[layer].register_forward_hook(keep)
    try:
        if previous != "eager":  # only eager materializes the weights
            model.set_attn_implementation("eager")
        if probe is not None:
            probe.quiet = True  # this pass's last row is not the newest step's (the matrix may stop early)
        with torch.inference_mode():
            model(input_ids=torch.tensor([ids], device=session.device), use_cache=False, logits_to_keep=1)
    except _Stop:
        pass
    finally:
        hook.remove()
        if probe is not None:
            probe.quiet = False
        if previous != "eager":
            model.set_attn_implementation(previous)
    return kept["weights"]


def prefill_matrix(session: ChatSession, layer: int, head: int) -> PrefillMatrix | None:
    """The causal matrix of `layer` and `head` over the cached context; None while the cache is empty."""
    info = session.info
    if not 0 <= head < info.heads:
        raise ValueError(f"head must be in [0, {info.heads - 1}], got {head}")
    context = list(session.cache.ids)
    if not context:
        return None
    ids = tuple(context[:MAX_POSITIONS])
    probe = probe_of(session)
    kept = probe.matrix
    if kept is None or kept.ids != ids or kept.layer != layer:
        kept = probe.matrix = _LayerWeights(ids, layer, layer_weights(session, ids, layer))
    weights = kept.weights
    n = len(ids)
    later = torch.arange(1, n)
    shares = weights[:, 1:, 0].mean(dim=1).tolist() if n > 1 else [1.0] * info.heads
    uniform = float((1.0 / (later + 1).double()).mean()) if n > 1 else 1.0
    chosen = weights[head]
    return PrefillMatrix(
        layer=layer,
        head=head,
        kv_head=kv_head_of(head, info.heads, info.kv_heads),
        ids=ids,
        rows=tuple(array("f", chosen[q, : q + 1].tolist()) for q in range(n)),
        context=len(context),
        spans=message_spans(session, ids),
        prefilled=last_prefill(session, ids),
        sink_shares=tuple(shares),
        uniform_share=uniform,
    )


def last_prefill(session: ChatSession, ids: tuple[int, ...]) -> tuple[int, int] | None:
    """Rows [reused, len(prompt)) of the last turn's prompt, where `ids` still begin with that prompt."""
    trace = session.trace
    if trace is None or trace.reused is None:
        return None
    prompt = trace.prompt_ids
    if tuple(ids[: len(prompt)]) != tuple(prompt):
        return None
    return trace.reused, len(prompt)
