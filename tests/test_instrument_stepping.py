"""Step mode: each drawn token waits at the gate until the caller picks the one to take."""

import math
import queue
import threading
import time

import pytest
import torch

from engine.events import StepPaused, TokenSampled, TurnFinished, to_json
from engine.instruments.stepping import StepGate
from engine.sampling import SamplingSettings
from engine.session import ChatSession

SETTINGS = SamplingSettings(temperature=1.0, seed=3, max_new_tokens=8)


def test_each_step_takes_what_the_caller_chose(tiny_loaded):
    session = ChatSession(tiny_loaded, SETTINGS)
    session.step_gate.pause()
    choices: list[tuple[str, StepPaused, int]] = []
    for event in session.send("How does inference work?"):
        if isinstance(event, StepPaused):
            pick = ("sampled", "greedy", "alternative")[event.index % 3]
            if pick == "sampled":
                token = session.step_gate.take().id
            elif pick == "greedy":
                token = session.step_gate.take_greedy().id
            else:
                token = next(
                    (c.id for c in event.top_k[1:] if c.id not in session.stop_ids), event.top_k[0].id
                )
                session.step_gate.take(token)
            choices.append((pick, event, token))
    steps = session.trace.steps
    assert [t.id for t in steps] == [token for _, _, token in choices]
    assert [event.index for _, event, _ in choices] == list(range(len(steps)))
    for (pick, event, token), step in zip(choices, steps):
        assert event.greedy.id == event.top_k[0].id and event.position == step.position
        if pick == "sampled":
            assert token == event.sampled.id
        else:
            rank = [c.id for c in event.top_k].index(token) + 1
            prob = event.top_k[rank - 1].prob
            assert step.rank == rank and step.logprob == pytest.approx(math.log(prob), abs=1e-6)
        if pick == "greedy":
            assert step.rank == 1


def test_waiting_is_not_counted_as_latency(tiny_loaded):
    session = ChatSession(tiny_loaded, SamplingSettings(temperature=0.0, max_new_tokens=3))
    session.step_gate.pause()
    started, slept = time.perf_counter(), 0.0
    for event in session.send("Paris"):
        if isinstance(event, StepPaused):
            time.sleep(0.3)
            slept += 0.3
            session.step_gate.take()
    elapsed = time.perf_counter() - started
    # Counted, the waits alone would sum to `slept`; left out, the latencies fit in what remains
    # (an inequality within one run, whatever the machine's load).
    assert sum(s.latency_s for s in session.trace.steps) <= elapsed - slept


def run_in_thread(session: ChatSession, text: str) -> tuple[threading.Thread, "queue.Queue"]:
    events: queue.Queue = queue.Queue()

    def work():
        for event in session.send(text):
            events.put(event)
        events.put(None)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    return thread, events


def next_of(events: "queue.Queue", kind):
    while True:
        event = events.get(timeout=30)
        if event is None or isinstance(event, kind):
            return event


def test_resume_runs_the_rest_at_full_speed(tiny_loaded):
    session = ChatSession(tiny_loaded, SamplingSettings(temperature=0.0, max_new_tokens=8))
    session.step_gate.pause()
    thread, events = run_in_thread(session, "How does inference work?")
    assert next_of(events, StepPaused).index == 0
    session.step_gate.take()
    assert next_of(events, StepPaused).index == 1
    session.step_gate.resume()
    rest = []
    while (event := events.get(timeout=30)) is not None:
        assert not isinstance(event, StepPaused)
        rest.append(event)
    thread.join(5)
    assert isinstance(rest[-1], TurnFinished) and rest[-1].stats.stop in ("length", "eos")


def test_cancel_releases_a_waiting_step(tiny_loaded):
    session = ChatSession(tiny_loaded, SamplingSettings(temperature=0.0, max_new_tokens=8))
    session.step_gate.pause()
    thread, events = run_in_thread(session, "How does inference work?")
    assert next_of(events, StepPaused).index == 0
    session.cancel.set()
    finished = next_of(events, TurnFinished)
    thread.join(5)
    assert finished.stats.stop == "cancelled" and finished.stats.generated_tokens == 1
    assert session.step_gate.pending is None


def test_the_gate_refuses_what_it_cannot_take(tiny_loaded):
    gate = StepGate()
    with pytest.raises(RuntimeError, match="no step"):
        gate.take()
    session = ChatSession(tiny_loaded, SamplingSettings(temperature=0.0, max_new_tokens=2))
    session.step_gate.pause()
    for event in session.send("Paris"):
        if isinstance(event, StepPaused):
            offered = {c.id for c in event.top_k} | {event.sampled.id}
            with pytest.raises(ValueError):
                session.step_gate.take(next(i for i in range(1000) if i not in offered))
            session.step_gate.take()


def test_step_mode_off_never_pauses(tiny_loaded):
    session = ChatSession(tiny_loaded, SamplingSettings(temperature=0.0, max_new_tokens=4))
    events = list(session.send("Paris"))
    assert not any(isinstance(e, StepPaused) for e in events)
    assert len([e for e in events if isinstance(e, TokenSampled)]) >= 1


def test_a_paused_step_as_json(tiny_loaded):
    session = ChatSession(tiny_loaded, SamplingSettings(temperature=0.0, max_new_tokens=1))
    session.step_gate.pause()
    for event in session.send("Paris"):
        if isinstance(event, StepPaused):
            line = to_json(event)
            session.step_gate.take()
    assert line["event"] == "step_paused" and line["greedy"] == line["top_k"][0]["id"] == line["sampled"]


def test_a_paused_step_gives_the_models_own_probability_beside_the_drawn_one(tiny_loaded):
    """Top-p renormalizes: the step sheet read 'drew five (100.0%)' where F4 showed the model's
    91.91%; both are given, each named."""
    from tui.screens.step import waiting_line

    session = ChatSession(tiny_loaded, SamplingSettings(temperature=0.7, top_p=0.5, seed=1, max_new_tokens=1))
    session.step_gate.pause()
    for event in session.send("How does inference work?"):
        if isinstance(event, StepPaused):
            paused = event
            session.step_gate.take()
    with torch.inference_mode():  # the same prompt through the model alone: its own distribution
        model = torch.softmax(ChatSession(tiny_loaded, SETTINGS).forward(list(session.trace.prompt_ids)), -1)
    assert paused.model_probs == pytest.approx(
        (model[paused.sampled.id].item(), model[paused.greedy.id].item())
    )
    assert paused.sampled.prob > paused.model_probs[0]  # after temperature 0.7 and top-p 0.5
    shown = waiting_line(paused).plain
    assert f"({paused.sampled.prob:.1%} as sampled, model {paused.model_probs[0]:.2%})" in shown
