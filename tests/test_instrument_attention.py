"""Attention view: eager only while on, rows that sum to 1, the same tokens as without it."""

import queue
import threading

import pytest

from engine.events import StepPaused, TokenSampled, TurnFinished
from engine.instruments.attention import (
    AttentionProbe,
    enable_and_view,
    enabled_view,
    existing_probe,
    probe_of,
    switch_off,
)
from engine.sampling import SamplingSettings
from engine.session import ChatSession
from engine.worker import InferenceWorker

GREEDY = SamplingSettings(temperature=0.0, max_new_tokens=8)


def greedy_ids(loaded, probe: bool) -> tuple[list[int], ChatSession, AttentionProbe]:
    session = ChatSession(loaded, GREEDY, system_prompt="Be brief.")
    attention = AttentionProbe(session)
    fast = getattr(session, "fast", None)
    if probe:
        attention.enable()
        assert getattr(session, "fast", None) is None  # the hooks need the HF forward
    try:
        ids = [e.id for e in session.send("How does inference work?") if isinstance(e, TokenSampled)]
    finally:
        if probe:
            view = attention.view()
            attention.disable()
            attention.last = view
    assert getattr(session, "fast", None) is fast
    return ids, session, attention


def test_decoded_tokens_are_unchanged_and_sdpa_comes_back(tiny_loaded):
    assert tiny_loaded.model.config._attn_implementation == "sdpa"
    plain, _, _ = greedy_ids(tiny_loaded, probe=False)
    probed, _, attention = greedy_ids(tiny_loaded, probe=True)
    assert probed == plain
    assert tiny_loaded.model.config._attn_implementation == "sdpa" and not attention.enabled
    assert attention.view() is None  # nothing kept once off
    assert attention.last is not None


def test_weights_sum_to_one_over_the_context(tiny_loaded):
    session = ChatSession(tiny_loaded, GREEDY, system_prompt="Be brief.")
    attention = AttentionProbe(session)
    attention.enable()
    session.step_gate.pause()
    seen = 0
    try:
        assert tiny_loaded.model.config._attn_implementation == "eager"
        for event in session.send("How does inference work?"):
            if not isinstance(event, StepPaused):
                continue
            for layer, head in ((0, 0), (1, 3), (None, None), (1, None)):
                view = attention.view(layer, head)
                assert len(view.weights) == len(view.ids) == event.position
                assert view.query_position == event.position - 1
                assert sum(view.weights) == pytest.approx(1.0, abs=1e-5)
                assert min(view.weights) >= 0.0
                assert sum(s.weight for s in view.spans) == pytest.approx(1.0, abs=1e-5)
                roles = [s.span.role for s in view.spans]
                assert roles == ["system", "user", "assistant"]
                assert view.ids == tuple(session.cache.ids)
            seen += 1
            session.step_gate.take()
        with pytest.raises(ValueError):
            attention.view(layer=7)
        with pytest.raises(ValueError):
            attention.view(layer=0, head=4)
    finally:
        attention.disable()
    assert seen >= 2


def test_heads_differ_and_the_mean_is_their_average(tiny_loaded):
    session = ChatSession(tiny_loaded, SamplingSettings(temperature=0.0, max_new_tokens=1))
    attention = AttentionProbe(session)
    attention.enable()
    try:
        list(session.send("The capital of France is"))
        heads = [attention.view(1, h).weights for h in range(4)]
        mean = attention.view(1, None).weights
    finally:
        attention.disable()
    assert len({tuple(round(w, 6) for w in h) for h in heads}) > 1
    for i, value in enumerate(mean):
        assert value == pytest.approx(sum(h[i] for h in heads) / 4, abs=1e-6)


def test_disable_after_a_model_switch_keeps_the_new_models_fast_path(tiny_model_dir):
    from engine import models
    from engine.instruments.attention import AttentionProbe
    from engine.session import ChatSession

    session = ChatSession(models.load(str(tiny_model_dir), "fp32", "cpu"))
    probe = AttentionProbe(session)
    probe.enable()
    session.use_model(models.load(str(tiny_model_dir), "bf16", "cpu"))
    new_fast = session.fast
    probe.disable()
    assert session.fast is new_fast is not None
    assert session.fast.weight_dtype.is_floating_point and str(session.fast.weight_dtype) == "torch.bfloat16"


def test_the_views_calls_reach_one_probe_per_session_through_the_worker(tiny_model_dir):
    """Idle: `call` switches the probe on and runs the last pass again. At the gate: `call_at_gate`
    reads at once what the probe holds, from the next step on. `switch_off` restores sdpa."""
    paused: queue.Queue = queue.Queue()
    finished = threading.Event()

    def emit(event) -> None:
        if isinstance(event, StepPaused):
            paused.put(event)
        elif isinstance(event, TurnFinished):
            finished.set()

    worker = InferenceWorker(emit, GREEDY)
    try:
        worker.load(str(tiny_model_dir), "fp32", "cpu")
        worker.send("How does inference work?")
        assert finished.wait(60)
        session = worker.session
        with pytest.raises(RuntimeError):
            worker.call_at_gate(lambda s: enabled_view(s, None, None))
        view = worker.call(lambda s: enable_and_view(s, 0, None)).result(60)
        assert view.layer == 0 and view.ids == tuple(session.cache.ids)
        probe = existing_probe(session)
        assert probe.enabled and worker.call(probe_of).result(60) is probe
        worker.call(switch_off).result(60)
        assert not probe.enabled and session.model.config._attn_implementation == "sdpa"

        finished.clear()
        session.step_gate.pause()
        worker.send("And Germany?")
        paused.get(timeout=60)
        assert worker.call_at_gate(lambda s: enabled_view(s, None, None)) is None
        session.step_gate.take()
        event = paused.get(timeout=60)
        view = worker.call_at_gate(lambda s: enabled_view(s, None, None))
        assert len(view.ids) == event.position and existing_probe(session) is probe
        session.step_gate.resume()
        assert finished.wait(60)
    finally:
        worker.call(switch_off).result(60)
        worker.shutdown()
