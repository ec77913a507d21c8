"""One layer of the KV cache as tensors: a pre-allocated buffer that grows by doubling, at a
float precision (`PreallocatedLayer`) or int8 with one float32 scale per token and head
(`QuantizedLayer`). engine/kvcache.py holds a conversation's layers and its token ids;
engine/kvcache_hf.py shows the same layers to the Hugging Face forward.

A layer that attends over a sliding window (Gemma 3's local layers, Mistral's) keeps only the
positions a later token can still see: once it holds DROP_EVERY more than its window (and
CROP_ROOM), `settle` drops the oldest. Its buffer's slot 0 then holds position `start`, so
whoever reads it by position (the fast path's masks and decode kernel, the compiled step, the
HF forward's mask) subtracts `start`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine.kv_windows import CROP_ROOM, DROP_EVERY

CACHE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8}
SCALE_DTYPE = torch.float32
"""An int8 cache's scales: one per token, head and K/V (4 bytes each)."""
INT8_MAX = 127


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

    def dequantized(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values widened to `dtype` (a copy of every position)."""
        keys = dequantize(self.keys, self.key_scales, dtype)
        return keys, dequantize(self.values, self.value_scales, dtype)


class PreallocatedLayer:
    """One layer's K and V: views into a buffer with room to grow. It keeps transformers' cache-layer
    protocol (`update`, `get_seq_length`, `crop`), which the HF forward reaches through
    engine/kvcache_hf.py, so this module, and a start that never runs the HF forward, need no
    transformers (~1.3 s of imports)."""

    initial_capacity = 256

    def __init__(self, storage_dtype: torch.dtype | None = None, window: int | None = None):
        self.storage_dtype = storage_dtype
        """None stores whatever dtype arrives first."""
        self.window = window
        """The sliding window this layer attends over (a query sees the last `window` positions,
        itself included), or None: the whole context, every position kept."""
        self.is_initialized = False
        self.length = 0
        """Positions fed through this layer (the next one's position)."""
        self.start = 0
        """The first position still held (slot 0 of the buffers): 0 unless a sliding window dropped some."""

    @property
    def held(self) -> int:
        """Positions held in the buffers: `length` less those a sliding window dropped."""
        return self.length - self.start

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.length = self.start = 0
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
        return self._k[:, :, : self.held] if self.is_initialized else None

    @property
    def values(self) -> torch.Tensor | None:
        return self._v[:, :, : self.held] if self.is_initialized else None

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
            new[:, :, : self.held] = old[:, :, : self.held]
            setattr(self, name, new)

    def settle(self) -> None:
        """After a forward: a sliding-window layer holding DROP_EVERY positions more than its window
        and CROP_ROOM drops the oldest, keeping those (the window's last window - 1 for the next
        token, and CROP_ROOM before them)."""
        if self.window is None or not self.is_initialized:
            return
        keep = self.window - 1 + CROP_ROOM
        drop = self.held - keep
        if drop < DROP_EVERY:
            return
        for name in self._buffers:
            buffer = getattr(self, name)
            buffer[:, :, :keep] = buffer[:, :, drop : drop + keep].clone()  # the two ranges may overlap
            buffer[:, :, keep : keep + drop] = 0  # zeroed, as unused slots are (lazy_initialization)
        self.start += drop

    def lowest_crop(self, keep: int) -> int:
        """`keep` if this layer can be cropped to it and still serve the next position, else 0:
        a sliding window that dropped positions the next token would see must start over."""
        if self.start == 0 or keep >= self.start + self.window - 1:
            return keep
        return 0

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
        new, held = key_states.shape[2], self.held
        self._reserve(held + new)
        self._k[:, :, held : held + new] = key_states
        self._v[:, :, held : held + new] = value_states
        self.length += new
        return self.keys, self.values

    def buffers_with_room(self, extra: int) -> tuple[torch.Tensor, ...]:
        """The whole K and V buffers (an int8 layer's scales after them), grown to hold `extra`
        more positions (for a compiled step that writes in place); `advance` then counts what it
        wrote. Called per layer at every compiled token: written out, not looked up by name."""
        self._reserve(self.held + extra)
        return self._k, self._v

    def advance(self, written: int) -> None:
        self.length += written

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if not self.is_initialized or tokens_to_remove == 0:
            return
        keep = max(0, self.length - abs(tokens_to_remove))
        if self.lowest_crop(keep) != keep:
            raise ValueError(
                f"cannot crop a {self.window}-position sliding window to {keep}: it dropped positions "
                f"before {self.start}"
            )
        self.length = keep
        if keep == 0:
            self.start = 0

    def reset(self) -> None:
        self.is_initialized = False
        self.length = self.start = 0

    def used_bytes(self) -> int:
        """Bytes of K and V (and their scales) for the tokens held (what the formula predicts)."""
        if not self.is_initialized:
            return 0
        if not self._position_bytes:  # from the buffers' shapes, once: the panel asks every token
            for name in self._buffers:
                buffer = getattr(self, name)
                self._position_bytes += buffer.numel() // buffer.shape[2] * buffer.element_size()
        return self.held * self._position_bytes

    def reserved_bytes(self) -> int:
        """Bytes allocated, including room for tokens not yet generated."""
        if not self.is_initialized:
            return 0
        return sum(getattr(self, name).numel() * getattr(self, name).element_size() for name in self._buffers)

    def dequantized(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the positions held, in `dtype` (a copy unless already stored so)."""
        return self.keys.to(dtype), self.values.to(dtype)

    def load_positions(
        self, keys: torch.Tensor, values: torch.Tensor, *scales: torch.Tensor, start: int = 0
    ) -> None:
        """Fill from saved tensors as stored (engine/saved/cache_file.py), the first of them
        being position `start` (a sliding window's, where it had dropped the ones before)."""
        self._store(keys, values, *scales)
        self.start, self.length = start, start + keys.shape[2]

    def _store(self, keys: torch.Tensor, values: torch.Tensor, *scales: torch.Tensor) -> None:
        self.append(keys, values)


class QuantizedLayer(PreallocatedLayer):
    """An int8 cache layer: each new K/V row (one token, one head) is stored as int8 values and
    one float32 scale. The fast path's decode attention reads it as stored (`append` returns a
    QuantizedKV); the Hugging Face forward gets a dequantized copy (`update`, the reference)."""

    _buffers = ("_k", "_v", "_ks", "_vs")

    def __init__(self, window: int | None = None):
        super().__init__(torch.int8, window)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._ks = self._k.new_zeros(self._k.shape[:3], dtype=SCALE_DTYPE)
        self._vs = self._k.new_zeros(self._k.shape[:3], dtype=SCALE_DTYPE)

    @property
    def key_scales(self) -> torch.Tensor:
        return self._ks[:, :, : self.held]

    @property
    def value_scales(self) -> torch.Tensor:
        return self._vs[:, :, : self.held]

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
        new, held = k.shape[2], self.held
        self._reserve(held + new)
        end = held + new
        self._k[:, :, held:end], self._v[:, :, held:end] = k, v
        self._ks[:, :, held:end], self._vs[:, :, held:end] = k_scale, v_scale
        self.length += new

    def quantized(self) -> QuantizedKV:
        return QuantizedKV(self.keys, self.key_scales, self.values, self.value_scales)

    def buffers_with_room(self, extra: int) -> tuple[torch.Tensor, ...]:
        self._reserve(self.held + extra)
        return self._k, self._v, self._ks, self._vs

    def dequantized(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.quantized().dequantized(dtype)


def make_layer(precision: str, window: int | None = None) -> PreallocatedLayer:
    """An empty cache layer of one of CACHE_PRECISIONS, attending over `window` positions (None: all)."""
    if precision == "int8":
        return QuantizedLayer(window)
    return PreallocatedLayer(CACHE_DTYPES[precision], window)
