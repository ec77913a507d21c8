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

and `tensor_bytes` sums exactly that from the real tensors.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

CACHE_PRECISIONS = ("fp32", "bf16", "fp16", "int8")
"""The cache precisions `--kv-cache` offers."""
CACHE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8}
SCALE_DTYPE = torch.float32
"""An int8 cache's scales: one per token, head and K/V (4 bytes each)."""
INT8_MAX = 127


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


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] -> int8 values and one float32 scale per row (absmax / 127, symmetric)."""
    x = x.float()
    scale = x.abs().amax(dim=-1) / INT8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row stays zero
    return torch.round(x / scale[..., None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def dequantize(
    values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    return (values.to(dtype) * scales[..., None].to(dtype)).to(dtype)


class QuantizedKV(NamedTuple):
    """A view of an int8 cache layer's positions: values [1, heads, n, d], scales [1, heads, n]."""

    keys: torch.Tensor
    key_scales: torch.Tensor
    values: torch.Tensor
    value_scales: torch.Tensor


class PreallocatedLayer:
    """One layer's K and V: views into a buffer with room to grow. It keeps transformers' cache-layer
    protocol (`update`, `get_seq_length`, `crop`), which the HF forward reaches through
    engine/kvcache_hf.py, so this module, and a start that never runs the HF forward, need no
    transformers (~1.3 s of imports)."""

    initial_capacity = 256

    def __init__(self, storage_dtype: torch.dtype | None = None):
        self.storage_dtype = storage_dtype
        """None stores whatever dtype arrives first."""
        self.is_initialized = False
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.length = 0
        dtype = self.storage_dtype or key_states.dtype
        # Zeroed, not empty: the compiled step attends over the whole buffer with the unused
        # slots masked, and a masked slot still multiplies its value by 0 (garbage NaN * 0 = NaN).
        self._k = key_states.new_zeros(self._shape(key_states, self.initial_capacity), dtype=dtype)
        self._v = value_states.new_zeros(self._shape(value_states, self.initial_capacity), dtype=dtype)
        self._position_bytes = 0  # worked out from the buffers on first use (a subclass adds some)
        self.is_initialized = True

    @staticmethod
    def _shape(states: torch.Tensor, capacity: int) -> tuple[int, ...]:
        batch, heads, _, dim = states.shape
        return (batch, heads, capacity, dim)

    # K and V of the positions held: views of the buffers, made when read. The compiled step
    # advances every layer each token, and making them there was ~0.1 ms a token.
    @property
    def keys(self) -> torch.Tensor | None:
        return self._k[:, :, : self.length] if self.is_initialized else None

    @property
    def values(self) -> torch.Tensor | None:
        return self._v[:, :, : self.length] if self.is_initialized else None

    _buffers = ("_k", "_v")
    """The tensors that grow with the positions (dim 2)."""

    def _reserve(self, needed: int) -> None:
        capacity = self._k.shape[2]
        if needed <= capacity:
            return
        while capacity < needed:
            capacity *= 2
        for name in self._buffers:
            old = getattr(self, name)
            new = old.new_zeros((*old.shape[:2], capacity, *old.shape[3:]))
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """The HF protocol: store, and return the whole cache in the caller's dtype."""
        keys, values = self.append(key_states, value_states)
        if keys.dtype != key_states.dtype:  # a copy, on the reference path only
            return keys.to(key_states.dtype), values.to(value_states.dtype)
        return keys, values

    def append(
        self, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new positions (converted to the storage dtype); views of the whole cache as stored."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new = key_states.shape[2]
        self._reserve(self.length + new)
        self._k[:, :, self.length : self.length + new] = key_states
        self._v[:, :, self.length : self.length + new] = value_states
        self.length += new
        return self.keys, self.values

    def buffers_with_room(self, extra: int) -> tuple[torch.Tensor, ...]:
        """The whole K and V buffers (an int8 layer's scales after them), grown to hold `extra`
        more positions (for a compiled step that writes in place); `advance` then counts what it
        wrote. Called per layer at every compiled token: written out, not looked up by name."""
        self._reserve(self.length + extra)
        return self._k, self._v

    def advance(self, written: int) -> None:
        self.length += written

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if not self.is_initialized or tokens_to_remove == 0:
            return
        self.length = max(0, self.length - abs(tokens_to_remove))

    def reset(self) -> None:
        self.is_initialized = False
        self.length = 0

    def used_bytes(self) -> int:
        """Bytes of K and V (and their scales) for the tokens held (what the formula predicts)."""
        if not self.is_initialized:
            return 0
        if not self._position_bytes:  # from the buffers' shapes, once: the panel asks every token
            for name in self._buffers:
                buffer = getattr(self, name)
                self._position_bytes += buffer.numel() // buffer.shape[2] * buffer.element_size()
        return self.length * self._position_bytes

    def reserved_bytes(self) -> int:
        """Bytes allocated, including room for tokens not yet generated."""
        if not self.is_initialized:
            return 0
        return sum(getattr(self, name).numel() * getattr(self, name).element_size() for name in self._buffers)

    def dequantized(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the positions held, in `dtype` (a copy unless already stored so)."""
        return self.keys.to(dtype), self.values.to(dtype)

    def load_positions(self, keys: torch.Tensor, values: torch.Tensor, *scales: torch.Tensor) -> None:
        """Fill from saved tensors as stored (engine/saved/cache_file.py)."""
        self.append(keys, values)


class QuantizedLayer(PreallocatedLayer):
    """An int8 cache layer: each new K/V row (one token, one head) is stored as int8 values and
    one float32 scale. The fast path's decode attention reads it as stored (`append` returns a
    QuantizedKV); the Hugging Face forward gets a dequantized copy (`update`, the reference)."""

    _buffers = ("_k", "_v", "_ks", "_vs")

    def __init__(self):
        super().__init__(torch.int8)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._ks = self._k.new_zeros(self._k.shape[:3], dtype=SCALE_DTYPE)
        self._vs = self._k.new_zeros(self._k.shape[:3], dtype=SCALE_DTYPE)

    @property
    def key_scales(self) -> torch.Tensor:
        return self._ks[:, :, : self.length]

    @property
    def value_scales(self) -> torch.Tensor:
        return self._vs[:, :, : self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """The HF protocol: store (quantized), return the whole cache dequantized (a full copy)."""
        self.append(key_states, value_states)
        return self.dequantized(key_states.dtype)

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> QuantizedKV:  # type: ignore[override]
        """Quantize and store new positions; a QuantizedKV view of the whole cache as stored."""
        k, k_scale = quantize(key_states)
        v, v_scale = quantize(value_states)
        self._store(k, v, k_scale, v_scale)
        return self.quantized()

    def _store(self, k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        if not self.is_initialized:
            self.lazy_initialization(k, v)
        new = k.shape[2]
        self._reserve(self.length + new)
        end = self.length + new
        self._k[:, :, self.length : end], self._v[:, :, self.length : end] = k, v
        self._ks[:, :, self.length : end], self._vs[:, :, self.length : end] = k_scale, v_scale
        self.length = end

    def quantized(self) -> QuantizedKV:
        return QuantizedKV(self.keys, self.key_scales, self.values, self.value_scales)

    def buffers_with_room(self, extra: int) -> tuple[torch.Tensor, ...]:
        self._reserve(self.length + extra)
        return self._k, self._v, self._ks, self._vs

    def dequantized(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return dequantize(self.keys, self.key_scales, dtype), dequantize(
            self.values, self.value_scales, dtype
        )

    def load_positions(self, keys: torch.Tensor, values: torch.Tensor, *scales: torch.Tensor) -> None:
        self._store(keys, values, *scales)


def make_layer(precision: str) -> PreallocatedLayer:
    """An empty cache layer of one of CACHE_PRECISIONS."""
    return QuantizedLayer() if precision == "int8" else PreallocatedLayer(CACHE_DTYPES[precision])


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class KVCache:
    """One conversation's cache, with the ids it holds."""

    def __init__(self, num_layers: int, dtype: torch.dtype | None = None, precision: str | None = None):
        self.num_layers = num_layers
        self.ids: list[int] = []
        self.precision = precision or (cache_precision_of(str(dtype).removeprefix("torch.")) if dtype else "")
        """One of CACHE_PRECISIONS ('' when the first tensor stored decides)."""
        if precision is not None:
            layers = [make_layer(precision) for _ in range(num_layers)]
        else:
            layers = [PreallocatedLayer(dtype) for _ in range(num_layers)]
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
        return cls(info.layers, precision=cache_precision_of(info.cache_dtype))

    @property
    def quantized(self) -> bool:
        return self.precision == "int8"

    def converted(self, precision: str) -> "KVCache":
        """A copy of this cache at another precision, holding the same positions (the bench fills one
        cache and times each precision on it: the time of a step does not depend on the values)."""
        other = KVCache(self.num_layers, precision=precision)
        for source, target in zip(self.layers, other.layers):
            if source.get_seq_length():
                keys, values = source.dequantized(torch.float32)
                target.append(keys, values)
        other.ids = list(self.ids)
        return other

    def __len__(self) -> int:
        return len(self.ids)

    def reuse(self, ids: list[int]) -> int:
        """Keep the longest common prefix with `ids`, leaving at least one token to feed; crop the rest."""
        keep = min(common_prefix(self.ids, ids), len(ids) - 1)
        self.crop(keep)
        return keep

    def crop(self, keep: int) -> None:
        """Keep only the first `keep` positions."""
        drop = len(self.ids) - keep
        if drop > 0:
            for layer in self.layers:
                layer.crop(-drop)
            del self.ids[keep:]

    def clear(self) -> None:
        self.crop(0)

    def appended(self, ids: list[int]) -> None:
        """Record ids that were just fed through the model with this cache."""
        self.ids.extend(ids)

    def tensor_bytes(self) -> int:
        """Bytes of the K and V tensors for the tokens held, summed from the real tensors."""
        return sum(layer.used_bytes() for layer in self.layers)

    def reserved_bytes(self) -> int:
        return sum(layer.reserved_bytes() for layer in self.layers)
