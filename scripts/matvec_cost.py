"""What the matvec kernel buys a decode step: it against Inductor's loop and aten, then in the step.

    .venv/bin/python scripts/matvec_cost.py [--precisions fp32,bf16] [--rounds 3] [--windows 4]
                                            [--matrices-only]

1. The built-in model's matrices (30 layers' fused QKV, O, gate/up, down, and the LM head), each
   multiplied by one token's activations in turn as a step does, so every matrix comes from
   memory: by the kernel (engine/fast/matvec.cpp), by Inductor's compiled loop (what the step
   runs without the kernel) and by aten's `F.linear`; ms for the whole set and GB/s, best of
   `--rounds`, beside a plain read of the same bytes (this machine's bound).
2. The whole compiled step built with the kernel and without it, in one process, decoding in
   alternating windows of 48 tokens: median ms a token of each window (both see the machine in
   the same state), and whether both pick the same greedy tokens.
3. The same for the eager step (what answers while the compiled one builds, and with
   --no-compile): aten's matmuls, or the kernel for each one-row product once it is loaded.
--matrices-only stops after 1 (no compiling): with PYTHONPATH at another checkout (a git worktree)
it measures that checkout's kernel, for a before and after. --rows 1,5,9,16 adds to 1 the kernel
over the same matrices for n rows of x at once (a verify's tokens, the lab's batch: float32 x, a
bf16 model's own bf16), best of --rounds, in ms and in one-row times, and the floor under them:
the products alone at the kernel's fastest rate. Not part of CI.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from engine import DEFAULT_MODEL, bench, models
from engine.fast import fused, kernels, matvec, steps


def matrices(fast: fused.FastLlama) -> list[torch.Tensor]:
    """Each weight as the kernel reads it (w8's int8 rows without their scales)."""
    weights = [w for layer in fast.layers for w in (layer.wqkv, layer.wo, layer.wgu, layer.wdown)]
    return [getattr(w, "q", w) for w in (*weights, fast.lm_head)]


def best_ms(run, rounds: int) -> float:
    run()  # warm: compiles, first touches
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times) * 1e3


