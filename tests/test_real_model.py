"""The real SmolLM2-135M-Instruct: answers, multi-turn reuse, a UTF-8 stream, the context policy."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.events import ContextTrimmed, Failed, PromptTokens, TokenSampled, TurnFinished
from engine.sampling import SamplingSettings
from engine.session import ChatSession

pytestmark = pytest.mark.real_model

ROOT = Path(__file__).resolve().parent.parent
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """Conversations the CLI saves go here, not into the user's own store."""
    return tmp_path_factory.mktemp("llmchat-data")


def llmchat(data_dir: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "LLMCHAT_DATA_DIR": str(data_dir)}
    return subprocess.run(
        [sys.executable, "-m", "tui.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )


def test_ask_answers_paris(data_dir):
    done = llmchat(data_dir, "ask", QUESTION, "--temperature", "0", "--max-new-tokens", "32")
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout
    stats = [line for line in done.stderr.splitlines() if "prompt tokens" in line]
    assert len(stats) == 1 and "stop: eos" in stats[0]


@pytest.fixture(scope="module")
def two_turns_json(data_dir) -> list[dict]:
    done = llmchat(
        data_dir, "ask", QUESTION, "And of Germany?", "--temperature", "0", "--max-new-tokens", "24", "--json"
    )
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def split_turns(events: list[dict]) -> list[list[dict]]:
    turns, current = [], []
    for event in events:
        current.append(event)
        if event["event"] == "turn":
            turns.append(current)
            current = []
    return turns


def test_json_answers_both_turns(two_turns_json):
    assert all("event" in e for e in two_turns_json)
    turns = [e for e in two_turns_json if e["event"] == "turn"]
    assert len(turns) == 2
    assert "Paris" in turns[0]["text"] and "Berlin" in turns[1]["text"]
    assert all(t["stop"] == "eos" and t["ttft_ms"] > 0 and t["decode_tok_s"] > 0 for t in turns)
    # Each turn's figures carry the CPU share they were measured at; the step that made them is said.
    assert all(0 < t["contention"]["cpu_share"] <= 1 for t in turns)
    step = next(e for e in two_turns_json if e["event"] == "decode_step")
    assert (step["step"], step["compile"]) == ("eager", "off")
    assert step["why"].startswith("ask runs the eager")


def test_json_top_k_is_a_consistent_distribution(two_turns_json):
    tokens = [e for e in two_turns_json if e["event"] == "token"]
    assert len(tokens) >= 10
    for token in tokens:
        probs = [c["prob"] for c in token["top_k"]]
        assert len(probs) == 10
        assert probs == sorted(probs, reverse=True)
        assert sum(probs) <= 1.0 + 1e-5
        assert token["logprob"] <= 0
        ids = [c["id"] for c in token["top_k"]]
        assert ids[0] == token["id"]  # temperature 0 takes the most probable token
        chosen = probs[ids.index(token["id"])]
        assert chosen == pytest.approx(math.exp(token["logprob"]), abs=2e-6, rel=1e-4)


def test_json_cache_bytes_equal_the_formula(two_turns_json):
    ready = next(e for e in two_turns_json if e["event"] == "ready")
    per_token = 2 * ready["layers"] * ready["kv_heads"] * ready["head_dim"] * ready["cache_element_bytes"]
    assert per_token == ready["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 4  # SmolLM2-135M at fp32
    caches = [e for e in two_turns_json if e["event"] == "cache"]
    assert len(caches) > 10
    for cache in caches:
        assert cache["bytes"] == cache["tokens"] * per_token
        assert cache["bytes_per_token"] == per_token
        assert cache["capacity"] == ready["context"]


def test_json_second_turn_prefills_only_its_new_tokens(two_turns_json):
    first, second = split_turns(two_turns_json)
    first_prompt = next(e for e in first if e["event"] == "prompt")
    answer_ids = [e["id"] for e in first if e["event"] == "token"]
    held = [e for e in first if e["event"] == "cache"][-1]["tokens"]
    assert held == len(first_prompt["ids"]) + len(answer_ids) - 1  # every token but the final <|im_end|>

    prompt = next(e for e in second if e["event"] == "prompt")
    phase = next(e for e in second if e["event"] == "phase" and e["phase"] == "prefill")
    turn = second[-1]
    assert phase["reused"] == prompt["reused"] == turn["reused_tokens"] == held  # the whole previous turn
    assert prompt["ids"][:held] == first_prompt["ids"] + answer_ids[:-1]
    assert phase["tokens"] == turn["prefilled_tokens"] == len(prompt["ids"]) - held
    new_text = "".join(prompt["pieces"][held:])
    assert "And of Germany?" in new_text and "France" not in new_text
    assert phase["tokens"] < 20


def test_korean_question_streams_without_replacement_characters(smollm2):
    # 24 tokens end on a whole character, so the stream and decode() can be compared in full.
    chat = ChatSession(smollm2, SamplingSettings(temperature=0, max_new_tokens=24))
    events = list(chat.send("김치는 무엇인가요? 한국어로 대답해 주세요."))
    tokens = [e for e in events if isinstance(e, TokenSampled)]
    for token in tokens:
        assert "\ufffd" not in token.text, [t.text for t in tokens]
    streamed = "".join(t.text for t in tokens)
    ids = [t.id for t in tokens if t.id not in chat.stop_ids]
    assert streamed == events[-1].text == smollm2.tokenizer.decode(ids)
    assert any("\uac00" <= ch <= "\ud7a3" for ch in streamed)  # it answered with Hangul...
    assert sum("<0x" in t.piece for t in tokens) >= 3  # ...spread over byte tokens that were held back
    assert any(t.text == "" for t in tokens if t.id not in chat.stop_ids)


def test_context_overflow_drops_oldest_turns_and_carries_on(smollm2):
    system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    chat = ChatSession(
        smollm2, SamplingSettings(temperature=0, max_new_tokens=10), system_prompt=system, context=110
    )
    system_len = len(chat.tokenizer(f"<|im_start|>system\n{system}<|im_end|>\n")["input_ids"])
    system_ids = chat.template([])[:system_len]
    trims, answers = [], []
    for country in ["France", "Germany", "Italy", "Spain"]:
        question = f"What is the capital of {country}?"
        events = list(chat.send(question))
        assert not [e for e in events if isinstance(e, Failed)]
        prompt = next(e for e in events if isinstance(e, PromptTokens))
        assert list(prompt.ids[:system_len]) == system_ids  # the system prompt is always kept
        assert len(chat.cache) <= 110
        trimmed = [e for e in events if isinstance(e, ContextTrimmed)]
        if trimmed:
            assert prompt.reused >= system_len  # the system prompt's cache survives the trim
        trims += trimmed
        finished = events[-1]
        assert isinstance(finished, TurnFinished) and finished.stats.stop in ("eos", "length")
        answers.append(finished.text)
    assert trims, "four turns should not fit in 110 tokens"
    assert trims[0].dropped_messages >= 2 and trims[0].tokens_after < trims[0].tokens_before
    assert all(m.content != "What is the capital of France?" for m in chat.messages)
    assert "Madrid" in answers[-1]  # it carried on with the conversation that is left

    # A message that cannot fit even alone is refused in one line; the conversation stays.
    before = list(chat.messages)
    events = list(chat.send("Tell me about Paris. " * 40))
    assert [type(e) for e in events] == [Failed]
    assert "context window is 110" in events[0].message and "\n" not in events[0].message
    assert chat.messages == before


def test_smollm2_has_an_attention_sink_at_position_0_in_its_middle_layers(smollm2):
    """On a real prompt, layer 15's heads put most of each row on position 0 (an attention sink, far
    above an even spread); layer 0's heads do not. The F7 matrix view names it from these shares."""
    from engine.instruments.attention_matrix import is_sink, prefill_matrix

    session = ChatSession(smollm2, SamplingSettings(temperature=0.0, max_new_tokens=1))
    list(session.send("The quick brown fox jumps over the lazy dog. Why is this sentence famous?"))
    middle = prefill_matrix(session, 15, 0)
    first = prefill_matrix(session, 0, 0)
    assert sum(is_sink(share, middle.uniform_share) for share in middle.sink_shares) >= 7  # of 9 heads
    assert not any(is_sink(share, first.uniform_share) for share in first.sink_shares)
    assert smollm2.model.config._attn_implementation == "sdpa"
