"""The logit lens and ablation on every family the fast path covers (Llama, Qwen2, Qwen3, Gemma 3,
Phi-3; tiny random weights), each checked against the model's own forward computed another way."""

from __future__ import annotations

import math

import pytest
import torch

from engine import models
from engine.instruments.ablation import MLP, Part, ablate, head_dim, next_token_probs
from engine.instruments.logit_lens import context_before, final_head, logit_lens
from engine.sampling import SamplingSettings
from engine.session import ChatSession
from tests.tiny import build_tiny_model

FAMILIES = ["llama", "qwen2", "qwen3", "gemma3_text", "phi3"]
GREEDY = SamplingSettings(temperature=0.0, max_new_tokens=6)


@pytest.fixture(scope="module", params=FAMILIES)
def step(request, tmp_path_factory):
    """A session after a short answer, and the context before its third step with the token taken."""
    directory = build_tiny_model(tmp_path_factory.mktemp(request.param), family=request.param)
    session = ChatSession(models.load(str(directory), "fp32", "cpu"), GREEDY)
    list(session.send("How does inference work?"))
    ids, chosen = context_before(session.messages[-1].trace, 2)
    return session, ids, chosen


def test_the_lens_reads_each_layer_and_ends_on_the_models_own_distribution(step):
    session, ids, chosen = step
    lens = logit_lens(session, ids, chosen)
    model = session.model
    assert len(lens.layers) == model.config.get_text_config().num_hidden_layers
    assert lens.final_gap < 1e-5  # after the last layer: the model's own head, its own answer
    own = next_token_probs(session, ids)
    assert lens.chosen.prob == pytest.approx(float(own[chosen]), abs=1e-6)
    assert lens.position == len(ids) - 1
    # transformers' own hidden states (the input to each later layer) read through the same head
    with torch.inference_mode():
        hidden = model(
            input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False
        ).hidden_states
        head = final_head(model)
        for layer, reading in enumerate(lens.layers[:-1]):
            probs = torch.softmax(head(hidden[layer + 1][:, -1:])[0, -1], -1)
            assert reading.top[0].id == int(probs.argmax())
            assert reading.chosen_prob == pytest.approx(float(probs[chosen]), abs=1e-5)
            entropy = float(-(probs * probs.clamp_min(1e-30).log()).sum()) / math.log(2)
            assert reading.entropy_bits == pytest.approx(entropy, abs=1e-3)
    for reading in lens.layers:
        assert [g.prob for g in reading.top] == sorted((g.prob for g in reading.top), reverse=True)
        assert reading.chosen_rank >= 1 and 0 <= reading.entropy_bits


def _with_weights_zeroed(session, ids, zeroed: list[tuple[torch.Tensor, tuple]]) -> torch.Tensor:
    """The next-token probabilities with some weight slices zeroed, then put back."""
    kept = [(w, where, w[where].clone()) for w, where in zeroed]
    try:
        with torch.no_grad():
            for w, where, _ in kept:
                w[where] = 0
        return next_token_probs(session, ids)
    finally:
        with torch.no_grad():
            for w, where, saved in kept:
                w[where] = saved


def test_a_head_off_is_its_columns_of_o_proj_zeroed_and_an_mlp_off_its_down_proj(step):
    session, ids, chosen = step
    model = session.model
    plain = next_token_probs(session, ids)
    layer = model.model.layers[0]
    size = head_dim(model)
    head = ablate(session, ids, chosen, Part(0, 1))
    columns = (slice(None), slice(size, 2 * size))
    by_weights = _with_weights_zeroed(session, ids, [(layer.self_attn.o_proj.weight, columns)])
    assert [g.prob for g in head.after] == pytest.approx(
        [float(by_weights[g.id]) for g in head.after], abs=1e-5
    )
    down = layer.mlp.down_proj
    zeroed = [(down.weight, (slice(None),))] + (
        [(down.bias, (slice(None),))] if down.bias is not None else []
    )
    mlp = ablate(session, ids, chosen, Part(0, MLP))
    by_weights = _with_weights_zeroed(session, ids, zeroed)
    assert [g.prob for g in mlp.after] == pytest.approx(
        [float(by_weights[g.id]) for g in mlp.after], abs=1e-5
    )
    for a in (head, mlp):
        assert a.kl_nats > 0 and a.before[0].prob >= a.before[-1].prob
        assert a.chosen.prob == pytest.approx(float(plain[chosen]), abs=1e-6)
    assert torch.equal(next_token_probs(session, ids), plain)  # the hooks are gone: as it was


def test_a_part_that_does_not_exist_is_refused_in_one_line(step):
    session, ids, chosen = step
    with pytest.raises(ValueError, match=r"layer must be in \[0, 1\], got 7"):
        ablate(session, ids, chosen, Part(7, MLP))
    with pytest.raises(ValueError, match=r"head must be in"):
        ablate(session, ids, chosen, Part(0, 99))
