"""transformers' view of the engine's KV cache (engine/kvcache.py), for the HF forward.

The HF forward (the readable reference, the attention view's eager path, bitsandbytes models)
stores and reads K/V through a `Cache` of cache layers. Each layer here hands those calls to
the engine's own layer, so both forwards share one set of tensors and the fast path never
imports transformers.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from engine.kvcache_layers import PreallocatedLayer


class BridgeLayer(DynamicLayer):
    """A transformers cache layer whose state is an engine layer's."""

    def __init__(self, layer: PreallocatedLayer):  # no super().__init__: it would assign the state
        self.layer = layer

    @property
    def is_initialized(self) -> bool:
        return self.layer.is_initialized

    @property
    def is_sliding(self) -> bool:
        """transformers builds a sliding layer's mask from the first layer that says so."""
        return self.layer.window is not None

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(keys the next forward attends over, the position of the first): a sliding window may
        have dropped the oldest (engine/kvcache_layers.py)."""
        return self.layer.held + query_length, self.layer.start

    @property
    def keys(self) -> torch.Tensor | None:
        return self.layer.keys

    @property
    def values(self) -> torch.Tensor | None:
        return self.layer.values

    @property
    def device(self) -> torch.device:
        return self.layer.device

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.layer.lazy_initialization(key_states, value_states)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.layer.update(key_states, value_states)

    def get_seq_length(self) -> int:
        return self.layer.get_seq_length()

    def crop(self, tokens_to_remove: int) -> None:
        self.layer.crop(tokens_to_remove)

    def reset(self) -> None:
        self.layer.reset()


def hf_cache(layers: list[PreallocatedLayer]) -> Cache:
    return Cache(layers=[BridgeLayer(layer) for layer in layers])
