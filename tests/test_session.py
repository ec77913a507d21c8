"""A chat session on the tiny model: cache reuse across turns, cancel, sampling changes, context policy."""

import math
from dataclasses import replace

import pytest
import torch
from transformers.cache_utils import DynamicCache

from engine import session as session_module
from engine.events import (
    CacheChanged,
    ContextTrimmed,
    Failed,
    PhaseChanged,
    PrefillProgress,
    PromptTokens,
    TokenSampled,
    TurnFinished,
    to_json,
)
from engine.kvcache import common_prefix
from engine.sampling import SamplingSettings
from engine.session import ChatSession, Message

GREEDY = SamplingSettings(temperature=0, max_new_tokens=8)


def of(events, kind):
    return [e for e in events if isinstance(e, kind)]


def one(events, kind):
    found = of(events, kind)
    assert len(found) == 1, (kind, events)
    return found[0]


def prefill_phase(events) -> PhaseChanged:
    return one([e for e in events if isinstance(e, PhaseChanged) and e.phase == "prefill"], PhaseChanged)


def assert_cache_holds(session: ChatSession) -> None:
    """The cache tensors are exactly what feeding `cache.ids` from scratch would produce."""
    ids = session.cache.ids
    fresh = DynamicCache(config=session.model.config)
    with torch.inference_mode():
        session.model(input_ids=torch.tensor([ids]), cache=fresh, use_cache=True)
    for ours, ref in zip(session.cache.layers, fresh.layers):
        torch.testing.assert_close(ours.keys, ref.keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ours.values, ref.values, atol=1e-4, rtol=1e-4)


@pytest.fixture
def chat(tiny_loaded):
    return ChatSession(tiny_loaded, GREEDY)


def test_a_turn_emits_prefill_then_decode_events(chat):
    events = list(chat.send("hello"))
    prompt = one(events, PromptTokens)
    assert prompt.reused == 0 and len(prompt.pieces) == len(prompt.ids)
    assert prefill_phase(events).tokens == len(prompt.ids)
    tokens = of(events, TokenSampled)
    assert [t.index for t in tokens] == list(range(8))
    assert [t.position for t in tokens] == list(range(len(prompt.ids), len(prompt.ids) + 8))
    phases = [e.phase for e in of(events, PhaseChanged)]
    assert phases == ["prefill", "decode", "idle"]
    assert isinstance(events[-1], TurnFinished)
    finished = events[-1]
    assert finished.text == "".join(t.text for t in tokens) == chat.messages[-1].content
    assert chat.messages == [Message("user", "hello"), Message("assistant", finished.text)]
    cache_events = of(events, CacheChanged)
    assert cache_events[-1].tokens == len(chat.cache)
    assert all(c.bytes == c.tokens * chat.info.kv_bytes_per_token for c in cache_events)


@pytest.mark.parametrize("top_k", [2, 3, 5])
def test_json_top_k_never_sums_above_one(tiny_loaded, top_k):
    """With a top-k filter the shown candidates hold all the mass; rounding must not push it past 1."""
    chat = ChatSession(tiny_loaded, SamplingSettings(temperature=0.8, top_k=top_k, seed=0, max_new_tokens=40))
    rows = [to_json(e) for e in chat.send("The capital of France") if isinstance(e, TokenSampled)]
    for row in rows:
        probs = [c["prob"] for c in row["top_k"]]
        assert 0 < len(probs) <= top_k
        assert sum(probs) <= 1.0
        chosen = probs[[c["id"] for c in row["top_k"]].index(row["id"])]
        assert chosen == pytest.approx(math.exp(row["logprob"]), abs=2e-6)
    assert sum(sum(c["prob"] for c in row["top_k"]) > 0.99999 for row in rows) > 10


def test_max_new_tokens_stops_with_length(tiny_loaded):
    chat = ChatSession(tiny_loaded, replace(GREEDY, max_new_tokens=5))
    events = list(chat.send("hello"))
    assert len(of(events, TokenSampled)) == 5
    stats = events[-1].stats
    assert stats.stop == "length" and stats.generated_tokens == 5
    # Every sampled token but the last was fed back: the cache holds exactly what the model saw.
    prompt = one(events, PromptTokens)
    assert chat.cache.ids == list(prompt.ids) + [t.id for t in of(events, TokenSampled)][:-1]
    assert_cache_holds(chat)


