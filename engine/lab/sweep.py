"""Decode at B = 1, 2, 4, 8, 16: the same step, more sequences, measured.

B copies of the workload's shortest prompt are prefilled (not timed), then `steps` decode steps
of all B together are timed (the first decode step warms up and is not). Aggregate tok/s =
B / the median step time; the per-user ITL is that step time, since each user gets one token
per step (the median: steady on a machine others share). While the step is memory-bound
(reading the weights dominates) B tokens cost about what one does, so the aggregate grows
nearly B-fold; once the arithmetic catches up with the bytes, the curve bends and each
user's ITL starts to grow.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass

from engine.lab.batched import BatchedForward, Feed
from engine.lab.pool import blocks_for
from engine.lab.scheduler import LabStopped

SWEEP_BATCHES = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class SweepPoint:
    batch: int
    aggregate_tok_s: float
    itl_ms_p50: float
    intensity: float
    """FLOPs per byte of the middle timed step (engine/lab/costs.py)."""


def fits(batch: int, prompt: tuple[int, ...], steps: int, forward: BatchedForward) -> bool:
    pool = forward.pool
    return batch * blocks_for(len(prompt) + steps + 2, pool.block_size) <= pool.num_blocks


def measure(
    batch: int,
    prompt: tuple[int, ...],
    steps: int,
    forward: BatchedForward,
    intensity_of=lambda feeds: 0.0,
    stop: threading.Event | None = None,
) -> SweepPoint:
    """Decode `batch` copies of `prompt` together for `steps` timed steps."""
    pool = forward.pool
    pool.free_all()
    for i in range(batch):
        pool.reserve(i, len(prompt) + steps + 2)
    try:
        logits = forward.step([Feed(i, prompt, 0) for i in range(batch)])
        last = logits.argmax(-1).tolist()
        position = len(prompt)
        times, intensity = [], 0.0
        for step in range(steps + 1):  # the first decode step warms up and is not timed
            if stop is not None and stop.is_set():
                raise LabStopped()
            feeds = [Feed(i, (last[i],), position) for i in range(batch)]
            started = time.perf_counter()
            last = forward.step(feeds).argmax(-1).tolist()
            if step:
                times.append(time.perf_counter() - started)
            if step == steps // 2:
                intensity = intensity_of(feeds)
            position += 1
    finally:
        pool.free_all()
    step_s = statistics.median(times)
    return SweepPoint(batch, batch / step_s, step_s * 1000, intensity)
