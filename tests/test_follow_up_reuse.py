"""A follow-up reuses the whole KV cache: earlier answers enter the prompt as the ids they were
sampled as (engine/prompt_format.py `joined`), whatever their text re-tokenizes to; where a
template rewrites an earlier answer, the prefill phase says which answer and why reuse stopped."""

from __future__ import annotations

import copy
import dataclasses
import sqlite3

import pytest

from engine.events import Notice, PhaseChanged, PromptTokens, TokenSampled
from engine.sampling import SamplingSettings
from engine.saved.chat import SavedChat
from engine.saved.store import DB_NAME, SCHEMA_VERSION, Store
from engine.session import ChatSession
from tui.widgets.kv_cache import KVCachePanel

SEEDS = range(8)


def prefill(events) -> PhaseChanged:
    return next(e for e in events if isinstance(e, PhaseChanged) and e.phase == "prefill")


def sampled(events) -> list[int]:
    return [e.id for e in events if isinstance(e, TokenSampled)]


def hot(seed: int) -> SamplingSettings:
    return SamplingSettings(temperature=1.0, seed=seed, max_new_tokens=24)


@pytest.mark.parametrize("raw", [False, True], ids=["chat template", "raw"])
def test_a_follow_up_reuses_every_cached_token_for_every_seed(tiny_loaded, raw):
    """As `llmchat ask -t 1.0 --seed S "What is the capital of France?" "And of Germany?"` does."""
    tokenizer = tiny_loaded.tokenizer
    retokenized_otherwise = 0
    for seed in SEEDS:
        session = ChatSession(tiny_loaded, hot(seed), raw=raw)
        first = list(session.send("What is the capital of France?"))
        answer = first[-1].text
        answer_ids = [i for i in sampled(first) if i not in session.stop_ids]
        retokenized_otherwise += tokenizer(answer, add_special_tokens=False)["input_ids"] != answer_ids
        held = len(session.cache)
        second = list(session.send("And of Germany?"))
        phase = prefill(second)
        assert (phase.reused, phase.reuse_stopped) == (held, None), f"seed {seed}"
        prompt = next(e for e in second if isinstance(e, PromptTokens))
        assert list(prompt.ids[:held]) == list(first[0].ids) + answer_ids[: held - len(first[0].ids)]
        assert tokenizer.decode(prompt.ids).count("And of Germany?") == 1
    # The seeds hold answers whose text tokenizes otherwise than it was sampled: the case at stake.
    assert retokenized_otherwise >= 2


def test_a_template_that_rewrites_an_answer_says_where_reuse_stopped_and_why(tiny_loaded):
    tokenizer = copy.deepcopy(tiny_loaded.tokenizer)
    # An earlier answer is written back otherwise than it was sampled (as Qwen3 drops an old
    # answer's thinking): here upper-cased.
    tokenizer.chat_template = tokenizer.chat_template.replace(
        "message['content']",
        "(message['content'] | upper if message['role'] == 'assistant' else message['content'])",
    )
    loaded = dataclasses.replace(tiny_loaded, tokenizer=tokenizer)
    session = ChatSession(loaded, SamplingSettings(temperature=0.0, max_new_tokens=12))
    first = list(session.send("hello"))
    assert first[-1].text != first[-1].text.upper()  # the rewrite changes something
    held = len(session.cache)
    phase = prefill(list(session.send("again")))
    assert phase.reused < held
    assert phase.reuse_stopped.startswith(
        "answer 1 is tokenized from its text: the template writes it otherwise"
    )
    panel = KVCachePanel()
    panel.info, panel.turn = session.info, phase
    shown = " ".join(str(panel.render()).split())
    assert f"reuse stopped at token {phase.reused}: answer 1 is tokenized from its text" in shown


def resumed_reuse(
    loaded, store, conversation_id, use_cache=True
) -> tuple[list[str], PhaseChanged, list[int]]:
    """Resume a saved conversation in a new session and send a follow-up: (notices, its prefill,
    its prompt)."""
    chat = SavedChat(ChatSession(loaded, hot(0)), store)
    notices = [e.message for e in chat.resume(conversation_id, use_cache=use_cache) if isinstance(e, Notice)]
    chat.store = None  # one writer from one head: only the reading matters here
    events = list(chat.send("And of Germany?"))
    prompt = next(e for e in events if isinstance(e, PromptTokens))
    return notices, prefill(events), list(prompt.ids)


def saved_answers_that_retokenize(loaded, store) -> tuple[int, SavedChat]:
    """A saved two-turn conversation whose answers' text tokenizes otherwise than sampled."""
    for seed in SEEDS:
        live = SavedChat(ChatSession(loaded, hot(seed)), store)
        for question in ("What is the capital of France?", "How does inference work?"):
            list(live.send(question))
        answers = [m for m in live.session.messages if m.role == "assistant"]
        tokenizer = loaded.tokenizer
        if any(
            tokenizer(m.content, add_special_tokens=False)["input_ids"] != m.trace.ids[:-1] for m in answers
        ):
            live.save_cache()
            return live.conversation_id, live
    raise AssertionError("no seed sampled an answer that re-tokenizes otherwise")


def test_a_resumed_conversation_reuses_its_whole_saved_cache(tiny_loaded, tmp_path):
    with Store(tmp_path) as store:
        conversation, live = saved_answers_that_retokenize(tiny_loaded, store)
        held = len(live.session.cache)
        notices, phase, prompt = resumed_reuse(tiny_loaded, store, conversation)
        assert notices == [f"KV cache loaded from disk: {held} tokens, no prefill needed"]
        assert (phase.reused, phase.reuse_stopped) == (held, None)
        # Without the cache file the prompt is the same ids (the store keeps each answer's ids).
        assert resumed_reuse(tiny_loaded, store, conversation, use_cache=False)[2] == prompt


def test_a_store_of_format_1_reads_the_answers_ids_back_from_the_saved_cache(tiny_loaded, tmp_path):
    """Answers saved before the store kept ids: the cache file's own ids spell them."""
    with Store(tmp_path) as store:
        conversation, live = saved_answers_that_retokenize(tiny_loaded, store)
        held = len(live.session.cache)
    with sqlite3.connect(tmp_path / DB_NAME) as db:
        db.execute("UPDATE messages SET token_ids = NULL")
    with Store(tmp_path) as store:
        assert all(m.record is None or m.record.token_ids is None for m in store.messages(conversation))
        notices, phase, _ = resumed_reuse(tiny_loaded, store, conversation)
    assert notices == [f"KV cache loaded from disk: {held} tokens, no prefill needed"]
    assert phase.reused == held


def test_a_store_of_format_1_opens_as_format_2_with_its_messages(tmp_path):
    with Store(tmp_path) as store:
        conversation = store.start_conversation("user", "hello", "tiny", "fp32", None, None).conversation_id
    with sqlite3.connect(tmp_path / DB_NAME) as db:  # as llmchat wrote it before answers kept their ids
        for column in ("token_ids", "step_path", "speculative", "kv_cache", "fork_step"):
            db.execute(f"ALTER TABLE messages DROP COLUMN {column}")
        db.execute("PRAGMA user_version = 1")
    with Store(tmp_path) as store:
        assert [m.content for m in store.messages(conversation)] == ["hello"]
    with sqlite3.connect(tmp_path / DB_NAME) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 2
