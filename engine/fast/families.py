"""The model families the fast path runs (engine/fast/fused.py), each described by how its layer
differs from Llama's, so the fused forward, the compiled step and the lab read one record instead
of branching on model names. Adding a family is one entry here plus its logits test against
transformers (tests/test_families.py).

What a checkpoint or its config shows by itself is not declared: projection biases (Qwen2's
q/k/v; Llama's `attention_bias` and `mlp_bias`) are read from the modules; the activation, the
attention's scale, the final logits' soft-cap and which layers attend over a sliding window from
the config (`LayerFacts`); RoPE's frequencies and scaling (Llama 3's, Gemma 3's local base)
from the model's own rotary embedding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    """transformers' `config.model_type` values of this family."""
    qk_norm: bool = False
    """An RMSNorm over each head's q and k (weight [head_dim]) before RoPE (Qwen3, Gemma 3)."""
    qkv: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
    """The attention's input projections in the checkpoint, fused in this order (Phi-3 ships them fused)."""
    gate_up: tuple[str, ...] = ("gate_proj", "up_proj")
    """The MLP's gate and up projections, likewise."""
    norm_offset: float = 0.0
    """RMSNorm scales by (offset + w): Gemma stores w around 0 and scales by (1 + w)."""
    pre_mlp_norm: str = "post_attention_layernorm"
    """The norm before the MLP (Llama names it after attention)."""
    post_norms: tuple[str, str] | None = None
    """Norms of the attention's and the MLP's outputs before each joins the residual (Gemma 3's
    "sandwich")."""
    scaled_embedding: bool = False
    """Embeddings multiplied by sqrt(hidden size), rounded to the weights' dtype (Gemma)."""


FAMILIES = (
    Family("Llama", ("llama",)),
    Family("Mistral", ("mistral",)),
    Family("Qwen2", ("qwen2",)),
    Family("Qwen3", ("qwen3",), qk_norm=True),
    Family(
        "Gemma 3",
        ("gemma3_text",),
        qk_norm=True,
        norm_offset=1.0,
        pre_mlp_norm="pre_feedforward_layernorm",
        post_norms=("post_attention_layernorm", "post_feedforward_layernorm"),
        scaled_embedding=True,
    ),
    Family("Phi-3", ("phi3",), qkv=("qkv_proj",), gate_up=("gate_up_proj",)),
)


def family_of(config: Any) -> Family | None:
    """The family of a transformers config, or None where the fast path has none for it."""
    model_type = getattr(config, "model_type", None)
    return next((f for f in FAMILIES if model_type in f.model_types), None)


def covered() -> str:
    """'Llama, Mistral, Qwen2, ...': what the fast path runs, for the line that says it does not."""
    return ", ".join(f.name for f in FAMILIES)


@dataclass(frozen=True)
class LayerFacts:
    """What the fast path reads from a config beside the family's record."""

    activation: str
    windows: tuple[int | None, ...]
    """Each layer's sliding window (a query sees the last `window` positions, itself included),
    None where it attends over the whole context."""
    layer_types: tuple[str, ...]
    """Each layer's kind as transformers names it ("full_attention", "sliding_attention"): a
    family with a RoPE base per kind (Gemma 3) rotates by its layer's."""
    query_scale: float | None
    """The attention's scale where the config sets one apart from 1/sqrt(head_dim) (Gemma's
    `query_pre_attn_scalar`)."""
    logit_softcap: float | None
    """Final logits become tanh(x / c) * c (Gemma 2's; None in Gemma 3)."""


def layer_facts(config: Any) -> LayerFacts:
    layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    types = tuple(getattr(config, "layer_types", None) or ())
    if types:
        windows = tuple(window if t == "sliding_attention" else None for t in types)
    else:  # Mistral, Phi-3: one window (or none) for every layer
        windows = (window,) * layers
        types = ("sliding_attention" if window else "full_attention",) * layers
    scalar = getattr(config, "query_pre_attn_scalar", None)
    return LayerFacts(
        activation=getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu"),
        windows=windows,
        layer_types=types,
        query_scale=scalar**-0.5 if scalar else None,
        logit_softcap=getattr(config, "final_logit_softcapping", None),
    )
