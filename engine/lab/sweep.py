"""Decode at B = 1, 2, 4, 8, 16: the same step, more sequences, measured.

B copies of the workload's shortest prompt are prefilled (not timed), then decode steps of all
B together are timed (the first decode step warms up and is not), in a few passes over all B.
Aggregate tok/s = B / the median step time; the per-user ITL is that step time, since each
user gets one token per step (the median: steady on a machine others share). While the step is memory-bound
(reading the weights dominates) B tokens cost about what one does, so the aggregate grows
nearly B-fold; once the arithmetic catches up with the bytes, the curve bends and each
user's ITL starts to grow.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass

from engine.contention import ContentionMeter
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
    busy: bool = False
    """Other work slowed this process while some of its steps were timed (engine/contention.py)."""


def fits(batch: int, prompt: tuple[int, ...], steps: int, forward: BatchedForward) -> bool:
    pool = forward.pool
    return batch * blocks_for(len(prompt) + steps + 2, pool.block_size) <= pool.num_blocks


def timed_steps(
    batch: int,
    prompt: tuple[int, ...],
    steps: int,
    forward: BatchedForward,
    intensity_of=lambda feeds: 0.0,
    stop: threading.Event | None = None,
) -> tuple[list[float], float]:
    """Decode `batch` copies of `prompt` together: the times of `steps` steps (after one untimed),
    and the intensity of the middle one."""
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
    return times, intensity


def point(batch: int, times: list[float], intensity: float, busy: bool = False) -> SweepPoint:
    step_s = statistics.median(times)
    return SweepPoint(batch, batch / step_s, step_s * 1000, intensity, busy)


def run_sweep(
    batches: list[int],
    prompt: tuple[int, ...],
    steps: int,
    passes: int,
    forward: BatchedForward,
    intensity_of=lambda feeds: 0.0,
    stop: threading.Event | None = None,
    on_point=None,
) -> list[SweepPoint]:
    """`passes` rounds over every B, `steps` timed steps each time: a load that comes and goes on
    a shared machine then falls on every B alike, and each B's median is taken over all its steps.
    A B is busy where any of its passes was."""
    times: dict[int, list[float]] = {b: [] for b in batches}
    intensity: dict[int, float] = {}
    busy = dict.fromkeys(batches, False)
    for round_ in range(passes):
        for b in batches:
            meter = ContentionMeter()
            more, intensity[b] = timed_steps(b, prompt, steps, forward, intensity_of, stop)
            times[b] += more
            busy[b] = busy[b] or meter.stop().busy
            if round_ == passes - 1 and on_point is not None:
                on_point(point(b, times[b], intensity[b], busy[b]))
    return [point(b, times[b], intensity[b], busy[b]) for b in batches]


def dips(points: list[SweepPoint], bends_at: int | None) -> list[int]:
    """The B up to the bend (all B, if none) whose aggregate fell below the previous B's: while a
    step waits on memory more sequences never cost tokens (a bend slows the gain, it is no loss),
    so a fall says the machine, not batching (a busy spell, a slower path): run it again."""
    return [
        b.batch
        for a, b in zip(points, points[1:])
        if (bends_at is None or b.batch <= bends_at) and b.aggregate_tok_s < a.aggregate_tok_s
    ]
