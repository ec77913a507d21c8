"""The persistent KV cache: its tensors, the token ids actually in it, reuse and byte counts.

Each layer writes into a pre-allocated buffer that grows by doubling, so a decode step
stores one position instead of copying the whole cache, and cropping for prefix reuse is a
length change. The token list always holds exactly the ids that were fed to the model.

The cache may keep another dtype than the model computes in (fp32 for a 16-bit model on a CPU
without 16-bit arithmetic, engine/quant/precision.py): the fast path reads it as stored (`append`),
the Hugging Face forward gets it in its own dtype (`update`).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


class PreallocatedLayer(DynamicLayer):
    """A DynamicLayer whose keys/values are views into a buffer with room to grow."""

    initial_capacity = 256

    def __init__(self, storage_dtype: torch.dtype | None = None):
        super().__init__()
        self.storage_dtype = storage_dtype
        """None stores whatever dtype arrives first."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.length = 0
        dtype = self.storage_dtype or key_states.dtype
        # Zeroed, not empty: the compiled step attends over the whole buffer with the unused
        # slots masked, and a masked slot still multiplies its value by 0 (garbage NaN * 0 = NaN).
        self._k = key_states.new_zeros(self._shape(key_states, self.initial_capacity), dtype=dtype)
        self._v = value_states.new_zeros(self._shape(value_states, self.initial_capacity), dtype=dtype)
        self._expose()
        self.is_initialized = True

    @staticmethod
    def _shape(states: torch.Tensor, capacity: int) -> tuple[int, ...]:
        batch, heads, _, dim = states.shape
        return (batch, heads, capacity, dim)

    def _expose(self) -> None:
        self.keys = self._k[:, :, : self.length]
        self.values = self._v[:, :, : self.length]

    def _reserve(self, needed: int) -> None:
        capacity = self._k.shape[2]
        if needed <= capacity:
            return
        while capacity < needed:
            capacity *= 2
        for name in ("_k", "_v"):
            old = getattr(self, name)
            new = old.new_zeros(self._shape(old, capacity))
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
        self._expose()
        return self.keys, self.values

    def buffers_with_room(self, extra: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole K and V buffers, grown to hold `extra` more positions (for a compiled step
        that writes in place); `advance` then counts what it wrote."""
        self._reserve(self.length + extra)
        return self._k, self._v

    def advance(self, written: int) -> None:
        self.length += written
        self._expose()

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if not self.is_initialized or tokens_to_remove == 0:
            return
        self.length = max(0, self.length - abs(tokens_to_remove))
        self._expose()

    def reset(self) -> None:
        self.is_initialized = False
        self.keys = self.values = None
        self.length = 0

    def used_bytes(self) -> int:
        """Bytes of K and V for the tokens held (what the formula predicts)."""
        if not self.is_initialized:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def reserved_bytes(self) -> int:
        """Bytes allocated, including room for tokens not yet generated."""
        if not self.is_initialized:
            return 0
        return self._k.numel() * self._k.element_size() + self._v.numel() * self._v.element_size()


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class KVCache:
    """One conversation's cache, with the ids it holds."""

    def __init__(self, num_layers: int, dtype: torch.dtype | None = None):
        self.num_layers = num_layers
        self.ids: list[int] = []
        self.hf = Cache(layers=[PreallocatedLayer(dtype) for _ in range(num_layers)])

    @classmethod
    def for_model(cls, info) -> "KVCache":
        """An empty cache shaped and typed for a loaded model (its ModelInfo)."""
        return cls(info.layers, getattr(torch, info.cache_dtype))

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
            for layer in self.hf.layers:
                layer.crop(-drop)
            del self.ids[keep:]

    def clear(self) -> None:
        self.crop(0)

    def appended(self, ids: list[int]) -> None:
        """Record ids that were just fed through the model with this cache."""
        self.ids.extend(ids)

    def tensor_bytes(self) -> int:
        """Bytes of the K and V tensors for the tokens held, summed from the real tensors."""
        return sum(layer.used_bytes() for layer in self.hf.layers)

    def reserved_bytes(self) -> int:
        return sum(layer.reserved_bytes() for layer in self.hf.layers)