def per_matrix(fast: fused.FastLlama, rounds: int) -> None:
    weights = matrices(fast)
    size = sum(w.numel() * w.element_size() for w in weights)
    x_dtype = {torch.int8: torch.float32}.get(weights[0].dtype, weights[0].dtype)
    inputs = {w.shape[1]: torch.randn(1, w.shape[1]).to(x_dtype) for w in weights}
    torch._dynamo.config.recompile_limit = 64  # one loop per matrix shape
    loop = torch.compile(lambda x, w: (x[:, None, :] * w[None].to(x.dtype)).sum(-1), dynamic=False)
    ways = {"kernel": matvec.multiply, "Inductor loop": loop}
    if weights[0].dtype != torch.int8:  # aten has no int8 x float32 product
        ways["aten F.linear"] = F.linear
    flat = torch.ones(size // 4, dtype=torch.float32)  # touched: an untouched page reads as one zero page
    with torch.inference_mode():
        read = best_ms(lambda: flat.sum(), rounds)
        print(
            f"  {'plain read':>14}: {read:6.2f} ms  {size / read / 1e6:5.1f} GB/s  ({size / 2**20:.0f} MiB)"
        )
        for name, way in ways.items():
            ms = best_ms(lambda way=way: [way(inputs[w.shape[1]], w) for w in weights], rounds)
            print(f"  {name:>14}: {ms:6.2f} ms  {size / ms / 1e6:5.1f} GB/s", flush=True)


def rows_of_x(fast: fused.FastLlama, counts: list[int], rounds: int) -> None:
    weights = matrices(fast)
    x_dtype = torch.bfloat16 if weights[0].dtype == torch.bfloat16 else torch.float32
    ms = {}
    with torch.inference_mode():
        for n in counts:
            inputs = {w.shape[1]: torch.randn(n, w.shape[1]).to(x_dtype) for w in weights}
            ms[n] = best_ms(lambda: [matvec.multiply(inputs[w.shape[1]], w) for w in weights], rounds)
    one = ms.get(1)
    cells = (f"{n} rows {t:.2f} ms" + (f" ({t / one:.2f})" if one else "") for n, t in ms.items())
    print("  " + ", ".join(cells))
    if not one:
        return
    # The floor under n rows, memory aside: the weights n times over at the products' fastest rate
    # (from memory above, or from L2). Above a target, only faster products meet it: a CPU with
    # more of them per byte of memory bandwidth, or narrower ones.
    total = sum(w.numel() for w in weights)
    fastest = max(max(n * total / t for n, t in ms.items()), cached_rate(weights[0], x_dtype, counts, rounds))
    floors = ", ".join(f"{n} rows >= {n * total / fastest / one:.2f}" for n in counts if n > 1)
    print(f"  products at their fastest {fastest / 1e6:.0f} GMAC/s: {floors} one-row times")


def cached_rate(w: torch.Tensor, x_dtype: torch.dtype, counts: list[int], rounds: int) -> float:
    """Products a millisecond at the best of `counts` rows of x against ~1 MB of `w` (half of it
    each core's), which stays in the cores' L2: the kernel's products with no memory to wait on."""
    block = w[: max(2, (1 << 20) // (w.shape[1] * w.element_size()))].contiguous()
    best, repeats = 0.0, 20
    with torch.inference_mode():
        for n in counts:
            x = torch.randn(n, w.shape[1]).to(x_dtype)
            ms = best_ms(lambda x=x: [matvec.multiply(x, block) for _ in range(repeats)], rounds) / repeats
            best = max(best, n * block.numel() / ms)
    return best


def in_the_step(fast: fused.FastLlama, cache_dtype: torch.dtype, windows: int, tokens: int = 48) -> None:
    made, default = {}, matvec.enabled
    for use in (True, False):
        matvec.enabled = use
        started = time.perf_counter()
        step = steps.assemble("whole", steps.compile_here("whole", fast, cache_dtype))
        made[use] = (step, steps.scratch_buffers(fast, cache_dtype, capacity=4096))
        took = time.perf_counter() - started
        print(f"  whole step {'with' if use else 'without'} the kernel compiled in {took:.0f} s")
    matvec.enabled = default
    offsets = steps.no_offsets(fast)  # scratch buffers hold every position from 0
    with torch.inference_mode():
        picked = {}
        for use, (step, buffers) in made.items():
            ids = [1]
            for position in range(8):
                logits = step(fast, torch.tensor([ids[-1]]), torch.tensor([position]), offsets, *buffers)
                ids.append(int(logits.argmax()))
            picked[use] = ids
        print(f"  same greedy tokens: {picked[True] == picked[False]} ({picked[True]} / {picked[False]})")
        position, medians = 8, {True: [], False: []}
        for _ in range(windows):
            for use, (step, buffers) in made.items():
                stamps = [time.perf_counter()]
                for p in range(position, position + tokens):
                    step(fast, torch.tensor([1]), torch.tensor([p]), offsets, *buffers)
                    stamps.append(time.perf_counter())
                medians[use].append(statistics.median(b - a for a, b in zip(stamps, stamps[1:])) * 1e3)
            position += tokens
    report(medians)


def eager(loaded, windows: int, tokens: int = 48) -> None:
    default, medians = matvec.enabled, {True: [], False: []}
    ids = bench.prompt_ids(loaded.tokenizer, 32)
    for _ in range(windows):
        for use in (True, False):
            matvec.enabled = use
            medians[use].append(statistics.median(bench.measure_step(loaded, ids, tokens)[1]) * 1e3)
    matvec.enabled = default
    report(medians)


def report(medians: dict[bool, list[float]]) -> None:
    for use in (True, False):
        windows = ", ".join(f"{m:.2f}" for m in medians[use])
        print(f"  step {'with' if use else 'without'} the kernel: {windows} ms")
    ratios = [b / a for a, b in zip(medians[True], medians[False])]
    print(f"  speed-up, window by window: {min(ratios):.2f}-{max(ratios):.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--matrices-only", action="store_true", help="only 1: the matrices, nothing compiled")
    parser.add_argument("--rows", default="", help="also n rows of x at once, e.g. 1,5,9,16")
    args = parser.parse_args()
    problem = kernels.load("step")
    if problem is not None:
        raise SystemExit(f"the kernel did not build: {problem}")
    isa, threads = torch.backends.cpu.get_cpu_capability(), torch.get_num_threads()
    print(f"{isa}, {threads} threads; the app's steps use the kernel: {matvec.enabled}")
    for precision in args.precisions.split(","):
        loaded = models.load(DEFAULT_MODEL, precision, "cpu", fast_only=True)
        fast = fused.for_model(loaded.model, compiled=True)
        print(f"{precision}: the model's matrices, one token each, from memory (best of {args.rounds})")
        per_matrix(fast, args.rounds)
        if args.rows:
            print(f"{precision}: the same matrices, n rows of x at once (best of {args.rounds})")
            rows_of_x(fast, [int(n) for n in args.rows.split(",")], args.rounds)
        if args.matrices_only:
            continue
        print(f"{precision}: the whole compiled step, {args.windows} alternating windows")
        in_the_step(fast, getattr(torch, loaded.info.cache_dtype), args.windows)
        print(f"{precision}: the eager step, {args.windows} alternating windows")
        eager(loaded, args.windows)


if __name__ == "__main__":
    main()
