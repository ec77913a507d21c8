"""What a speculative verify pass costs: one forward over n new tokens, in one-token steps.

    PYTHONPATH=. .venv/bin/python scripts/spec_verify_cost.py

Same process, rounds interleaved, median of 5 (BENCHMARKS.md, "Speculative decoding").
"""

import statistics
import time

import torch

from engine import models
from engine.sampling import SamplingSettings
from engine.session import ChatSession
from engine.speculative.loop import forward_all

ROWS = (1, 2, 3, 5, 9)


def main() -> None:
    loaded = models.load("smollm2-135m", "fp32", "cpu")
    session = ChatSession(loaded, SamplingSettings(temperature=0), compile=False)
    times: dict[int, list[float]] = {n: [] for n in ROWS}
    with torch.inference_mode():
        session.forward(list(range(100, 200)))  # 100 tokens of context
        for _ in range(5):
            for n in ROWS:
                started = time.perf_counter()
                forward_all(session, list(range(300, 300 + n)))
                times[n].append(time.perf_counter() - started)
                session.cache.crop(100)
    one = statistics.median(times[1])
    for n in ROWS:
        median = statistics.median(times[n])
        print(f"{n} rows: {median * 1000:.1f} ms = {median / one:.2f} one-token steps")


if __name__ == "__main__":
    main()
