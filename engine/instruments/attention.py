"""Attention view: where the newest position looks, for one layer and head (or averaged).

While the probe is on, the session runs the Hugging Face forward (not its fast path) with
eager attention (the only implementation that materializes softmax(QKᵀ/√d)), which slows
every forward pass; both switch back when the probe is off. A forward hook on each layer's
attention module keeps that layer's last query row, [heads, context], on the device: a copy
of heads × context numbers per layer and step.
Nothing reaches the host until `view` is asked for.

Call `enable` and `disable` on the thread that owns the model, between forward passes, and
`disable` before the session switches model.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.instruments.tokview import Span, message_spans

if TYPE_CHECKING:
    from engine.session import ChatSession


def attention_implementation(model) -> str | None:
    """The attention kernel the HF model runs ('sdpa', 'eager', ...)."""
    return model.config._attn_implementation  # noqa: SLF001 (transformers has no public getter)


@dataclass(frozen=True)
class SpanWeight:
    span: Span
    weight: float
    """Total attention on the span's positions (the spans' weights sum to 1)."""


@dataclass(frozen=True)
class AttentionView:
    """One query's attention over the context."""

    layer: int | None
    """None: averaged over layers."""
    head: int | None
    """None: averaged over heads."""
    query_position: int
    """The position attending; its output predicts the token at `query_position + 1`."""
    ids: tuple[int, ...]
    """The context ids, one per weight."""
    weights: tuple[float, ...]
    """softmax(q·kᵀ/√d) over the context: non-negative, summing to 1."""
    spans: tuple[SpanWeight, ...]
    head_weights: tuple[tuple[float, ...], ...] = ()
    """Each query head's row at `layer` (averaged over layers where `layer` is None), head order."""


def kv_head_of(head: int, heads: int, kv_heads: int) -> int:
    """The K/V head a query head reads: with grouped-query attention each K/V head serves
    `heads // kv_heads` consecutive query heads (transformers' `repeat_kv` expands it so)."""
    if not 0 <= head < heads or kv_heads < 1 or heads % kv_heads:
        raise ValueError(
            f"head must be in [0, {heads - 1}] and kv_heads divide {heads}, got {head}, {kv_heads}"
        )
    return head // (heads // kv_heads)


def kv_groups(heads: int, kv_heads: int) -> tuple[tuple[int, ...], ...]:
    """The query heads under each K/V head: SmolLM2's 9 and 3 give (0, 1, 2), (3, 4, 5), (6, 7, 8)."""
    groups: list[list[int]] = [[] for _ in range(kv_heads)]
    for head in range(heads):
        groups[kv_head_of(head, heads, kv_heads)].append(head)
    return tuple(tuple(g) for g in groups)


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Each decoder layer's self-attention module, in order."""
    return [layer.self_attn for layer in model.model.layers]