def test_second_turn_prefills_only_new_tokens(chat):
    list(chat.send("hello"))
    held = len(chat.cache)
    events = list(chat.send("again"))
    prompt = one(events, PromptTokens)
    phase = prefill_phase(events)
    assert phase.reused == prompt.reused == held  # the whole previous turn
    assert phase.tokens == len(prompt.ids) - held
    new_text = chat.tokenizer.decode(prompt.ids[held:])
    assert "again" in new_text and "hello" not in new_text
    stats = events[-1].stats
    assert (stats.reused_tokens, stats.prefilled_tokens) == (held, phase.tokens)
    assert_cache_holds(chat)


def test_our_greedy_decode_equals_model_generate(tiny_loaded):
    chat = ChatSession(tiny_loaded, replace(GREEDY, max_new_tokens=20))
    events = list(chat.send("The capital of France"))
    ours = [t.id for t in of(events, TokenSampled)]
    prompt = list(one(events, PromptTokens).ids)
    with torch.inference_mode():
        out = tiny_loaded.model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=20,
            pad_token_id=tiny_loaded.tokenizer.pad_token_id,
        )
    assert ours == out[0, len(prompt) :].tolist()
    assert len(set(ours)) > 3


def test_regenerate_reuses_the_prompt(chat):
    first = list(chat.send("The capital of France"))
    prompt_len = len(one(first, PromptTokens).ids)
    events = list(chat.regenerate())
    phase = prefill_phase(events)
    assert (phase.reused, phase.tokens) == (prompt_len - 1, 1)  # only the last prompt token is fed again
    assert events[-1].text == first[-1].text  # greedy: the same answer again
    assert [m.role for m in chat.messages] == ["user", "assistant"]
    assert_cache_holds(chat)


def test_regenerate_with_a_seed_repeats_the_answer(tiny_loaded):
    chat = ChatSession(tiny_loaded, SamplingSettings(temperature=1.0, seed=3, max_new_tokens=10))
    first = [t.id for t in of(list(chat.send("The capital")), TokenSampled)]
    again = [t.id for t in of(list(chat.regenerate()), TokenSampled)]
    assert first == again
    chat.sampling = replace(chat.sampling, seed=4)
    assert [t.id for t in of(list(chat.regenerate()), TokenSampled)] != first


def test_regenerate_with_nothing_to_answer_fails(chat):
    assert [type(e) for e in chat.regenerate()] == [Failed]


def test_edit_reuses_the_prefix_before_the_edited_message(chat):
    list(chat.send("hello"))
    first_turn = list(chat.cache.ids)
    list(chat.send("The capital"))
    old = list(chat.cache.ids)
    events = list(chat.edit(2, "The capital of France"))
    prompt = one(events, PromptTokens)
    assert prompt.reused == common_prefix(old, list(prompt.ids))
    assert prompt.reused >= len(first_turn)  # the first exchange is not prefilled again
    assert [m.content for m in chat.messages[:3]] == [
        "hello",
        chat.messages[1].content,
        "The capital of France",
    ]
    assert len(chat.messages) == 4
    assert_cache_holds(chat)


def test_edit_of_a_non_user_message_fails(chat):
    list(chat.send("hello"))
    assert [type(e) for e in chat.edit(1, "x")] == [Failed]
    assert [type(e) for e in chat.edit(5, "x")] == [Failed]
    assert len(chat.messages) == 2


def test_cancel_mid_answer_keeps_partial_answer_and_consistent_cache(tiny_loaded):
    chat = ChatSession(tiny_loaded, replace(GREEDY, max_new_tokens=50))
    events = []
    for event in chat.send("The capital of France"):
        events.append(event)
        if isinstance(event, TokenSampled) and event.index == 3:
            chat.cancel.set()
    tokens = of(events, TokenSampled)
    assert len(tokens) == 4
    finished = events[-1]
    assert finished.stats.stop == "cancelled"
    assert finished.text == "".join(t.text for t in tokens) != ""
    assert chat.messages[-1] == Message("assistant", finished.text)
    prompt = one(events, PromptTokens)
    assert chat.cache.ids == list(prompt.ids) + [t.id for t in tokens[:3]]
    assert_cache_holds(chat)
    # The next turn goes on from the partial answer, reusing the cache.
    held = len(chat.cache)
    nxt = list(chat.send("go on"))
    assert prefill_phase(nxt).reused == held
    assert nxt[-1].stats.stop == "length"  # the cancel did not stick


