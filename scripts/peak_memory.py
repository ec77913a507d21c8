"""Peak RSS of a chat at each precision, each alone in a fresh process, against its weights.

    .venv/bin/python scripts/peak_memory.py [-p fp32 -p bf16 -p w8 ...] [--ask] [--json]
        [--model SPEC [--random-weights]]

Each precision runs as the app does on a CPU: load the built-in model, build the fast path,
compile the decode step (loaded where an earlier run saved it: run twice for the
cached figures), answer one question. `VmHWM` (the process's peak resident set) is read after
each stage; issue 15's target is a peak of at most twice the weights. `--ask` runs each as
`llmchat ask` does instead: loaded for the fast path only (without transformers where it can be),
no compile. `--model SPEC --random-weights` measures SPEC's architecture with random weights
(written once into the cache dir, as the bench does, before any child starts): what the same
process costs beside a larger model's weights. Not part of CI.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "What is the capital of France?"


def one(spec: str, precision: str, ask: bool = False) -> dict:
    """In this process: the stages of a chat at `precision`, the peak after each."""
    from engine import models
    from engine.bench import peak_memory_bytes
    from engine.session import ChatSession

    def _peak_mib() -> float:
        return peak_memory_bytes("cpu") / 2**20

    stages = {}

    stages["imports"] = _peak_mib()
    loaded = models.load(spec, precision, "cpu", fast_only=ask)
    stages["loaded"] = _peak_mib()
    session = ChatSession(loaded, compile=not ask)
    stages["fast path built"] = _peak_mib()
    if session.compiled is not None:
        session.compiled.wait_settled(900)
        stages["compiled steps ready"] = _peak_mib()
    for _ in session.send(QUESTION):
        pass
    stages["after an answer"] = _peak_mib()
    weights = loaded.info.weight_bytes / 2**20
    return {
        "precision": precision,
        "weights_mib": round(weights, 1),
        "peak_mib": {stage: round(mib) for stage, mib in stages.items()},
        "peak_over_weights": round(stages["after an answer"] / weights, 2),
        "compiled": session.compiled is not None and session.compiled.ready.is_set(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-p", "--precision", action="append", dest="precisions")
    parser.add_argument("--ask", action="store_true", help="as `llmchat ask` runs: no compile")
    parser.add_argument("--model", help="a model spec (default: the built-in model)")
    parser.add_argument("--random-weights", action="store_true", help="its architecture, random")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child's precision
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.model, args.one, args.ask)))
        return
    from engine import models

    spec = args.model or models.DEFAULT_MODEL
    if args.random_weights:
        spec = str(models.random_weights_dir(spec))
    rows = []
    for precision in args.precisions or ["fp32", "bf16", "fp16", "w8", "w8a8"]:
        print(f"[{precision}] in a fresh process", file=sys.stderr, flush=True)
        done = subprocess.run(
            [sys.executable, __file__, "--one", precision, "--model", spec] + (["--ask"] if args.ask else []),
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        if done.returncode:
            raise SystemExit(f"{precision} failed: {done.stderr.strip().splitlines()[-1:]}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    if args.json:
        print(json.dumps(rows))
        return
    for row in rows:
        stages = " · ".join(f"{stage} {mib:,} MiB" for stage, mib in row["peak_mib"].items())
        print(
            f"{row['precision']:>5}: weights {row['weights_mib']:,.0f} MiB, peak "
            f"{row['peak_over_weights']:.2f}x ({stages})"
        )


if __name__ == "__main__":
    main()
