"""Precision compare: the tiny model at fp32 against bf16, the second teacher-forced on the first."""

import pytest
import torch

from engine import models
from engine.events import TokenSampled
from engine.fast import fused
from engine.instruments.precision_compare import compare_precisions, compare_turn, turn_ids
from engine.kvcache import KVCache
from engine.sampling import SamplingSettings
from engine.session import ChatSession, Message


@pytest.fixture(scope="module")
def tiny_bf16(tiny_model_dir):
    return models.load(str(tiny_model_dir), "bf16", "cpu")


def test_fp32_against_bf16(tiny_loaded, tiny_bf16):
    session = ChatSession(tiny_loaded, SamplingSettings(temperature=0.0, max_new_tokens=12))
    greedy = [e.id for e in session.send("How does inference work?") if isinstance(e, TokenSampled)]
    result = compare_turn(session, tiny_bf16, max_new_tokens=12)
    assert [s.token for s in result.steps] == greedy  # the reference's own greedy answer
    assert result.prompt_tokens == len(session.trace.prompt_ids)
    assert all(s.kl >= 0 for s in result.steps) and result.mean_kl > 0
    assert 0.0 <= result.agreement <= 1.0
    assert result.agreement == sum(s.other_top == s.token for s in result.steps) / len(result.steps)
    first = result.first_divergence
    if first is None:
        assert result.agreement == 1.0
    else:
        assert all(s.agree for s in result.steps[: first.step]) and not first.agree
    assert (result.reference.precision, result.other.precision) == ("fp32", "bf16")
    assert result.other.weight_bytes < 0.6 * result.reference.weight_bytes
    assert result.reference.prefill_s > 0 and result.other.itl_p50_s > 0 and result.other.decode_tok_s > 0


def test_a_model_against_itself_agrees_everywhere(tiny_loaded):
    session = ChatSession(tiny_loaded)
    session.messages.append(Message("user", "unhappiness"))
    result = compare_precisions(tiny_loaded, tiny_loaded, turn_ids(session), max_new_tokens=6)
    assert len(result.steps) == 6
    assert result.agreement == 1.0 and result.first_divergence is None
    assert result.mean_kl == pytest.approx(0.0, abs=1e-6)
    assert all(s.ref_prob == pytest.approx(s.other_prob, abs=1e-6) for s in result.steps)


def test_kl_matches_a_direct_computation(tiny_loaded, tiny_bf16):
    ids = ChatSession(tiny_loaded).template([Message("user", "Paris")])
    result = compare_precisions(tiny_loaded, tiny_bf16, ids, max_new_tokens=1)
    with torch.inference_mode():  # the forward the chat loop runs: the fast path

        def logprobs(loaded):
            logits = fused.for_model(loaded.model).forward(
                torch.tensor([ids]), KVCache.for_model(loaded.info)
            )
            return torch.log_softmax(logits.float(), -1)

        p, q = logprobs(tiny_loaded), logprobs(tiny_bf16)
    assert result.steps[0].kl == pytest.approx(float((p.exp() * (p - q)).sum()), rel=1e-3, abs=1e-6)
    assert result.steps[0].token == int(p.argmax()) and result.steps[0].other_top == int(q.argmax())


def test_nothing_to_compare(tiny_loaded):
    with pytest.raises(ValueError):
        turn_ids(ChatSession(tiny_loaded))
    with pytest.raises(ValueError):
        compare_precisions(tiny_loaded, tiny_loaded, [])
