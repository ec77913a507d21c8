"""The decode step beside a busy program (engine/threads.py): with the governor that runs each
forward on the cores others leave free, and with torch's threads fixed, quiet and beside one
spinning process, alternated in one run.

    PYTHONPATH=. .venv/bin/python scripts/busy_core.py [--tokens 64] [--rounds 2] [--eager]

The busy program is a Python loop at nice 0 (a build, a browser tab, another model). Each cell
is the median tok/s of a greedy 64-token answer and its ITL p90.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch

from engine import DEFAULT_MODEL, bench, models, threads
from engine.sampling import SamplingSettings
from engine.session import ChatSession, Message


def answer(loaded, tokens: int, compile: bool) -> tuple[float, float]:
    """(decode tok/s, ITL p90 ms) of a greedy answer on a fresh session."""
    session = ChatSession(loaded, SamplingSettings(temperature=0.0, max_new_tokens=tokens), compile=compile)
    if compile:
        session.compiled.wait_settled(900)  # built once, loaded from the cache each time after
    time.sleep(2 * threads.WINDOW_S)  # as a user types: the governor's first window
    runner = session.run(session.template([Message("user", "Write a short poem about the sea.")]), False)
    while True:
        try:
            next(runner)
        except StopIteration as done:
            stats = done.value[1]
            return stats.decode_tok_s, stats.itl_p90_s * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--eager", action="store_true", help="the eager step, not the compiled one")
    args = parser.parse_args()
    loaded = models.load(DEFAULT_MODEL, "fp32", "cpu")
    compile = not args.eager
    if compile:
        print(bench.compile_decode(loaded)["note"], file=sys.stderr)
    follow = threads.ThreadGovernor.follow
    cells: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for _ in range(args.rounds):
        for machine in ("quiet", "one busy program"):
            hog = None if machine == "quiet" else subprocess.Popen([sys.executable, "-c", "while True: pass"])
            try:
                time.sleep(0.3)
                for governed in ("fixed threads", "governor"):
                    threads.ThreadGovernor.follow = follow if governed == "governor" else lambda self: None
                    threads.restore()
                    cells.setdefault((machine, governed), []).append(answer(loaded, args.tokens, compile))
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
    threads.ThreadGovernor.follow = follow
    step = "eager" if args.eager else "compiled"
    print(f"{step} step, fp32, {threads.configured()} threads configured, {threads.cores()} cores")
    print(f"{'machine':<18} {'threads':<14} {'tok/s':>7} {'ITL p90 ms':>11}")
    for (machine, governed), runs in cells.items():
        tok_s = statistics.median(r[0] for r in runs)
        p90 = statistics.median(r[1] for r in runs)
        print(f"{machine:<18} {governed:<14} {tok_s:7.1f} {p90:11.1f}")
    torch.set_num_threads(threads.configured())


if __name__ == "__main__":
    main()
