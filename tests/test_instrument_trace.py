"""Token inspector: entropy and rank from the sampler, and the per-answer history on the session."""

import math

import pytest
import torch

from engine.events import TokenSampled, to_json
from engine.sampling import Draw, Sampler, SamplingSettings
from engine.session import ChatSession


def test_entropy_and_rank_come_from_the_drawn_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 3.0])
    sampler = Sampler(SamplingSettings(temperature=1.0, seed=7), show_top_k=5)
    draw = sampler.sample(logits, torch.empty(0, dtype=torch.long))
    probs = torch.softmax(logits, dim=-1)
    assert draw.entropy == pytest.approx(float(-(probs * probs.log()).sum()), rel=1e-5)
    order = torch.argsort(logits, descending=True).tolist()
    assert draw.rank == order.index(draw.id) + 1
    assert draw.greedy_id == 4


def test_entropy_ignores_tokens_the_filters_removed():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 3.0])
    draw = Sampler(SamplingSettings(temperature=0.0, top_k=2)).sample(
        logits, torch.empty(0, dtype=torch.long)
    )
    kept = torch.softmax(torch.tensor([3.0, 2.0]), dim=-1)
    assert draw.entropy == pytest.approx(float(-(kept * kept.log()).sum()), rel=1e-5)
    assert (draw.id, draw.rank) == (4, 1)


def test_the_sampler_copies_to_the_host_once_per_token(monkeypatch):
    calls = []
    for name in ("tolist", "item", "__int__", "__float__", "__bool__", "__index__"):
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _original=original, _name=name):
            calls.append(_name)
            return _original(self, *args)

        monkeypatch.setattr(torch.Tensor, name, counting)
    sampler = Sampler(SamplingSettings(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, seed=1))
    calls.clear()
    sampler.sample(torch.randn(300), torch.empty(0, dtype=torch.long))
    assert calls == ["tolist"]


def test_taking_an_alternative_keeps_the_distribution():
    draw = Draw(
        id=5, logprob=math.log(0.5), top_ids=[5, 9, 2], top_probs=[0.5, 0.3, 0.0], entropy=1.2, rank=1
    )
    other = draw.take(9)
    assert (other.id, other.rank, other.entropy) == (9, 2, 1.2)
    assert other.logprob == pytest.approx(math.log(0.3))
    assert draw.take(5) is draw
    with pytest.raises(ValueError, match="neither"):
        draw.take(77)
    with pytest.raises(ValueError, match="probability 0"):
        draw.take(2)


def test_each_answer_keeps_its_steps(tiny_loaded):
    session = ChatSession(tiny_loaded, SamplingSettings(temperature=0.0, max_new_tokens=8))
    first = [e for e in session.send("How does inference work?") if isinstance(e, TokenSampled)]
    second = [e for e in session.send("unhappiness") if isinstance(e, TokenSampled)]
    answers = [m for m in session.messages if m.role == "assistant"]
    assert [a.trace.steps for a in answers] == [first, second]
    assert session.trace is answers[-1].trace
    trace = answers[0].trace
    assert [s.position for s in trace.steps] == list(
        range(len(trace.prompt_ids), len(trace.prompt_ids) + len(first))
    )
    for step, event in enumerate(first):
        record = trace.record(step, session.namer)
        assert record.bytes == session.namer.token_bytes(event.id)
        assert record.rank == 1  # greedy takes the most probable token
        assert record.logprob == pytest.approx(math.log(event.top_k[0].prob), abs=1e-5)
        assert record.entropy > 0 and record.choices == pytest.approx(math.exp(record.entropy))
        assert record.top_k == event.top_k and record.position == event.position


def test_token_json_carries_entropy_and_rank(tiny_loaded):
    session = ChatSession(tiny_loaded, SamplingSettings(temperature=0.0, max_new_tokens=2))
    event = next(e for e in session.send("Paris") if isinstance(e, TokenSampled))
    line = to_json(event)
    assert line["rank"] == 1 and line["entropy"] == pytest.approx(event.entropy, abs=1e-6)
