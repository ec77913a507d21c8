"""The context sweep and the embeddings view's numbers, on the tiny model (and SmolLM2 where named)."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from engine.instruments import context_sweep, embeddings
from engine.instruments.context_sweep import LLAMA_2_7B, LLAMA_2_70B, CacheShape, ContextSweep, sizes
from engine.sampling import SamplingSettings
from engine.session import ChatSession

GREEDY = SamplingSettings(temperature=0, max_new_tokens=8)


def answer(session: ChatSession, text: str):
    events = list(session.send(text))
    return session.messages[-1].content, events


# -- the context sweep ---------------------------------------------------------------------------
def test_sizes_double_from_16_up_to_2048_or_the_window():
    assert sizes(8192) == [16, 32, 64, 128, 256, 512, 1024, 2048]
    assert sizes(2048) == [16, 32, 64, 128, 256, 512, 1024]  # 2,048 leaves no room to decode
    assert sizes(512, steps=8) == [16, 32, 64, 128, 256]
    assert sizes(20) == []


def test_crossover_by_hand():
    # SmolLM2-135M at fp32: kv = 2·30·3·64·4 = 46,080 B/token; W = 538,060,288 B
    smol = CacheShape("smol", 30, 3, 64, 4, 538_060_288, "test")
    assert smol.kv_bytes_per_token == 46_080
    assert smol.crossover == 11_677  # 538,060,288 / 46,080 = 11,676.7
    # Llama-2-7B fp16: 2·32·32·128·2 = 524,288 B/token; W = 13.4e9 B -> 25,558.5
    assert LLAMA_2_7B.kv_bytes_per_token == 524_288 and LLAMA_2_7B.crossover == 25_559
    # Llama-2-70B fp16 (GQA, 8 KV heads): 2·80·8·128·2 = 327,680 B/token; W = 138e9 B -> 421,142.6
    assert LLAMA_2_70B.kv_bytes_per_token == 327_680 and LLAMA_2_70B.crossover == 421_143
    # Gemma 3 270M's shape at fp32: 2·18·1·256·4 = 36,864 B/token, 2,048 a layer; 15 local layers
    # keep their last 512, so past 512 a step reads 2,048·(3c + 15·512): W = 2**30 B is reached at
    # c = (2**30 - 15,728,640) / 6,144 = 172,202.7 (the formula without windows: 29,128).
    gemma = CacheShape("gemma", 18, 1, 256, 4, 2**30, "test", windows=((512,) * 5 + (None,)) * 3)
    assert gemma.kv_bytes_per_token == 36_864 and gemma.crossover == 172_203
    assert gemma.kv_bytes(100) == 100 * 36_864 and gemma.kv_bytes(1_000) == 2_048 * (3_000 + 15 * 512)
    # Reached within the windows (a small W), and never where every layer has one (Mistral's).
    early = CacheShape("early", 18, 1, 256, 4, 5_000_000, "test", windows=gemma.windows)
    assert 0 < early.crossover < 512
    assert CacheShape("mistral", 2, 1, 8, 4, 10**9, "test", windows=(4096, 4096)).crossover is None
    for shape in (smol, LLAMA_2_7B, LLAMA_2_70B, gemma, early):
        c = shape.crossover
        assert shape.kv_bytes(c - 1) < shape.weight_bytes <= shape.kv_bytes(c)


def test_the_sweep_measures_each_size_and_leaves_the_chat_as_it_was(tiny_loaded):
    swept, plain = ChatSession(tiny_loaded, GREEDY), ChatSession(tiny_loaded, GREEDY)
    for session in (swept, plain):
        answer(session, "What is the capital of France?")
    ids = list(swept.cache.ids)
    keys = swept.cache.layers[0].keys.clone()

    sweep = ContextSweep(steps=4)
    points = [sweep.measure(swept, n) for n in sizes(swept.context, largest=64, steps=4)]

    assert [p.context for p in points] == [16, 32, 64]
    kv = context_sweep.shape_of(swept).kv_bytes_per_token
    for p in points:
        assert p.ttft_s > 0 and p.itl_s > 0 and p.itl_steps == 4
        assert p.cache_bytes == kv * p.context  # the real tensors hold what the formula says
        assert p.decode_path == "eager fast path" and p.prefill_path == "eager fast path"
    assert swept.cache.ids == ids and torch.equal(swept.cache.layers[0].keys, keys)
    # The next turn reuses the chat's cache and answers exactly as without the sweep.
    text, events = answer(swept, "And Germany?")
    expected, expected_events = answer(plain, "And Germany?")
    assert text == expected
    reused = [e.reused for e in events if type(e).__name__ == "PromptTokens"]
    assert reused == [e.reused for e in expected_events if type(e).__name__ == "PromptTokens"]
    assert reused[0] > 0


def test_a_cancelled_sweep_stops_and_a_too_long_size_is_refused(tiny_loaded):
    session = ChatSession(tiny_loaded, GREEDY)
    cancel = threading.Event()
    cancel.set()
    assert ContextSweep().measure(session, 64, cancel) is None
    with pytest.raises(ValueError, match="window"):
        ContextSweep().measure(session, session.context, None)
    assert len(session.cache) == 0


# -- embeddings ----------------------------------------------------------------------------------
def test_nearest_tokens_are_the_highest_cosines_without_the_token_itself(tiny_loaded):
    session = ChatSession(tiny_loaded, GREEDY)
    token = embeddings.tokens_of(session, " capital")[0]
    result = embeddings.token_embedding(session, token)
    table = tiny_loaded.model.get_input_embeddings().weight.float()
    cosines = torch.nn.functional.cosine_similarity(table, table[token][None], dim=-1)
    assert math.isclose(float(cosines[token]), 1.0, abs_tol=1e-5)
    cosines[token] = -2
    values, ids = torch.topk(cosines, 10)
    assert [n.id for n in result.neighbours] == ids.tolist()
    assert [n.cosine for n in result.neighbours] == pytest.approx(values.tolist(), abs=1e-5)
    assert token not in [n.id for n in result.neighbours]
    assert result.dim == table.shape[1] and result.row_bytes == table.shape[1] * 4
    assert result.norm == pytest.approx(float(table[token].norm()), rel=1e-5)
    norms = table.norm(dim=1)
    assert result.norm_rank == 1 + int((norms > norms[token]).sum())
    assert not result.tied  # the tiny model has an LM head of its own
    top = int(norms.argmax())
    assert embeddings.token_embedding(session, top).norm_rank == 1


def test_rope_similarity_is_1_at_distance_0_and_depends_on_the_distance_only(tiny_loaded):
    session = ChatSession(tiny_loaded, GREEDY)
    token = embeddings.tokens_of(session, " Paris")[0]
    rope = embeddings.rope_effect(session, token)
    assert rope.distances == (0, 1, 2, 4, 8, 16, 64, 256)  # + 128 stays inside the 512-token window
    q0, q_later, k0 = rope.rows
    assert (q0.vector, q0.start, q_later.start, k0.vector) == ("q", 0, 128, "k")
    assert q0.cosines[0] == pytest.approx(1.0, abs=1e-6) and k0.cosines[0] == pytest.approx(1.0, abs=1e-6)
    assert q0.cosines == pytest.approx(q_later.cosines, abs=1e-4)
    assert all(c < 0.9999 for c in q0.cosines[1:])
    # The closed form: Σ_i |q_i|² cos(Δ θ_i) / |q|² per head, pairs (i, i + d/2), mean over heads.
    q, _ = embeddings._projections(session, token)
    inv_freq = tiny_loaded.model.model.rotary_emb.inv_freq.float()
    half = q.shape[-1] // 2
    energy = q[:, :half] ** 2 + q[:, half:] ** 2  # [heads, d/2]
    for distance, measured in zip(rope.distances, q0.cosines):
        per_head = (energy * torch.cos(distance * inv_freq)).sum(-1) / energy.sum(-1)
        assert measured == pytest.approx(float(per_head.mean()), abs=1e-4)
    assert rope.fastest_rad == pytest.approx(1.0)  # θ_0 = base^0


def test_a_token_outside_the_vocabulary_or_empty_text_is_refused(tiny_loaded):
    session = ChatSession(tiny_loaded, GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        embeddings.token_embedding(session, tiny_loaded.info.vocab_size + 5)
    with pytest.raises(ValueError, match="type some text"):
        embeddings.tokens_of(session, "   ")


@pytest.mark.real_model
def test_smollm2_ties_its_embeddings_and_paris_sits_among_cities(smollm2):
    session = ChatSession(smollm2, GREEDY)
    [paris] = embeddings.tokens_of(session, " Paris")
    result = embeddings.token_embedding(session, paris)
    assert result.tied and result.dim == 576
    near = [n.piece for n in result.neighbours]
    assert "Paris" in near and " London" in near
