"""How many tokens of context fit in a given memory, by the KV cache formula, at each cache precision.

    bytes per token = 2 (K,V) x layers x kv_heads x (head_dim x element bytes + scale bytes)
    tokens that fit = memory // bytes per token

For the loaded model the shape comes from its config; for the larger models from their published
configs (named below), by the same formula: computed, not measured. Pure arithmetic (no torch),
so the UI can show it without the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1}
SCALE_BYTES = {"fp32": 0, "bf16": 0, "fp16": 0, "int8": 4}
"""An int8 cache keeps one float32 scale per token, head and K/V (engine/kvcache.py)."""
GIB = 2**30


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    source: str
    """Where the numbers come from."""

    def bytes_per_token(self, precision: str) -> int:
        row = self.head_dim * ELEMENT_BYTES[precision] + SCALE_BYTES[precision]
        return 2 * self.layers * self.kv_heads * row

    def tokens_in(self, memory_bytes: int, precision: str) -> int:
        return memory_bytes // self.bytes_per_token(precision)


LLAMA_2_7B = Shape("Llama-2-7B", 32, 32, 128, "config: 32 layers, 32 kv heads (no GQA), head_dim 128")
LLAMA_2_70B = Shape("Llama-2-70B", 80, 8, 128, "config: 80 layers, 8 kv heads (GQA), head_dim 128")
OTHERS = (LLAMA_2_7B, LLAMA_2_70B)


def shape_of(info) -> Shape:
    """The loaded model's shape (a ModelInfo)."""
    return Shape(info.name, info.layers, info.kv_heads, info.head_dim, "the loaded model's config")
