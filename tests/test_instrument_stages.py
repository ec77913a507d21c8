"""Sampler stages: the chain applied stage by stage ends where the sampler's own distribution does."""

import pytest
import torch

from engine.events import StepPaused, TokenSampled
from engine.instruments.stages import pending_stages, sampler_stages, stages_at
from engine.sampling import Sampler, SamplingSettings
from engine.session import ChatSession

ALL_ON = SamplingSettings(temperature=0.7, top_k=20, top_p=0.8, min_p=0.05, repetition_penalty=1.3)


def test_the_last_stage_is_the_samplers_distribution():
    torch.manual_seed(0)
    logits, seen = torch.randn(200) * 3, torch.tensor([1, 5, 7, 5])
    stages = sampler_stages(logits, seen, ALL_ON, show=200)
    expected = Sampler(ALL_ON).distribution(logits, seen).exp()
    final = {c.id: c.prob for c in stages.final.top}
    assert len(final) == int((expected > 0).sum()) == stages.final.kept
    for token, prob in final.items():
        assert prob == pytest.approx(float(expected[token]), rel=1e-5)
    assert [s.name for s in stages.stages] == [
        "model",
        "repetition penalty",
        "temperature",
        "top-k",
        "top-p",
        "min-p",
    ]
    assert all(s.active for s in stages.stages[1:])


def test_each_stage_says_what_it_removed():
    logits = torch.arange(50, dtype=torch.float32)  # token 49 most probable, 0 least
    stages = sampler_stages(
        logits, torch.empty(0, dtype=torch.long), SamplingSettings(temperature=1.0, top_k=5), show=3
    )
    by_name = {s.name: s for s in stages.stages}
    top_k = by_name["top-k"]
    assert (top_k.kept, top_k.removed) == (5, 45)
    assert [c.id for c in top_k.removed_top] == [44, 43, 42]  # the most probable of the removed
    before = torch.softmax(logits, dim=-1)
    assert top_k.removed_top[0].prob == pytest.approx(float(before[44]))
    assert [c.id for c in top_k.top] == [49, 48, 47]
    assert top_k.top[0].prob == pytest.approx(float(torch.softmax(logits[45:], dim=-1)[-1]))
    for name, kept in (("repetition penalty", 50), ("temperature", 50), ("top-p", 5), ("min-p", 5)):
        assert (by_name[name].active, by_name[name].removed, by_name[name].kept) == (False, 0, kept)


def test_temperature_reshapes_without_removing():
    logits = torch.tensor([2.0, 1.0, 0.0])
    cold = sampler_stages(logits, torch.empty(0, dtype=torch.long), SamplingSettings(temperature=0.5)).stages[
        2
    ]
    assert cold.name == "temperature" and cold.removed == 0 and cold.kept == 3
    assert cold.top[0].prob == pytest.approx(float(torch.softmax(logits / 0.5, dim=-1)[0]))
    assert cold.top[0].prob > float(torch.softmax(logits, dim=-1)[0])


def test_stages_of_a_past_step_match_what_the_answer_showed(tiny_loaded):
    session = ChatSession(tiny_loaded, SamplingSettings(temperature=0.0, max_new_tokens=6))
    steps = [e for e in session.send("How does inference work?") if isinstance(e, TokenSampled)]
    for step in (0, len(steps) - 1):
        stages = stages_at(session, step)
        assert stages.greedy
        shown = steps[step].top_k
        assert [c.id for c in stages.final.top[: len(shown)]] == [c.id for c in shown]
        for mine, theirs in zip(stages.final.top, shown):
            assert mine.prob == pytest.approx(theirs.prob, abs=1e-4)
    with pytest.raises(ValueError):
        stages_at(session, len(steps))


def test_stages_of_the_step_waiting_in_step_mode(tiny_loaded):
    settings = SamplingSettings(temperature=0.9, top_k=5, repetition_penalty=1.2, seed=4, max_new_tokens=3)
    session = ChatSession(tiny_loaded, settings)
    assert pending_stages(session) is None
    session.step_gate.pause()
    checked = 0
    for event in session.send("How does inference work?"):
        if isinstance(event, StepPaused):
            stages = pending_stages(session)
            assert [(c.id, round(c.prob, 5)) for c in stages.final.top] == [
                (c.id, round(c.prob, 5)) for c in event.top_k
            ]
            assert stages.final.kept == 5 and not stages.greedy
            checked += 1
            session.step_gate.take()
    assert checked == 3
