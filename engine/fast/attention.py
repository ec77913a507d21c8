"""One new token's attention over the KV cache, by a small C++ kernel built in the background.

At long contexts a decode step's attention reads the whole cache. torch's CPU attention (SDPA;
also written as matmuls, compiled, or as FlexAttention) reads it at well under half the speed
of a plain sum over the same bytes. `decode_attention.cpp` reads K and V once, in blocks spread
over the cores, and merges the blocks' softmaxes (flash-decoding): about as fast as that plain
sum (the measurements: docs/benchmarks-history.md, "ITL against context length").

It is built with the step's other kernel, the matrix-vector products (engine/fast/kernels.py),
by the background job that compiles the decode step. Until it is loaded, or where it cannot be
built, SDPA does the same sum. Its shapes are declared here, so that job's child process can
trace a step calling it while it is still building (`kernels.stand_in`).
"""

from __future__ import annotations

import torch

from engine.fast import kernels


def _shape(q: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
    """The output as torch.compile traces it: [kv_heads, group, d], whatever the capacity."""
    return q.new_empty(q.shape)


for _name in ("decode_attention", "decode_attention_int8"):
    kernels.shaped(_name)(_shape)


KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8)
"""What the kernel reads as stored (int8 with its scales: `decode_int8`)."""


def can_attend(keys: torch.Tensor) -> bool:
    """Whether the kernel can attend over `keys` now (loaded, or stood in for; a cache on the
    CPU of a type it reads)."""
    return kernels.step_kernel_there() and keys.device.type == "cpu" and keys.dtype in KERNEL_DTYPES


def decode(
    grouped: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    position: torch.Tensor,
    first: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token's attention: `grouped` [1, kv_heads, group, d] holds its query heads, those
    sharing a K/V head together, over keys/values [1, kv_heads, positions, d] (the cache or
    views of it) at positions first..position ([1] tensors; `first` None: 0, else a sliding
    window's start); returns [1, kv_heads, group, d]. Or n tokens' (a verify), the cache read
    once for all: `grouped` [1, kv_heads, n * group, d] holds each token's query heads in turn,
    `position` and `first` [n] each token's."""
    first = torch.zeros_like(position) if first is None else first
    out = torch.ops.llmchat.decode_attention(grouped[0].contiguous(), keys[0], values[0], first, position)
    return out[None]


def decode_int8(
    grouped: torch.Tensor, kv, position: torch.Tensor, first: torch.Tensor | None = None
) -> torch.Tensor:
    """`decode` over an int8 cache (engine/kvcache.py QuantizedKV: values [1, kv_heads, n, d],
    scales [1, kv_heads, n]): the kernel where it is loaded, else `chunked_int8` (one token only)."""
    first = torch.zeros_like(position) if first is None else first
    if can_attend(kv.keys):
        out = torch.ops.llmchat.decode_attention_int8(
            grouped[0].contiguous(),
            kv.keys[0],
            kv.key_scales[0],
            kv.values[0],
            kv.value_scales[0],
            first,
            position,
        )
        return out[None]
    return chunked_int8(grouped, kv, int(position), int(first))


CHUNK = 1024
"""Positions dequantized at a time by `chunked_int8`."""


def chunked_int8(
    grouped: torch.Tensor, kv, position: int, first: int = 0, chunk: int = CHUNK
) -> torch.Tensor:
    """The same sum in tensor ops, for where the kernel is not loaded (still building, no compiler,
    a GPU): CHUNK positions at a time are widened to float32 and folded into a running softmax
    (flash-decoding again), so at most one chunk's dequantized copy exists at once. It costs a
    write and a read of that copy per chunk, several small ops per chunk, and q·K as a batched
    matmul (bench: the int8 row says which path served)."""
    length = position + 1
    d = grouped.shape[-1]
    query = grouped.float() / d**0.5
    best = total = out = None
    for start in range(first, length, chunk):
        stop = min(length, start + chunk)
        keys = kv.keys[:, :, start:stop].float() * kv.key_scales[:, :, start:stop, None]
        scores = query @ keys.transpose(-1, -2)  # [1, kv_heads, group, n]
        peak = scores.amax(-1, keepdim=True)
        weights = torch.exp(scores - peak)
        values = kv.values[:, :, start:stop].float() * kv.value_scales[:, :, start:stop, None]
        part, mass = weights @ values, weights.sum(-1, keepdim=True)
        if best is None:
            best, total, out = peak, mass, part
            continue
        merged = torch.maximum(best, peak)
        old, new = torch.exp(best - merged), torch.exp(peak - merged)
        out, total, best = out * old + part * new, total * old + mass * new, merged
    return out / total
