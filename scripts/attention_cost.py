"""What one decode token's attention costs per layer, by cache type and length.

    .venv/bin/python scripts/attention_cost.py [--positions 1,50,200,1000,4000] [--repeats 2000]
                                               [--tokens N] [--dtypes fp32,bf16,fp16]

Calls the decode-attention kernel (engine/fast/attention.py) the way the decode step does, on
SmolLM2's shape (3 K/V heads of 64, 3 query heads each): `warm` times one layer called again
and again (its cache in the CPU's caches); `cold` times 30 layers' caches in turn after a 64 MiB
write has evicted them, as in a real step, where the weights stream through between layers.
--tokens N: N new tokens at once, as a speculative verify calls it (each over the positions up to
its own). Prints microseconds per layer. Not part of CI.
"""

from __future__ import annotations

import argparse
import time

import torch

from engine.fast import kernels

KV_HEADS, GROUP, HEAD_DIM, LAYERS = 3, 3, 64, 30
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def queries(length: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The query heads of `tokens` new tokens, the last at `length - 1`, and each one's first and
    last position (the decode step's arguments)."""
    last = torch.arange(max(length - tokens, 0), length)[-tokens:]
    return torch.randn(KV_HEADS, GROUP * len(last), HEAD_DIM), torch.zeros_like(last), last


def warm(dtype: torch.dtype, length: int, repeats: int, tokens: int) -> float:
    keys, values = (torch.randn(KV_HEADS, length, HEAD_DIM).to(dtype) for _ in range(2))
    query, first, position = queries(length, tokens)
    for _ in range(100):
        torch.ops.llmchat.decode_attention(query, keys, values, first, position)
    started = time.perf_counter()
    for _ in range(repeats):
        torch.ops.llmchat.decode_attention(query, keys, values, first, position)
    return (time.perf_counter() - started) / repeats


def cold(dtype: torch.dtype, length: int, tokens: int, rounds: int = 20) -> float:
    caches = [[torch.randn(KV_HEADS, length, HEAD_DIM).to(dtype) for _ in range(2)] for _ in range(LAYERS)]
    query, first, position = queries(length, tokens)
    evict = torch.ones(16 << 20)  # 64 MiB, twice this CPU's L3
    best = float("inf")
    for _ in range(rounds):
        evict.add_(1)
        started = time.perf_counter()
        for keys, values in caches:
            torch.ops.llmchat.decode_attention(query, keys, values, first, position)
        best = min(best, (time.perf_counter() - started) / LAYERS)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--positions", default="1,50,200,1000,4000")
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=1, help="new tokens at once (a verify: 2-16)")
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    args = parser.parse_args()
    problem = kernels.load("step")
    if problem is not None:
        raise SystemExit(f"the decode-attention kernel did not build: {problem}")
    lengths = [int(n) for n in args.positions.split(",")]
    print("us per layer   " + "".join(f"{n:>10,}" for n in lengths))
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        for label, measure in (
            ("warm", lambda n: warm(dtype, n, args.repeats, args.tokens)),
            ("cold", lambda n: cold(dtype, n, args.tokens)),
        ):
            print(f"{name} {label:9s}" + "".join(f"{measure(n) * 1e6:10.1f}" for n in lengths), flush=True)


if __name__ == "__main__":
    main()
