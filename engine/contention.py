"""Was this process given the CPU while it measured? A figure taken on a busy machine says so.

On a shared machine the same decode step can take 64 ms or 349 ms: the step did not change,
the cores were busy with other work. Linux tracks, per thread, the time it ran and the time it
waited on a run queue, runnable but with no core free (/proc/self/task/TID/schedstat, in ns):

    CPU share = run / (run + run-queue wait)      summed over this process's threads

Sleeping (waiting for the GIL, a lock, the user) counts in neither, so the share is about the
machine, not about our own pauses: about 100% on an idle machine, 50% when two busy programs
share two cores with us. Where schedstat is missing, the inference thread's CPU time against
wall time stands in (then a pause of ours also lowers it). The 1-minute load average beside
it says how many threads wanted a core on average; it lags, so it only backs the share up.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

from engine import threads
from engine.events import Contention
from engine.threads import cores

BUSY_SHARE = 0.70
"""Below this CPU share the figures are flagged: an idle run measures 0.9-1.0 here, a run beside
two spinning processes on two cores about 0.5 (and took three times as long)."""
OVERLOAD = 2.0
"""A 1-minute load above this many times the cores is flagged too, whatever the share: more
than one other thread queued for every core, most of the last minute."""
MIN_SCHEDSTAT_S = 0.05
"""The kernel adds a running thread's time at scheduler ticks and switches: over an interval
shorter than this, schedstat may not have moved, and the thread's CPU clock stands in."""
_TASKS = Path("/proc/self/task")


def load_1m() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


Reading = dict[str, tuple[int, int]]
"""Per thread id: (ns run, ns waited on a run queue)."""


def scheduled() -> Reading | None:
    """Each of this process's threads' schedstat; None where the kernel does not keep it."""
    reading = {}
    try:
        tasks = list(_TASKS.iterdir())
    except OSError:
        return None
    for task in tasks:
        try:
            fields = (task / "schedstat").read_text().split()
        except OSError:  # the thread ended meanwhile
            continue
        reading[task.name] = (int(fields[0]), int(fields[1]))
    if not any(run for run, _ in reading.values()):  # a kernel without schedstat reports zeros
        return None
    return reading


def grown(start: Reading, now: Reading) -> tuple[float, float]:
    """(seconds run, seconds waited) between two readings: each thread's growth, a thread started
    meanwhile whole. One that ended meanwhile adds nothing; the difference of two sums took its
    earlier wait away from the others' instead (a bench's share came out at 118%)."""
    run = wait = 0
    for thread, (ran, waited) in now.items():
        ran_before, waited_before = start.get(thread, (0, 0))
        if ran < ran_before or waited < waited_before:  # the id now names a new thread
            ran_before = waited_before = 0
        run, wait = run + ran - ran_before, wait + waited - waited_before
    return run / 1e9, wait / 1e9


def judge(cpu_share: float | None, load: float | None, cores: int, fewer_threads: bool = False) -> bool:
    """The rule: busy if the share fell below BUSY_SHARE or the load exceeds OVERLOAD x cores, or
    the forward ran on fewer threads than it was set up with (engine/threads.py)."""
    if fewer_threads or (cpu_share is not None and cpu_share < BUSY_SHARE):
        return True
    return load is not None and load > OVERLOAD * cores


def contention(
    cpu_share: float | None,
    load: float | None,
    n_cores: int,
    source: str = "schedstat",
    used: threads.ThreadsUsed | None = None,
) -> Contention:
    """`used`: the threads forwards ran on meanwhile (engine/threads.py)."""
    fewest, configured, share = (
        (used.fewest, used.configured, used.fewer_share) if used else (None, None, 0.0)
    )
    measured = Contention(cpu_share, source, load, n_cores, False, fewest, configured, share)
    busy = judge(cpu_share, load, n_cores, measured.fewer_threads)
    return dataclasses.replace(measured, busy=busy)


class ContentionMeter:
    """Started on the inference thread before a measurement; `stop()` judges the interval."""

    def __init__(self) -> None:
        self._wall = time.perf_counter()
        self._monotonic = time.monotonic()
        self._thread_cpu = time.thread_time()
        self._scheduled = scheduled()

    def stop(self, paused_s: float = 0.0) -> Contention:
        """The interval since the start; `paused_s` the time spent waiting for the user (step mode)."""
        wall = time.perf_counter() - self._wall - paused_s
        now = scheduled()
        run = wait = 0.0
        if self._scheduled is not None and now is not None:
            run, wait = grown(self._scheduled, now)
        if run + wait >= MIN_SCHEDSTAT_S:
            share, source = run / (run + wait), "schedstat"
        else:
            cpu = time.thread_time() - self._thread_cpu
            share = min(1.0, cpu / wall) if wall > 0 else None
            source = "thread_time"
        used = threads.used_since(self._monotonic, paused_s)
        return contention(share, load_1m(), cores(), source, used)
