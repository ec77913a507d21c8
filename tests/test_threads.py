"""A forward runs on the cores other programs leave free (engine/threads.py), and says when it ran
on fewer: one busy program on a 2-core machine made a 2-thread decode step 2.5-3.4x slower."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from typing import Iterator

import pytest
import torch

from engine import contention, threads
from engine.sampling import SamplingSettings
from engine.session import ChatSession, Message


@pytest.mark.parametrize(
    ("threads_now", "most", "free", "wanted"),
    [
        (2, 2, 1.95, 2),  # quiet
        (2, 2, 1.33, 1),  # a busy program shares our second core a third of the time: give it the core
        (1, 2, 1.0, 1),  # it has the core to itself now: stay
        (1, 2, 1.6, 1),  # a program that comes and goes: not yet
        (1, 2, 1.9, 2),  # it went
        (2, 2, 1.6, 2),  # a tenth of a core taken now and then: not worth a thread
        (8, 8, 6.2, 6),
        (1, 1, 0.2, 1),  # never below one
        (4, 8, 15.0, 8),  # never above the configured count
    ],
)
def test_the_threads_fit_the_free_cores(threads_now, most, free, wanted):
    assert threads.fitting(threads_now, most, free) == wanted


def test_the_share_of_an_interval_on_fewer_threads(monkeypatch):
    monkeypatch.setattr(threads, "_configured", 2)
    monkeypatch.setattr(threads, "_changes", [(5.0, 1), (10.0, 2), (14.0, 1)])
    monkeypatch.setattr(threads.time, "monotonic", lambda: 16.0)
    used = threads.used_since(8.0)  # on 1 from 8 to 10, on 2 to 14, on 1 to 16: 4 s of 8
    assert (used.fewest, used.configured, used.fewer_share) == (1, 2, pytest.approx(0.5))
    assert threads.used_since(11.0, paused_s=1.0).fewer_share == pytest.approx(0.5)  # 2 s of 4
    assert threads.used_since(20.0 - 5.0 + 0.5).fewest == 1  # began on 1: no change since


def test_a_turn_on_fewer_threads_says_so():
    used = threads.ThreadsUsed(fewest=1, configured=2, fewer_share=0.4)
    measured = contention.contention(0.97, 0.9, 2, used=used)
    assert measured.busy
    assert measured.describe() == (
        "busy machine: figures slowed"
        " (ran on 1 of 2 threads 40% of the time, CPU share 97%, load 0.9 on 2 cores)"
    )
    briefly = contention.contention(0.97, 0.9, 2, used=threads.ThreadsUsed(1, 2, 0.05))
    assert not briefly.busy and "threads" not in briefly.describe()


def _two_cores() -> tuple[int, int]:
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2 or threads.cpu_times() is None:
        pytest.skip("needs Linux's /proc/stat and two cores")
    return mine[0], mine[1]


def _follow_until(governor: threads.ThreadGovernor, wanted: int, seconds: float) -> int:
    end = time.monotonic() + seconds
    while time.monotonic() < end and torch.get_num_threads() != wanted:
        governor.follow()
        torch.ones(256, 256) @ torch.ones(256, 256)  # a forward's work between decisions
        time.sleep(0.01)
    return torch.get_num_threads()


@contextlib.contextmanager
def _beside_a_busy_program(monkeypatch) -> Iterator[subprocess.Popen]:
    """This process on two cores and 2 threads, a spinning process on the second: yields it
    (killed on the way out, if not before), and gives this process its cores back after."""
    first, second = _two_cores()
    affinity = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {first, second})
    monkeypatch.setattr(threads, "_configured", 2)
    torch.set_num_threads(2)
    hog = subprocess.Popen(
        [sys.executable, "-c", "while True: pass"], preexec_fn=lambda: os.sched_setaffinity(0, {second})
    )
    try:
        yield hog
    finally:
        hog.kill()
        hog.wait()
        os.sched_setaffinity(0, affinity)


def test_a_busy_program_takes_a_thread(monkeypatch):
    """A real spinning process on one of this process's two cores: the governor drops to one
    thread within a couple of windows (more load elsewhere only makes that surer)."""
    with _beside_a_busy_program(monkeypatch):
        started = time.monotonic()
        governor = threads.ThreadGovernor()
        assert _follow_until(governor, 1, 5 * threads.WINDOW_S) == 1
        used = threads.used_since(started)
        assert used.fewest == 1 and used.configured == 2


def test_the_thread_comes_back_once_the_others_stop(monkeypatch):
    """Readings of the CPU time (a real machine's other load cannot be promised away): others
    took a core, then nothing; the governor drops to one thread, then goes back to two."""
    monkeypatch.setattr(threads, "_configured", 2)
    monkeypatch.setattr(threads, "cores", lambda: 2)
    torch.set_num_threads(2)
    clock = iter([0.0, 0.6, 1.2, 1.8])
    busy = iter([(0.0, 0.0), (1.2, 0.6), (1.8, 1.2), (2.4, 1.8)])  # (everyone's, ours) seconds

    def reading() -> threads.CpuTimes:
        (all_s, own_s), at = next(busy), next(clock)
        return threads.CpuTimes(all_s, own_s, at)

    monkeypatch.setattr(threads, "cpu_times", reading)
    now = [0.0]
    monkeypatch.setattr(threads.time, "monotonic", lambda: now[0])
    governor = threads.ThreadGovernor()
    now[0] = 0.6  # others: 1.2 - 0.6 = 0.6 s over 0.6 s, a whole core
    governor.follow()
    assert torch.get_num_threads() == 1
    for now[0] in (1.2, 1.8):  # others: nothing
        governor.follow()
    assert torch.get_num_threads() == 2


def test_a_turn_beside_a_busy_program_runs_on_the_free_core_and_says_so(tiny_loaded, monkeypatch):
    with _beside_a_busy_program(monkeypatch):
        session = ChatSession(tiny_loaded, SamplingSettings(temperature=0.0, max_new_tokens=400))
        time.sleep(2 * threads.WINDOW_S)  # the user typed: the first forward decides on this window
        run = session.run(session.template([Message("user", "How does inference work?")]), stop_at_eos=False)
        while True:
            try:
                next(run)
            except StopIteration as done:
                measured = done.value[1].contention
                break
    assert measured.threads == 1 and measured.configured_threads == 2, measured
    assert measured.fewer_share > 0.9 and measured.busy
    assert "ran on 1 of 2 threads" in measured.describe()
