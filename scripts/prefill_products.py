"""What a quantized width's prefill in bf16 products costs in answers and buys in time.

    .venv/bin/python scripts/prefill_products.py [--model SPEC] [--precision w8] [--tokens 1024]

A w8 or w4 forward over more rows than the rows kernel takes multiplies in bfloat16 where the
CPU has bf16 products (engine/quant/w8.py `product_dtype`). This loads the model at fp32 (the
reference) and at the width, runs the same text (README.md, 256-token chunks as a prefill) with
the products in float32 and in bfloat16, and prints each one's top-1 agreement and mean KL
against fp32 at every position, and a 512-token prefill's best of 3. Not part of CI.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from engine import DEFAULT_MODEL, models
from engine.fast import fused
from engine.kvcache import KVCache
from engine.quant import w8

ROOT = Path(__file__).resolve().parents[1]
CHUNK = 256


def every_logits(loaded: models.LoadedModel, ids: list[int]) -> torch.Tensor:
    """Each position's logits of `ids`, prefilled a chunk at a time by the fast path."""
    fast = fused.FastLlama(loaded.model)
    cache = KVCache.for_model(loaded.info)
    rows = []
    with torch.inference_mode():
        for start in range(0, len(ids), CHUNK):
            chunk = ids[start : start + CHUNK]
            rows.append(fast.forward(torch.tensor([chunk]), cache, every=True).float())
            cache.appended(chunk)
    return torch.cat(rows)


def prefill_ms(loaded: models.LoadedModel, ids: list[int]) -> float:
    fast = fused.FastLlama(loaded.model)
    times = []
    with torch.inference_mode():
        for _ in range(3):
            cache = KVCache.for_model(loaded.info)
            started = time.perf_counter()
            fast.forward(torch.tensor([ids]), cache)
            times.append(time.perf_counter() - started)
    return min(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--precision", default="w8", choices=("w8", "w4"))
    parser.add_argument("--tokens", type=int, default=1024)
    args = parser.parse_args()
    reference = models.load(args.model, "fp32", "cpu", chat=False)
    ids = reference.tokenizer((ROOT / "README.md").read_text()[:6000])["input_ids"][: args.tokens]
    expected = torch.log_softmax(every_logits(reference, ids), -1)
    del reference
    loaded = models.load(args.model, args.precision, "cpu", chat=False)
    native = w8.cpu_matmul_native
    for name, bf16 in (("float32", False), ("bfloat16", True)):
        w8.cpu_matmul_native = lambda dtype, bf16=bf16: bf16 and native(dtype)
        got = torch.log_softmax(every_logits(loaded, ids), -1)
        kl = (expected.exp() * (expected - got)).sum(-1).mean().item()
        agree = (expected.argmax(-1) == got.argmax(-1)).float().mean().item()
        ms = prefill_ms(loaded, ids[:512])
        print(
            f"{args.precision}, products in {name}: top-1 agreement {agree:.4f}, mean KL {kl:.5f}, "
            f"prefill 512 {ms:.0f} ms",
            flush=True,
        )
    w8.cpu_matmul_native = native


if __name__ == "__main__":
    main()
