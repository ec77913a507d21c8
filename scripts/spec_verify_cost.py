"""What a forward over a few rows costs (a speculative verify, the lab's batch): one forward over n
new tokens, in one-token steps, per precision.

    PYTHONPATH=. .venv/bin/python scripts/spec_verify_cost.py [--precisions P,..] [--model M] [--compiled]

Eager fast path, as a verify runs until its compiled step is built; the step's kernels loaded
first, as the app has them once its background build is done (the matvec kernel multiplies up to
16 rows reading each weight row once). With --compiled, as an app that speculates runs once its
builds are done: n rows on the compiled verify step, in steps of the whole compiled step.
Same process, rounds interleaved, median of 5 (BENCHMARKS.md, "Speculative decoding").
"""

import argparse
import statistics
import time

import torch

from engine import models
from engine.fast import kernels
from engine.sampling import SamplingSettings
from engine.session import ChatSession
from engine.speculative.loop import forward_all

ROWS = (1, 2, 3, 5, 9, 16)


def costs(model: str, precision: str, compiled: bool) -> dict[int, float]:
    """Median seconds of a forward over n tokens after 100 of context, for each n in ROWS."""
    loaded = models.load(model, precision, "cpu", chat=False)
    session = ChatSession(loaded, SamplingSettings(temperature=0), compile=compiled)
    if compiled:
        build = session.compiled
        build.wait_settled(900)
        build.want_verify()
        build.wait_verify(900)
        print(f"{precision}: {build.describe()}")
    times: dict[int, list[float]] = {n: [] for n in ROWS}
    with torch.inference_mode():
        session.forward(list(range(100, 200)))  # 100 tokens of context
        for _ in range(5):
            for n in ROWS:
                started = time.perf_counter()
                ids = list(range(300, 300 + n))
                forward_all(session, ids) if n > 1 else session.forward(ids)  # one token: the step
                times[n].append(time.perf_counter() - started)
                session.cache.crop(100)
    return {n: statistics.median(t) for n, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precisions", default="fp32,bf16,w8")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--compiled", action="store_true", help="the compiled steps, as an app has them")
    args = parser.parse_args()
    problem = kernels.load("step")
    print(f"{args.model}; kernels: {problem or 'loaded'}; {torch.get_num_threads()} threads")
    for precision in args.precisions.split(","):
        medians = costs(args.model, precision, args.compiled)
        one = medians[1]
        row = ", ".join(f"{n}: {medians[n] / one:.2f}" for n in ROWS)
        print(f"{precision}: one step {one * 1000:.1f} ms; n rows in steps: {row}")


if __name__ == "__main__":
    main()
