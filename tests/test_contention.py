"""A figure measured on a busy machine says so: the CPU share a turn got, and the rule that flags it."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from engine import contention
from engine.contention import BUSY_SHARE, ContentionMeter, judge
from engine.events import Contention, TurnFinished, to_json
from engine.sampling import SamplingSettings
from engine.session import ChatSession, Message

S = 10**9
"""A second in schedstat's nanoseconds."""


# -- the rule, with injected numbers ----------------------------------------------------------
@pytest.mark.parametrize(
    ("share", "load", "cores", "busy"),
    [
        (0.98, 0.9, 2, False),  # an idle machine
        (0.83, 2.5, 2, False),  # some other work, the figures barely touched
        (0.69, 1.0, 2, True),  # under BUSY_SHARE: flagged whatever the load says (it lags)
        (0.45, None, 2, True),
        (0.95, 4.1, 2, True),  # over OVERLOAD x cores: others queued for every core
        (0.95, 4.0, 2, False),
        (None, None, 4, False),  # nothing measurable: nothing claimed
        (None, 9.0, 4, True),
    ],
)
def test_the_busy_rule(share, load, cores, busy):
    assert judge(share, load, cores) is busy


def test_a_busy_turn_says_so_in_words():
    busy = contention.contention(0.45, 3.14, 2)
    assert (
        busy.busy and busy.describe() == "busy machine: figures slowed (CPU share 45%, load 3.1 on 2 cores)"
    )
    calm = contention.contention(0.97, 0.4, 2)
    assert not calm.busy and calm.describe() == "CPU share 97%, load 0.4 on 2 cores"
    assert contention.contention(None, None, 2).describe() == ""


def test_the_share_is_run_time_over_run_plus_run_queue_wait(monkeypatch):
    readings = iter([{"7": (10 * S, 1 * S)}, {"7": (10.6 * S, 1.6 * S)}])  # 0.6 s run, 0.6 s waited
    monkeypatch.setattr(contention, "scheduled", lambda: next(readings))
    monkeypatch.setattr(contention, "load_1m", lambda: 1.0)
    measured = ContentionMeter().stop()
    assert measured.cpu_share == pytest.approx(0.5) and measured.source == "schedstat" and measured.busy


def test_a_thread_that_ended_or_started_meanwhile_cannot_lift_the_share_past_one(monkeypatch):
    """Thread 8 had waited 1 s when the measurement started and ended before it stopped; 9 started
    meanwhile. The difference of the sums gave run 1.0 s against wait -0.8 s: a share of 500%."""
    start = {"7": (1 * S, S // 2), "8": (1 * S, 1 * S)}
    now = {"7": (int(2.5 * S), int(0.6 * S)), "9": (S // 2, S // 10)}
    readings = iter([start, now])
    monkeypatch.setattr(contention, "scheduled", lambda: next(readings))
    monkeypatch.setattr(contention, "load_1m", lambda: 0.5)
    measured = ContentionMeter().stop()
    assert measured.cpu_share == pytest.approx(2.0 / 2.2)  # 7: 1.5 s run, 0.1 waited; 9: 0.5, 0.1
    assert measured.source == "schedstat" and not measured.busy


def test_over_an_interval_too_short_for_schedstat_the_thread_time_stands_in(monkeypatch):
    readings = iter([{"7": (10 * S, S)}] * 2)  # not moved yet: the kernel adds run time at ticks
    monkeypatch.setattr(contention, "scheduled", lambda: next(readings))
    meter = ContentionMeter()
    end = time.thread_time() + 0.01
    while time.thread_time() < end:
        pass
    measured = meter.stop()
    assert measured.source == "thread_time" and 0 < measured.cpu_share <= 1


def test_without_schedstat_the_thread_time_stands_in(monkeypatch):
    monkeypatch.setattr(contention, "scheduled", lambda: None)
    meter = ContentionMeter()
    end = time.thread_time() + 0.05
    while time.thread_time() < end:  # busy: this thread's CPU time grows with the wall time
        pass
    measured = meter.stop()
    assert measured.source == "thread_time" and 0 < measured.cpu_share <= 1


# -- a real turn ------------------------------------------------------------------------------
def _turn(loaded, tokens: int) -> tuple[ChatSession, Contention]:
    session = ChatSession(loaded, SamplingSettings(temperature=0.0, max_new_tokens=tokens))
    ids = session.template([Message("user", "How does inference work?")])
    run = session.run(ids, stop_at_eos=False)
    while True:
        try:
            next(run)
        except StopIteration as done:
            return session, done.value[1].contention


def test_every_turn_carries_the_share_it_was_measured_at(tiny_loaded):
    session = ChatSession(tiny_loaded, SamplingSettings(temperature=0.0, max_new_tokens=4))
    finished = [e for e in session.send("How does inference work?") if isinstance(e, TurnFinished)]
    measured = finished[0].stats.contention
    assert measured is not None and 0 < measured.cpu_share <= 1  # busy or not: the CI machine decides
    assert measured.cores == contention.cores() and measured.source in ("schedstat", "thread_time")
    line = json.loads(json.dumps(to_json(finished[0])))
    assert line["contention"]["cpu_share"] == round(measured.cpu_share, 3)
    assert line["contention"]["busy"] == measured.busy


def test_a_turn_beside_busy_processes_is_flagged(tiny_loaded):
    # Twice as many spinning processes as cores: the turn gets about a third of a core's time.
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * contention.cores())
    ]
    try:
        time.sleep(0.3)  # the scheduler has them running
        measured = None
        for _ in range(5):  # a turn long enough to be scheduled against them (about half a second)
            started = time.perf_counter()
            _, measured = _turn(tiny_loaded, 120)
            if time.perf_counter() - started > 0.3:
                break
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert measured is not None and measured.cpu_share < BUSY_SHARE, measured
    described = measured.describe()  # the governor may have taken a thread too (engine/threads.py)
    assert (
        measured.busy and described.startswith("busy machine: figures slowed (") and "CPU share" in described
    )
