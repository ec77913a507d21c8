"""What a sliding window's cache saves: bytes held and decode time, against a cache that keeps all.

    .venv/bin/python scripts/window_cache.py --model GGUF [--contexts 900,3000] [--steps 40] [--raw]

For each context: prefills that many tokens of README.md into two caches, one whose sliding-window
layers drop what no later token sees (the app's, engine/kvcache_layers.py) and one that keeps every
position, then decodes `--steps` greedy tokens on each on the eager fast path, alternating step by
step so both see the machine in the same state. Prints, per context: whether the tokens are the
same, the largest difference of the last logits, the bytes each cache holds (summed from its
tensors) and the median step time of each. Not part of CI.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from engine import models
from engine.fast import fused
from engine.kvcache import KVCache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a model with sliding-window layers (Gemma 3)")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--contexts", default="900,3000")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--raw", action="store_true", help="a base model (no chat template)")
    args = parser.parse_args()
    loaded = models.load(args.model, args.precision, "cpu", chat=not args.raw)
    info = loaded.info
    if not any(info.layer_windows):
        raise SystemExit(f"{info.name} has no sliding-window layers: both caches would be the same")
    fast = fused.FastLlama(loaded.model)
    text = (Path(__file__).parent.parent / "README.md").read_text()
    ids = loaded.tokenizer(text * 2)["input_ids"]
    for context in (int(c) for c in args.contexts.split(",")):
        caches = {
            "window": KVCache.for_model(info),
            "keep all": KVCache(info.layers, precision=KVCache.for_model(info).precision),
        }
        tokens = {name: [] for name in caches}
        times = {name: [] for name in caches}
        with torch.inference_mode():
            logits = {}
            for name, cache in caches.items():
                logits[name] = fast.forward(torch.tensor([ids[:context]]), cache)
                cache.appended(ids[:context])
            for _ in range(args.steps):
                for name, cache in caches.items():
                    tokens[name].append(int(logits[name].argmax()))
                    started = time.perf_counter()
                    logits[name] = fast.forward(torch.tensor([tokens[name][-1:]]), cache)
                    cache.appended(tokens[name][-1:])
                    times[name].append(time.perf_counter() - started)
        window, keep = caches["window"], caches["keep all"]
        difference = (logits["window"] - logits["keep all"]).abs().max().item()
        print(
            f"{context + args.steps:,} tokens: same tokens {tokens['window'] == tokens['keep all']}, "
            f"last logits differ by {difference:.1e}; held {window.tensor_bytes() / 2**20:.1f} MiB "
            f"(each window layer {min(window.positions_held()):,} positions) against "
            f"{keep.tensor_bytes() / 2**20:.1f} MiB; step p50 "
            f"{statistics.median(times['window']) * 1e3:.1f} against "
            f"{statistics.median(times['keep all']) * 1e3:.1f} ms",
            flush=True,
        )


if __name__ == "__main__":
    main()
