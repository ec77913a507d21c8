"""How many tokens of context fit in a given memory, by the KV cache formula, at each cache precision.

    bytes per token = 2 (K,V) x layers x kv_heads x (head_dim x element bytes + scale bytes)
    tokens that fit = memory // bytes per token

A layer with a sliding window (Gemma 3's local layers, Mistral's) holds at most its window
however long the context: only the other layers grow with it, so more tokens fit, and where
every layer has a window any length does.

For the loaded model the shape comes from its config; for the larger models from their published
configs (named below), by the same formula: computed, not measured. Pure arithmetic (no torch),
so the UI can show it without the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv_windows import kv_read_bytes

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
    windows: tuple[int | None, ...] = ()
    """Each layer's sliding window (None: the whole context); () where no layer has one."""

    def bytes_per_token(self, precision: str) -> int:
        """One position in every layer."""
        row = self.head_dim * ELEMENT_BYTES[precision] + SCALE_BYTES[precision]
        return 2 * self.layers * self.kv_heads * row

    @property
    def windowed_layers(self) -> int:
        return sum(1 for w in self.windows if w)

    def growing_bytes_per_token(self, precision: str) -> int:
        """What each token adds once past every window: the layers without one."""
        return self.bytes_per_token(precision) // self.layers * (self.layers - self.windowed_layers)

    def bytes_at(self, tokens: int, precision: str) -> int:
        """The cache at `tokens` positions, a windowed layer holding at most its window."""
        return kv_read_bytes(self.bytes_per_token(precision), self.layers, self.windows, tokens)

    def tokens_in(self, memory_bytes: int, precision: str) -> int | None:
        """The most tokens whose cache fits in `memory_bytes`; None: any number (every layer windowed)."""
        if not self.windowed_layers:
            return memory_bytes // self.bytes_per_token(precision)
        widest = max(w or 0 for w in self.windows)
        if self.bytes_at(widest, precision) <= memory_bytes:
            growing = self.growing_bytes_per_token(precision)
            if not growing:
                return None
            # Past every window only the whole-context layers grow: linear, solved.
            capped = self.bytes_at(widest, precision) - growing * widest
            return (memory_bytes - capped) // growing
        low, high = 0, widest  # full within the windows: the largest count that fits
        while low < high:
            middle = (low + high + 1) // 2
            fits = self.bytes_at(middle, precision) <= memory_bytes
            low, high = (middle, high) if fits else (low, middle - 1)
        return low


LLAMA_2_7B = Shape("Llama-2-7B", 32, 32, 128, "config: 32 layers, 32 kv heads (no GQA), head_dim 128")
LLAMA_2_70B = Shape("Llama-2-70B", 80, 8, 128, "config: 80 layers, 8 kv heads (GQA), head_dim 128")
OTHERS = (LLAMA_2_7B, LLAMA_2_70B)


def shape_of(info) -> Shape:
    """The loaded model's shape (a ModelInfo)."""
    return Shape(
        info.name, info.layers, info.kv_heads, info.head_dim, "the loaded model's config", info.layer_windows
    )
