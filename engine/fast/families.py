"""The model families the fast path runs (engine/fast/fused.py), each described by how its layer
differs from Llama's, so the fused forward, the compiled step and the lab read one record instead
of branching on model names. Adding a family is one entry here plus its logits test against
transformers (tests/test_families.py).

What a checkpoint shows by itself is not declared: projection biases (Qwen2's q/k/v; Llama's
`attention_bias` and `mlp_bias`) are read from the modules, RoPE's frequencies and scaling
(Llama 3's included) from the model's own rotary embedding.
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
    """An RMSNorm over each head's q and k (weight [head_dim]) before RoPE (Qwen3)."""


FAMILIES = (
    Family("Llama", ("llama",)),
    Family("Mistral", ("mistral",)),
    Family("Qwen2", ("qwen2",)),
    Family("Qwen3", ("qwen3",), qk_norm=True),
)


def family_of(config: Any) -> Family | None:
    """The family of a transformers config, or None where the fast path has none for it."""
    model_type = getattr(config, "model_type", None)
    return next((f for f in FAMILIES if model_type in f.model_types), None)


def covered() -> str:
    """'Llama, Mistral, Qwen2, Qwen3': what the fast path runs, for the line that says it does not."""
    return ", ".join(f.name for f in FAMILIES)


def sliding_layers(config: Any) -> bool:
    """Whether any layer attends over a sliding window (not on the fast path yet)."""
    types = getattr(config, "layer_types", None) or ()
    return any(t == "sliding_attention" for t in types) or bool(
        getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    )
