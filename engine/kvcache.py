"""The persistent KV cache: its tensors, the token ids actually in it, reuse and byte counts.

Each layer writes into a pre-allocated buffer that grows by doubling, so a decode step
stores one position instead of copying the whole cache, and cropping for prefix reuse is a
length change. The token list always holds exactly the ids that were fed to the model.

The cache may keep another dtype than the model computes in (fp32 for a 16-bit model on a CPU
without 16-bit arithmetic, engine/quant/precision.py): the fast path reads it as stored (`append`),
the Hugging Face forward gets it in its own dtype (`update`).

The cache precision is a setting (`--kv-cache`): fp32, bf16, fp16, or int8 with one float32
scale per token and head (`QuantizedLayer`). Per token the cache then holds

    2 (K,V) x layers x kv_heads x (head_dim x element bytes + scale bytes)

and `tensor_bytes` sums exactly that from the real tensors. A layer that attends over a sliding
window (Gemma 3's local layers) holds only its window's last positions and a little room
(engine/kvcache_layers.py), so there the sum is over the positions each layer holds.
"""

from __future__ import annotations

import dataclasses

import torch

from engine.kvcache_layers import (
    CACHE_DTYPES,
    SCALE_DTYPE,
    PreallocatedLayer,
    make_layer,
)

CACHE_PRECISIONS = ("fp32", "bf16", "fp16", "int8")
"""The cache precisions `--kv-cache` offers."""


def cache_precision_of(dtype_name: str) -> str:
    """'float32' -> 'fp32' (a ModelInfo's cache_dtype as a --kv-cache name)."""
    for name, dtype in CACHE_DTYPES.items():
        if str(dtype).removeprefix("torch.") == dtype_name:
            return name
    return dtype_name


def scale_bytes(precision: str) -> int:
    """Bytes of scale stored per token, head and K/V: 4 for int8, 0 for a float cache."""
    return SCALE_DTYPE.itemsize if precision == "int8" else 0


def cache_precision_problem(precision: str, device: str) -> str | None:
    """None if `device` can hold and attend over a cache of this precision, else why not."""
    if precision not in CACHE_PRECISIONS:
        return f"unknown KV cache precision {precision!r}; choose one of {', '.join(CACHE_PRECISIONS)}"
    try:  # store one token and read it back as attention would
        layer = make_layer(precision)
        probe = torch.ones(1, 1, 1, 8, device=device)
        layer.append(probe, probe)
        layer.update(probe, probe)
    except (RuntimeError, TypeError) as e:
        return f"a {precision} KV cache does not work on {device}: {str(e).splitlines()[0][:120]}"
    return None


def with_cache_precision(info, precision: str):
    """`info` (a ModelInfo) describing a cache of `precision`: its element and scale sizes, and the
    dtype the model's precision chose by default (kept, so the default can be told apart)."""
    return dataclasses.replace(
        info,
        cache_dtype=str(CACHE_DTYPES[precision]).removeprefix("torch."),
        cache_element_bytes=CACHE_DTYPES[precision].itemsize,
        cache_scale_bytes=scale_bytes(precision),
        default_cache_dtype=info.default_cache_dtype or info.cache_dtype,
    )


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class KVCache:
    """One conversation's cache, with the ids it holds."""

    def __init__(
        self,
        num_layers: int,
        dtype: torch.dtype | None = None,
        precision: str | None = None,
        windows: tuple[int | None, ...] = (),
    ):
        self.num_layers = num_layers
        self.ids: list[int] = []
        self.precision = precision or (cache_precision_of(str(dtype).removeprefix("torch.")) if dtype else "")
        """One of CACHE_PRECISIONS ('' when the first tensor stored decides)."""
        self.windows = windows or (None,) * num_layers
        """Each layer's sliding window (None: the whole context): such a layer keeps only what a
        later token can still see (engine/kvcache_layers.py)."""
        if precision is not None:
            layers = [make_layer(precision, window) for window in self.windows]
        else:
            layers = [PreallocatedLayer(dtype, window) for window in self.windows]
        self.layers: list[PreallocatedLayer] = layers
        self._hf = None

    @property
    def hf(self):
        """The same layers as a transformers `Cache`, for the HF forward (made on first use)."""
        if self._hf is None:
            from engine.kvcache_hf import hf_cache

            self._hf = hf_cache(self.layers)
        return self._hf

    @classmethod
    def for_model(cls, info) -> "KVCache":
        """An empty cache shaped and typed for a loaded model (its ModelInfo: `cache_dtype` is the
        precision the session chose, 'int8' for a quantized cache)."""
        return cls(info.layers, precision=cache_precision_of(info.cache_dtype), windows=info.layer_windows)

    @property
    def quantized(self) -> bool:
        return self.precision == "int8"

    def converted(self, precision: str) -> "KVCache":
        """A copy of this cache at another precision, holding the same positions (the bench fills one
        cache and times each precision on it: the time of a step does not depend on the values)."""
        other = KVCache(self.num_layers, precision=precision, windows=self.windows)
        for source, target in zip(self.layers, other.layers):
            if source.get_seq_length():
                keys, values = source.dequantized(torch.float32)
                target.append(keys, values)
                target.start, target.length = source.start, source.length
        other.ids = list(self.ids)
        return other

    def __len__(self) -> int:
        return len(self.ids)

    def reuse(self, ids: list[int]) -> int:
        """Keep the longest common prefix with `ids`, leaving at least one token to feed; crop the
        rest (all of it where a sliding window no longer holds what the prefix's next token sees)."""
        keep = self.keepable(min(common_prefix(self.ids, ids), len(ids) - 1))
        self.crop(keep)
        return keep

    def keepable(self, keep: int) -> int:
        """`keep` if the cache can be cropped to it, else 0: a sliding-window layer that dropped
        positions the next token would see cannot (llama.cpp's server re-prefills there too)."""
        return min(layer.lowest_crop(keep) for layer in self.layers) if self.layers else keep

    def crop(self, keep: int) -> None:
        """Keep only the first `keep` positions (`keepable`: a sliding window may forbid it)."""
        drop = len(self.ids) - keep
        if drop > 0:
            for layer in self.layers:
                layer.crop(-drop)
            del self.ids[keep:]

    def clear(self) -> None:
        self.crop(0)

    def appended(self, ids: list[int]) -> None:
        """Record ids that were just fed through the model with this cache; sliding-window layers
        drop what no later token can see."""
        self.ids.extend(ids)
        for layer in self.layers:
            layer.settle()

    def positions_held(self) -> tuple[int, ...]:
        """Each layer's positions in its tensors: all of them, or a sliding window's last ones."""
        return tuple(layer.held if layer.is_initialized else 0 for layer in self.layers)

    def tensor_bytes(self) -> int:
        """Bytes of the K and V tensors for the tokens held, summed from the real tensors."""
        return sum(layer.used_bytes() for layer in self.layers)

    def reserved_bytes(self) -> int:
        return sum(layer.reserved_bytes() for layer in self.layers)
