"""A paged KV cache: one pool of fixed-size blocks, shared by every request, sized by a budget.

Each layer's keys (and values) live in one tensor [blocks, block_size, kv_heads, head_dim].
A request holds a block table: the list of its blocks in order, so its position p sits in
block table[p // block_size] at offset p % block_size. Blocks are handed out as a request
grows and all come back the moment it finishes (or is preempted), so memory follows the
tokens actually held rather than a reservation for the longest possible answer.

    bytes per block = 2 (K and V) x layers x kv_heads x head_dim x element bytes x block size
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BLOCK_SIZE = 16
"""Tokens per block (vLLM's default too)."""


class PoolError(ValueError):
    """The budget cannot hold what was asked of it (one line, for the user)."""


@dataclass(frozen=True)
class KVShape:
    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def element_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def block_bytes(self, block_size: int) -> int:
        """The formula: 2 x layers x kv_heads x head_dim x element bytes x block size."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.element_bytes * block_size

    def token_bytes(self) -> int:
        return self.block_bytes(1)


def blocks_for(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size)


class PagedKVPool:
    """The pool's tensors, its free list and every request's block table."""

    def __init__(self, shape: KVShape, budget_bytes: int, block_size: int = BLOCK_SIZE, device="cpu"):
        if block_size < 1:
            raise PoolError(f"block size must be at least 1 token, got {block_size}")
        self.shape = shape
        self.block_size = block_size
        self.num_blocks = budget_bytes // shape.block_bytes(block_size)
        if self.num_blocks < 1:
            raise PoolError(
                f"a budget of {budget_bytes / 2**20:.2f} MiB holds no block: "
                f"one block of {block_size} tokens takes {shape.block_bytes(block_size) / 2**20:.2f} MiB"
            )
        size = (self.num_blocks, block_size, shape.kv_heads, shape.head_dim)
        self.keys = [torch.zeros(size, dtype=shape.dtype, device=device) for _ in range(shape.layers)]
        self.values = [torch.zeros(size, dtype=shape.dtype, device=device) for _ in range(shape.layers)]
        self._free = list(range(self.num_blocks - 1, -1, -1))  # pop() hands out block 0 first
        self.tables: dict[int, list[int]] = {}
        """Request id -> its blocks, in position order."""
        self.peak_used = 0

    # -- sizes ----------------------------------------------------------------------
    @property
    def tensor_bytes(self) -> int:
        """Bytes of the pool's tensors, counted from the tensors themselves."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    @property
    def formula_bytes(self) -> int:
        return self.num_blocks * self.shape.block_bytes(self.block_size)

    @property
    def block_bytes(self) -> int:
        return self.shape.block_bytes(self.block_size)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    # -- block tables ------------------------------------------------------------------
    def can_hold(self, request: int, tokens: int) -> bool:
        """Whether `request` could grow to `tokens` positions with the blocks free now."""
        have = len(self.tables.get(request, ()))
        return blocks_for(tokens, self.block_size) - have <= len(self._free)

    def reserve(self, request: int, tokens: int) -> None:
        """Grow `request`'s table to cover `tokens` positions; PoolError if the pool runs out
        (nothing is taken then)."""
        table = self.tables.setdefault(request, [])
        more = blocks_for(tokens, self.block_size) - len(table)
        if more > len(self._free):
            raise PoolError(f"request {request} needs {more} more blocks, {len(self._free)} free")
        table.extend(self._free.pop() for _ in range(max(0, more)))
        self.peak_used = max(self.peak_used, self.used_blocks)

    def free(self, request: int) -> int:
        """Hand back every block of `request`; returns how many."""
        table = self.tables.pop(request, [])
        self._free.extend(reversed(table))
        return len(table)

    def free_all(self) -> None:
        for request in list(self.tables):
            self.free(request)

    def slots(self, request: int, start: int, stop: int) -> torch.Tensor:
        """Flat slot numbers (block x block_size + offset) of positions start..stop-1."""
        table = torch.tensor(self.tables[request], dtype=torch.long)
        positions = torch.arange(start, stop)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s keys and values as [blocks x block_size, kv_heads, head_dim] views."""
        k, v = self.keys[layer], self.values[layer]
        return k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])

    def release(self) -> None:
        """Drop the tensors (the lab stopped): the memory goes back."""
        self.tables.clear()
        self.keys, self.values, self._free = [], [], []
        self.num_blocks = 0
