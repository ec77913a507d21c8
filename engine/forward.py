"""One forward pass over a few ids with a KV cache, by the fastest code that serves it: the
compiled step (one token after a non-empty cache, once built; a speculative verify's few tokens,
once its own step is built), the fused fast path, or transformers' own forward (the reference).
The chat's session and a draft model share it."""

from __future__ import annotations

import torch

from engine.fast.compiled import CompiledDecode
from engine.fast.fused import FastLlama
from engine.kvcache import KVCache


def forward(
    model: torch.nn.Module,
    fast: FastLlama | None,
    compiled: CompiledDecode | None,
    ids: list[int],
    cache: KVCache,
    device: torch.device,
    every: bool = False,
) -> torch.Tensor:
    """The last position's logits [vocab], or with `every` each position's [len(ids), vocab] (a
    speculative verify scores every draft); `compiled` only where its step serves this cache now.
    A compiled step that fails serves no more (`CompiledDecode.served`): the eager path takes the
    same ids, which it left unfed."""
    logits = None
    if len(ids) == 1 and len(cache) and compiled is not None and not every:
        logits = compiled.served(compiled.step, fast, ids[0], cache)
    elif every and len(cache) and compiled is not None and compiled.verifies(len(ids)):
        logits = compiled.served(compiled.verify, fast, ids, cache)
    if logits is None:
        inputs = torch.tensor([ids], device=device)
        if fast is not None:
            logits = fast.forward(inputs, cache, every=every)
        else:
            kept = model(input_ids=inputs, cache=cache.hf, use_cache=True, logits_to_keep=0 if every else 1)
            logits = kept.logits[0] if every else kept.logits[0, -1]
    cache.appended(ids)
    return logits
