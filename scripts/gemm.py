"""float32 x @ W.T on this CPU: torch's default BLAS against oneDNN (engine/fast/gemm.py).

    .venv/bin/python scripts/gemm.py [--json]

For the built-in model's gate/up matrix ([3072, 576]) at several row counts (1 = a decode
step, 512 = a prefill chunk), alternating the two in one process: GFLOP/s of `F.linear` (MKL on
torch's x86 wheels), of oneDNN's linear on the same [out, in] weight, and on a transposed view
(the eager fast path's float32 layout). Not part of CI.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

OUT, IN = 3072, 576
ROWS = (1, 4, 16, 64, 512)
ROUNDS = 5


def gflops(run, rows: int, seconds: float = 0.2) -> float:
    run()
    calls, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds:
        run()
        calls += 1
    return 2 * rows * IN * OUT * calls / elapsed / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from engine.fast import gemm

    if not gemm.onednn_works():
        raise SystemExit("oneDNN's linear is not available in this torch build: nothing to compare")
    onednn = torch.ops.mkldnn._linear_pointwise
    weight = torch.randn(OUT, IN)
    transposed = weight.t().contiguous()  # [in, out]
    table = []
    for rows in ROWS:
        x = torch.randn(rows, IN)
        ways = {
            "F.linear": lambda: F.linear(x, weight),
            "oneDNN": lambda: onednn(x, weight, None, "none", [], ""),
            "oneDNN, [in, out]": lambda: onednn(x, transposed.t(), None, "none", [], ""),
        }
        best = {name: 0.0 for name in ways}
        for _ in range(ROUNDS):  # alternate, keep each one's best: this machine's speed drifts
            for name, run in ways.items():
                best[name] = max(best[name], gflops(run, rows))
        table.append({"rows": rows, **{name: round(value, 1) for name, value in best.items()}})
    if args.json:
        print(json.dumps({"threads": torch.get_num_threads(), "gflops": table}, indent=2))
        return
    print(f"GFLOP/s, float32 [{OUT}, {IN}] weight, {torch.get_num_threads()} threads, best of {ROUNDS}")
    print(f"{'rows':>5} {'F.linear':>9} {'oneDNN':>8} {'[in,out]':>9} {'ratio':>6}")
    for row in table:
        mkl, onednn, in_out = row["F.linear"], row["oneDNN"], row["oneDNN, [in, out]"]
        print(f"{row['rows']:>5} {mkl:>9} {onednn:>8} {in_out:>9} {onednn / mkl:>5.2f}x")


if __name__ == "__main__":
    main()