def test_cancel_during_prefill(tiny_loaded, monkeypatch):
    monkeypatch.setattr(session_module, "PREFILL_CHUNK", 4)
    chat = ChatSession(tiny_loaded, GREEDY)
    events = []
    for event in chat.send("The capital of France is Paris."):
        events.append(event)
        if isinstance(event, PrefillProgress) and event.done == 8:
            chat.cancel.set()
    assert of(events, TokenSampled) == []
    assert events[-1].stats.stop == "cancelled"
    assert of(events, PhaseChanged)[-1].phase == "idle"  # the phase display does not stay on prefill
    prompt = one(events, PromptTokens)
    assert chat.cache.ids == list(prompt.ids[:8])
    assert_cache_holds(chat)
    assert chat.messages[-1] == Message("assistant", "")


def test_sampling_change_mid_answer_applies_from_the_next_token(tiny_loaded):
    chat = ChatSession(tiny_loaded, SamplingSettings(temperature=1.0, seed=0, max_new_tokens=12))
    tokens = []
    for event in chat.send("The capital"):
        if isinstance(event, TokenSampled):
            tokens.append(event)
            if event.index == 4:
                chat.sampling = replace(chat.sampling, temperature=0.0, top_k=1)
    before, after = tokens[:5], tokens[5:]
    assert all(len(t.top_k) == 10 for t in before)  # the full distribution while sampling freely
    assert all(len(t.top_k) == 1 and t.top_k[0].id == t.id for t in after)  # top_k=1 from token 5 on
    assert all(t.logprob == pytest.approx(0.0, abs=1e-6) for t in after)
    assert len(after) == 7


def test_context_stop_when_the_window_fills(tiny_loaded):
    chat = ChatSession(tiny_loaded, replace(GREEDY, max_new_tokens=500), context=40)
    events = list(chat.send("hi"))
    assert events[-1].stats.stop == "context"
    assert len(chat.cache) < 40
    assert max(c.tokens for c in of(events, CacheChanged)) < 40


def test_oldest_turns_are_dropped_and_the_system_prompt_kept(tiny_loaded):
    system = "be brief"
    chat = ChatSession(tiny_loaded, replace(GREEDY, max_new_tokens=5), system_prompt=system, context=100)
    system_ids = chat.template([])[
        : len(chat.tokenizer(f"<|im_start|>system\n{system}<|im_end|>\n")["input_ids"])
    ]
    trims = []
    for n, question in enumerate(["first question", "second question", "third question", "fourth question"]):
        events = list(chat.send(question))
        trims += of(events, ContextTrimmed)
        prompt = one(events, PromptTokens)
        assert list(prompt.ids[: len(system_ids)]) == system_ids  # the system prompt stays
        assert len(prompt.ids) <= 100
        assert isinstance(events[-1], TurnFinished) and events[-1].stats.stop in ("length", "eos")
        assert chat.messages[-2].content == question
    assert trims, "a 100-token window cannot hold four turns"
    first = trims[0]
    assert first.dropped_messages >= 2 and first.tokens_after < first.tokens_before
    assert first.capacity == 100
    assert chat.messages[0].content != "first question"
    assert_cache_holds(chat)


def test_too_long_prompt_fails_in_one_line_and_keeps_the_conversation(tiny_loaded):
    chat = ChatSession(tiny_loaded, replace(GREEDY, max_new_tokens=5), system_prompt="be brief", context=100)
    list(chat.send("hello"))
    list(chat.send("The capital"))
    before = list(chat.messages)
    events = list(chat.send("The capital of France is Paris. " * 10))
    failure = one(events, Failed)
    assert "context window is 100" in failure.message and "\n" not in failure.message
    assert not of(events, TokenSampled)
    assert chat.messages == before  # the history survives a message that cannot fit
    held = len(chat.cache)
    events = list(chat.send("ok"))
    assert isinstance(events[-1], TurnFinished)
    assert prefill_phase(events).reused == held


def test_streamed_text_equals_the_answer_even_when_cut_mid_character(tiny_loaded):
    """The tiny model emits stray UTF-8 bytes; whatever the limit, what streamed is what is kept."""
    from engine.events import TokenSampled as Token
    from engine.events import TurnFinished as Finished

    for limit in range(1, 16):
        session = ChatSession(tiny_loaded, SamplingSettings(temperature=0.0, max_new_tokens=limit))
        streamed, final = "", None
        for event in session.send("추론은 어떻게 작동하나요? 🤖"):
            if isinstance(event, Token):
                streamed += event.text
            elif isinstance(event, Finished):
                final = event.text
        assert streamed == final == session.messages[-1].content
