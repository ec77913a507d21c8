"""How many threads a forward runs on: the cores other programs leave free.

torch splits each matrix product and each of a compiled step's loops over its threads, and every
split waits at its end for the slowest thread (OpenMP's barrier). When another program keeps a
core busy, the thread that shares that core runs only part of the time and the whole step waits
for it, many times a step. On 2 cores beside one busy process the compiled decode step fell from
51 to 15-21 tok/s (ITL p90 118-164 ms) on 2 threads, and ran at 37 tok/s on 1 thread, as it does
on 1 thread when the machine is quiet (BENCHMARKS.md, "A busy core").

So the forward follows the machine: every WINDOW_S of forwards it reads how much CPU time others
took on this process's cores (/proc/stat's busy time, less this process's own: a compile child is
another program) and runs on the cores they left, never more than it was configured with. The
figures of anything measured meanwhile say it ran on fewer (a busy machine: slower than the
model's own speed; engine/contention.py).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

WINDOW_S = 0.5
"""Time between two decisions: /proc/stat counts in 10 ms ticks, so 2 cores give ~100 ticks a
window; a decode step is 20-50 ms, so a window is 10-25 steps."""
STALE_S = 60.0
"""A longer window (the app sat idle) says little about now: it starts afresh. A shorter one, the
user reading or typing, still decides the turn's first forward: a program busy all along is
likely busy still, and a prompt's prefill on a shared core took 1.2 s instead of 0.1."""
_TICK_S = 1 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01
_STAT = Path("/proc/stat")
_SELF_STAT = Path("/proc/self/stat")

_configured: int | None = None


def configured() -> int:
    """The threads this process runs on when the cores are free: torch's count as set up, before
    a governor lowered it (keys of saved compiled steps and calibrations use it)."""
    global _configured
    if _configured is None:
        _configured = torch.get_num_threads()
    return _configured


def restore() -> None:
    """Back to the configured threads, whatever a governor set."""
    if torch.get_num_threads() != configured():
        _set(configured())


def configure(threads: int) -> None:
    """Set the configured count (`llmchat lab batching --threads`) and run on it now."""
    global _configured
    _configured = threads
    _set(threads)


@dataclass(frozen=True)
class CpuTimes:
    """CPU seconds used so far on this process's cores: by anything, and by this process."""

    busy_s: float
    own_s: float
    at: float


def cpu_times() -> CpuTimes | None:
    """A reading of /proc/stat's per-core busy time (all but idle and iowait) on the cores this
    process may use, and of this process's own time; None where Linux's /proc is missing."""
    mine = {f"cpu{n}" for n in os.sched_getaffinity(0)} if hasattr(os, "sched_getaffinity") else None
    try:
        lines = _STAT.read_text().splitlines()
        own = _SELF_STAT.read_text().rsplit(")", 1)[1].split()  # the name may hold spaces
    except OSError:
        return None
    busy = 0
    for line in lines:
        name, *ticks = line.split()
        if name.startswith("cpu") and name != "cpu" and (mine is None or name in mine):
            counts = [int(t) for t in ticks[:8]]  # user nice system idle iowait irq softirq steal
            busy += sum(counts) - counts[3] - counts[4]
    # utime and stime, fields 14 and 15 of the whole line; index 11 and 12 after the name.
    return CpuTimes(busy * _TICK_S, (int(own[11]) + int(own[12])) * _TICK_S, time.monotonic())


def others_cores(start: CpuTimes, now: CpuTimes) -> float:
    """How many of this process's cores other programs kept busy between two readings, on average."""
    wall = now.at - start.at
    if wall <= 0:
        return 0.0
    return max(0.0, (now.busy_s - start.busy_s) - (now.own_s - start.own_s)) / wall


def fitting(threads: int, most: int, free: float) -> int:
    """The threads to run on, given `free` cores on average: fewer as soon as one thread would share
    its core with another program half the time; more again only once a whole core is clearly
    free (so a program that comes and goes does not flip it every window)."""
    if free < threads - 0.5:
        return max(1, min(most, math.floor(free + 0.5)))
    if free > threads + 0.7:
        return min(most, math.floor(free + 0.3))
    return threads


class ThreadGovernor:
    """Called before each forward on the inference thread; sets torch's threads every WINDOW_S."""

    def __init__(self) -> None:
        self._start = cpu_times()

    def follow(self) -> None:
        now = time.monotonic()
        if self._start is None or now - self._start.at < WINDOW_S:
            return
        reading = cpu_times()
        if reading is None:
            return
        if now - self._start.at <= STALE_S:
            free = cores() - others_cores(self._start, reading)
            threads = fitting(torch.get_num_threads(), configured(), free)
            if threads != torch.get_num_threads():
                _set(threads)
        self._start = reading


_changes: list[tuple[float, int]] = []
"""(monotonic time, threads from then on) for each change a governor made, the latest last."""


def _set(threads: int) -> None:
    torch.set_num_threads(threads)
    _changes.append((time.monotonic(), threads))
    del _changes[:-256]


@dataclass(frozen=True)
class ThreadsUsed:
    """The threads forwards could run on over an interval."""

    fewest: int
    configured: int
    fewer_share: float
    """The share of the interval spent on fewer than `configured`, 0..1."""


def used_since(at: float, paused_s: float = 0.0) -> ThreadsUsed:
    """Since monotonic time `at` (a meter's start), less `paused_s` waiting for the user."""
    most, now = configured(), time.monotonic()
    before = [n for t, n in _changes if t <= at]
    current, since = (before[-1] if before else most), at
    fewest, fewer_s = current, 0.0
    for t, n in _changes:
        if t > at:
            fewer_s += t - since if current < most else 0.0
            current, since, fewest = n, t, min(fewest, n)
    fewer_s += now - since if current < most else 0.0
    wall = now - at - paused_s
    return ThreadsUsed(fewest, most, min(1.0, fewer_s / wall) if wall > 0 else 0.0)


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
