"""Attention over the whole prompt, and heads grouped by K/V head, on the tiny GQA model (4 heads, 2 K/V)."""

import pytest
import torch

from engine import models
from engine.instruments import attention_matrix
from engine.instruments.attention import enable_and_view, kv_groups, kv_head_of, probe_of
from engine.instruments.attention_matrix import is_sink, layer_weights, prefill_matrix
from engine.sampling import SamplingSettings
from engine.session import ChatSession

GREEDY = SamplingSettings(temperature=0.0, max_new_tokens=6)


def answered(loaded) -> ChatSession:
    session = ChatSession(loaded, GREEDY, system_prompt="Be brief.")
    list(session.send("How does inference work?"))
    return session


def test_kv_groups_follow_repeat_kv():
    assert kv_groups(9, 3) == ((0, 1, 2), (3, 4, 5), (6, 7, 8))  # SmolLM2
    assert kv_groups(4, 2) == ((0, 1), (2, 3))
    assert kv_groups(4, 4) == ((0,), (1,), (2,), (3,))  # MHA
    assert kv_groups(4, 1) == ((0, 1, 2, 3),)  # MQA
    assert [kv_head_of(h, 9, 3) for h in range(9)] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    with pytest.raises(ValueError):
        kv_head_of(9, 9, 3)
    with pytest.raises(ValueError):
        kv_groups(9, 2)


def test_the_group_is_the_kv_head_the_model_really_shares(tiny_model_dir):
    """Zero the keys of K/V head 1 in layer 0: exactly its query heads (2 and 3) then attend evenly."""
    loaded = models.load(str(tiny_model_dir), "fp32", "cpu")
    attn = loaded.model.model.layers[0].self_attn
    d = loaded.info.head_dim
    with torch.no_grad():
        attn.k_proj.weight[d : 2 * d] = 0
        if attn.k_proj.bias is not None:
            attn.k_proj.bias[d : 2 * d] = 0
    session = answered(loaded)
    weights = layer_weights(session, tuple(session.cache.ids), 0)
    n = weights.shape[-1]
    even = torch.tril(torch.ones(n, n)) / torch.arange(1, n + 1).unsqueeze(1)
    groups = kv_groups(loaded.info.heads, loaded.info.kv_heads)
    for head in range(loaded.info.heads):
        uniform = torch.allclose(weights[head], even, atol=1e-6)
        assert uniform == (head in groups[1]), head


def test_the_matrix_is_causal_and_each_row_sums_to_one(tiny_loaded):
    session = answered(tiny_loaded)
    ids = tuple(session.cache.ids)
    for layer in range(tiny_loaded.info.layers):
        weights = layer_weights(session, ids, layer)
        n = len(ids)
        assert weights.shape == (tiny_loaded.info.heads, n, n)
        assert torch.equal(torch.triu(weights, diagonal=1), torch.zeros_like(weights))  # the mask: exactly 0
        torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:2]), atol=1e-5, rtol=0)
        assert float(weights.min()) >= 0.0
    assert tiny_loaded.model.config._attn_implementation == "sdpa"  # switched back after the pass
    matrix = prefill_matrix(session, 1, 3)
    assert matrix.size == matrix.context == len(ids) and matrix.kv_head == 1
    for q, row in enumerate(matrix.rows):
        assert len(row) == q + 1 and sum(row) == pytest.approx(1.0, abs=1e-5)
    assert matrix.rows[0][0] == pytest.approx(1.0)  # position 0 can only look at itself


def test_the_last_row_is_the_newest_row_view(tiny_loaded):
    session = answered(tiny_loaded)
    try:
        for layer, head in ((0, 0), (1, 2)):
            newest = enable_and_view(session, layer, head)
            matrix = prefill_matrix(session, layer, head)
            assert matrix.rows[-1].tolist() == pytest.approx(list(newest.weights), abs=1e-6)
            row = matrix.row_view(matrix.size - 1)
            assert row.query_position == newest.query_position and row.ids == newest.ids
            assert [s.weight for s in row.spans] == pytest.approx([s.weight for s in newest.spans], abs=1e-5)
            assert [s.span for s in row.spans] == [s.span for s in newest.spans]  # roles, ends, defaults
            assert newest.head_weights[head] == pytest.approx(newest.weights, abs=1e-7)
        # An earlier row's spans end at its query and still sum to 1.
        early = matrix.row_view(3)
        assert len(early.weights) == 4 and sum(s.weight for s in early.spans) == pytest.approx(1.0, abs=1e-5)
        with pytest.raises(ValueError):
            matrix.row_view(matrix.size)
        with pytest.raises(ValueError):
            prefill_matrix(session, 2, 0)
        with pytest.raises(ValueError):
            prefill_matrix(session, 0, 4)
    finally:
        probe_of(session).disable()


def test_the_sink_share_is_the_mean_of_column_zero(tiny_loaded):
    session = answered(tiny_loaded)
    matrix = prefill_matrix(session, 1, 0)
    n = matrix.size
    for head in range(tiny_loaded.info.heads):
        other = prefill_matrix(session, 1, head)
        column = [other.rows[q][0] for q in range(1, n)]
        assert other.sink_share == pytest.approx(sum(column) / len(column), abs=1e-6)
    assert matrix.uniform_share == pytest.approx(sum(1 / (q + 1) for q in range(1, n)) / (n - 1))
    assert is_sink(0.5, 0.05) and not is_sink(0.1, 0.05) and not is_sink(0.35, 0.2)


def test_a_long_context_is_cut_to_its_first_rows_and_the_newest_row_stays_right(tiny_loaded, monkeypatch):
    session = answered(tiny_loaded)
    probe = probe_of(session)
    probe.enable()
    try:
        newest = enable_and_view(session, 0, 0)
        monkeypatch.setattr(attention_matrix, "MAX_POSITIONS", 7)
        matrix = prefill_matrix(session, 0, 0)
        assert matrix.size == 7 and matrix.context == len(session.cache)
        full = layer_weights(session, tuple(session.cache.ids), 0)[0]
        for q in range(7):  # causal: the first rows do not depend on what follows
            assert matrix.rows[q].tolist() == pytest.approx(full[q, : q + 1].tolist(), abs=1e-6)
        assert probe.view(0, 0).weights == newest.weights  # the cut pass did not replace the newest row
        assert probe.enabled and tiny_loaded.model.config._attn_implementation == "eager"
    finally:
        probe.disable()
    assert probe.matrix is None
