"""What a forward over a few rows costs (a speculative verify, the lab's batch): one forward over n
new tokens, in one-token steps, per precision.

    PYTHONPATH=. .venv/bin/python scripts/spec_verify_cost.py [--precisions P,..] [--model M] [--compiled]

Eager fast path, as a verify runs until its compiled step is built; the step's kernels loaded
first, as the app has them once its background build is done (the matvec kernel multiplies up to
16 rows reading each weight row once). With --compiled, the same forwards on the compiled steps
too, as an app that speculates has them once built: one token on the whole step, n on the verify
step; and eager's times in compiled steps.
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


def costs(model: str, precision: str, compiled: bool, context: int) -> dict[str, dict[int, float]]:
    """Median seconds of a forward over n tokens after `context` ones, for each n in ROWS: "eager";
    with `compiled` also "compiled" (the compiled step for one token, the verify step for more),
    the two interleaved."""
    loaded = models.load(model, precision, "cpu", chat=False)
    session = ChatSession(loaded, SamplingSettings(temperature=0), compile=compiled)
    build = session.compiled
    if compiled:
        build.wait_settled(900)
        build.want_verify()
        build.wait_verify(900)
        print(f"{precision}: {build.describe()}")
    ways = ("eager", "compiled") if compiled else ("eager",)
    times: dict[str, dict[int, list[float]]] = {way: {n: [] for n in ROWS} for way in ways}
    with torch.inference_mode():
        session.forward([100 + i % 200 for i in range(context)])  # the same tokens, however many
        for _ in range(5):
            for n in ROWS:
                for way in ways:
                    session.compiled = build if way == "compiled" else None
                    started = time.perf_counter()
                    ids = list(range(300, 300 + n))
                    forward_all(session, ids) if n > 1 else session.forward(ids)  # one token: the step
                    times[way][n].append(time.perf_counter() - started)
                    session.cache.crop(context)
    return {way: {n: statistics.median(t) for n, t in by_n.items()} for way, by_n in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precisions", default="fp32,bf16,w8")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--compiled", action="store_true", help="the compiled steps too, as an app has them")
    parser.add_argument("--context", type=int, default=100, help="tokens in the cache before each forward")
    args = parser.parse_args()
    problem = kernels.load("step")
    threads = torch.get_num_threads()
    print(f"{args.model}; kernels: {problem or 'loaded'}; {threads} threads; context {args.context}")
    for precision in args.precisions.split(","):
        medians = costs(args.model, precision, args.compiled, args.context)
        for way, by_n in medians.items():
            one = by_n[1]
            row = ", ".join(f"{n}: {by_n[n] / one:.2f}" for n in ROWS)
            print(f"{precision}, {way}: one step {one * 1000:.1f} ms; n rows in its steps: {row}")
        if args.compiled:
            step = medians["compiled"][1]
            row = ", ".join(f"{n}: {medians['eager'][n] / step:.2f}" for n in ROWS)
            print(f"{precision}, eager in compiled steps: {row}")


if __name__ == "__main__":
    main()