class AttentionProbe:
    """Switches a session's model to eager attention and keeps each layer's newest attention row."""

    def __init__(self, session: ChatSession):
        self.session = session
        self._rows: dict[int, torch.Tensor] = {}
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._previous: str | None = None
        self._fast = None
        self._model: torch.nn.Module | None = None
        self.quiet = False
        """True while another pass (the prefill matrix's) runs: its rows are not the newest."""
        self.matrix = None
        """The last prefill matrix computed (engine/instruments/attention_matrix.py), kept for reuse."""

    @property
    def enabled(self) -> bool:
        return bool(self._hooks)

    def enable(self) -> None:
        if self.enabled:
            return
        model = self._model = self.session.model
        self._previous = attention_implementation(model)
        model.set_attn_implementation("eager")
        self._fast, self.session.fast = getattr(self.session, "fast", None), None  # hooks need the HF forward
        for layer, module in enumerate(attention_modules(model)):
            self._hooks.append(module.register_forward_hook(self._keeper(layer)))

    def disable(self) -> None:
        """Remove the hooks; go back to the attention the model had (sdpa) and the session's fast path."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._rows.clear()
        self.matrix = None
        if self._previous is not None:
            self._model.set_attn_implementation(self._previous)
            self._previous = None
            if self.session.model is self._model:  # a model switched meanwhile brought its own fast path
                self.session.fast = self._fast
            self._fast = self._model = None

    def _keeper(self, layer: int):
        def keep(module: torch.nn.Module, args, output) -> None:
            weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
            if (
                weights is not None and not self.quiet
            ):  # [batch, heads, queries, keys]: keep the last query's row
                self._rows[layer] = weights[0, :, -1, :].detach().clone()

        return keep

    def view(self, layer: int | None = None, head: int | None = None) -> AttentionView | None:
        """The newest forward pass's attention row for `layer` and `head` (None averages); None before any."""
        rows = dict(self._rows)  # the inference thread may replace entries meanwhile
        if not rows:
            return None
        if layer is not None:
            if layer not in rows:
                raise ValueError(f"layer must be in [0, {self.session.info.layers - 1}], got {layer}")
            rows = {layer: rows[layer]}
        width = min(row.shape[-1] for row in rows.values())  # rows of one forward pass share it
        stacked = torch.stack([row[:, :width].float() for row in rows.values()])  # [layers, heads, keys]
        per_head = stacked.mean(dim=0).tolist()
        if head is not None:
            if not 0 <= head < stacked.shape[1]:
                raise ValueError(f"head must be in [0, {stacked.shape[1] - 1}], got {head}")
            stacked = stacked[:, head : head + 1]
        weights = stacked.mean(dim=(0, 1)).tolist()
        ids = tuple(self.session.cache.ids[:width])
        spans = message_spans(self.session, ids)
        return AttentionView(
            layer=layer,
            head=head,
            query_position=width - 1,
            ids=ids,
            weights=tuple(weights),
            spans=tuple(SpanWeight(s, sum(weights[s.start : s.end])) for s in spans),
            head_weights=tuple(tuple(row) for row in per_head),
        )


# -- the view's calls: run them on the thread that owns the model (`engine.call`), or at the
# -- step gate (`engine.call_at_gate`), where that thread waits between two forward passes.
_PROBES: weakref.WeakKeyDictionary[ChatSession, AttentionProbe] = weakref.WeakKeyDictionary()
"""Each session's probe: the instrument's state, kept here so the session need not know of it."""


def probe_of(session: ChatSession) -> AttentionProbe:
    """The session's one probe, made when the view first opens."""
    if session not in _PROBES:
        _PROBES[session] = AttentionProbe(session)
    return _PROBES[session]


def existing_probe(session: ChatSession) -> AttentionProbe | None:
    """The session's probe if the view has opened, else None."""
    return _PROBES.get(session)


def enabled_view(session: ChatSession, layer: int | None, head: int | None) -> AttentionView | None:
    """Switch the probe on and read what it holds (at the gate: recorded from the next step on)."""
    probe = probe_of(session)
    probe.enable()
    return probe.view(layer, head)


def enable_and_view(session: ChatSession, layer: int | None, head: int | None) -> AttentionView | None:
    """Switch the probe on and read it; with nothing recorded yet, run the last pass again."""
    view = enabled_view(session, layer, head)
    if view is None and len(session.cache):
        rerun_last_pass(session)
        view = probe_of(session).view(layer, head)
    return view


def rerun_last_pass(session: ChatSession) -> None:
    """The forward pass that produced the last token, without touching the cache: the hooks record it."""
    with torch.inference_mode():
        inputs = torch.tensor([session.cache.ids], device=session.device)
        session.model(input_ids=inputs, use_cache=False, logits_to_keep=1)


def switch_off(session: ChatSession) -> None:
    """Back to the model's own attention and the session's fast path (nothing if the view never opened)."""
    probe = existing_probe(session)
    if probe is not None:
        probe.disable()
