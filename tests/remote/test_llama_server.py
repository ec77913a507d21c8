"""RemoteSession against a real llama.cpp server (no mock): the answer, token ids and top-k,
the server's prefix cache, its timings beside ours, cancel, and a server that dies mid-answer."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import httpx2
import pytest

from engine.events import (
    CacheChanged,
    ContextTrimmed,
    ModelReady,
    PhaseChanged,
    PrefillProgress,
    PromptTokens,
    TokenSampled,
    TurnFinished,
)
from engine.remote.client import RemoteError
from engine.remote.session import connect
from engine.remote.target import RemoteTarget
from engine.sampling import SamplingSettings
from engine.saved.chat import SavedChat
from engine.saved.store import Store
from tests.remote.llama_server import LlamaServer

QUESTION = "What is the capital of France? Answer in one word."
STORY = "Write a long story about a dragon who learns to bake bread."
GREEDY = SamplingSettings(temperature=0, max_new_tokens=24)


def session_for(server, sampling=GREEDY, **kwargs):
    return connect(RemoteTarget(server.url, **kwargs), sampling)


def turn(session, text):
    events = list(session.send(text))
    finished = events[-1]
    assert isinstance(finished, TurnFinished)
    return events, finished


def tokens(events):
    return [e for e in events if isinstance(e, TokenSampled)]


def test_detects_the_server_and_the_model(llama_server):
    session = session_for(llama_server)
    info = session.info
    assert info.server.kind == "llama.cpp"
    assert info.server.version  # the build, from /props
    assert info.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert info.server.quantization == "Q4_1"
    assert info.context == 2048
    # The GGUF is readable here, so the formula has the model's numbers: 2 x 30 x 3 x 64 x 2 B.
    assert (info.layers, info.kv_heads, info.head_dim) == (30, 3, 64)
    assert info.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2
    assert info.server.unreported  # and says what it cannot show
    limited = connect(RemoteTarget(llama_server.url), GREEDY, context=300).info
    assert (limited.context, limited.context_limit, limited.window) == (2048, 300, 300)


def test_a_streamed_correct_answer(llama_server):
    session = session_for(llama_server)
    events, finished = turn(session, QUESTION)
    streamed = tokens(events)
    assert len(streamed) > 1  # it arrived token by token
    assert "Paris" in finished.text
    assert "".join(t.text for t in streamed) == finished.text
    assert finished.stats.stop == "eos" and not finished.error
    kinds = [type(e) for e in events]
    assert kinds.index(PromptTokens) < kinds.index(PhaseChanged) < kinds.index(TokenSampled)
    assert session.messages[-1].content == finished.text


def test_token_ids_and_top_k_agree_with_the_server(llama_server):
    session = session_for(llama_server)
    events, finished = turn(session, QUESTION)
    for token in tokens(events):
        probs = [c.prob for c in token.top_k]
        assert probs == sorted(probs, reverse=True)
        assert token.id is not None
        chosen = [c for c in token.top_k if c.id == token.id]
        assert chosen, "at temperature 0 the chosen token is among the alternatives"
        assert chosen[0].prob == pytest.approx(math.exp(token.logprob), rel=1e-9)
        assert token.rank == 1  # greedy takes the most probable
    ids = [t.id for t in tokens(events)]
    detok = httpx2.post(llama_server.root + "/detokenize", json={"tokens": ids}, timeout=10).json()
    assert detok["content"] == finished.text  # the ids are the server's own, in order


def test_the_prompt_tokens_are_the_servers(llama_server):
    session = session_for(llama_server)
    events, finished = turn(session, QUESTION)
    prompt = next(e for e in events if isinstance(e, PromptTokens))
    assert len(prompt.ids) == finished.stats.prompt_tokens  # its tokenizer, its chat template
    assert prompt.pieces[0] == "<|im_start|>"


def test_turn_two_is_served_from_the_prefix_cache(llama_server):
    session = session_for(llama_server)
    _, first = turn(session, "Name a fruit.")
    events, second = turn(session, "And a vegetable?")
    prefill = next(e for e in events if isinstance(e, PhaseChanged) and e.phase == "prefill")
    stats = second.stats
    assert stats.reused_tokens > 0 and prefill.reused == stats.reused_tokens
    assert stats.prefilled_tokens == stats.prompt_tokens - stats.reused_tokens
    # Turn 2 carries all of turn 1, yet the server computed only its new tokens.
    assert stats.prompt_tokens > first.stats.prompt_tokens
    assert stats.server.prompt_tokens == stats.prefilled_tokens < stats.prompt_tokens
    print(
        f"\nTTFT turn 1 {first.stats.ttft_s * 1000:.0f} ms (server prefill "
        f"{first.stats.server.prompt_ms:.0f} ms, {first.stats.prefilled_tokens} tokens); "
        f"turn 2 {stats.ttft_s * 1000:.0f} ms (server prefill {stats.server.prompt_ms:.0f} ms, "
        f"{stats.prefilled_tokens} new, {stats.reused_tokens} cached)"
    )


def test_server_timings_travel_beside_the_clients(llama_server):
    session = session_for(llama_server)
    events, finished = turn(session, QUESTION)
    server = finished.stats.server
    assert server.prompt_ms is not None and server.predicted_per_token_ms is not None
    assert server.predicted_tokens == finished.stats.generated_tokens
    # The client waits for the server's prefill and then the network: its TTFT is never less.
    assert finished.stats.ttft_s * 1000 >= server.prompt_ms - 1.0
    assert any(isinstance(e, PrefillProgress) for e in events)  # llama.cpp's prompt_progress
    cache = [e for e in events if isinstance(e, CacheChanged)][-1]
    assert cache.tokens == finished.stats.prompt_tokens + finished.stats.generated_tokens
    assert cache.bytes is None and cache.bytes_per_token == session.info.kv_bytes_per_token


def test_cancel_stops_the_servers_generation(llama_server):
    session = session_for(llama_server, SamplingSettings(temperature=0, max_new_tokens=400))
    before = llama_server.metric("llamacpp:tokens_predicted_total")
    events = []
    for event in session.send(STORY):
        events.append(event)
        if isinstance(event, TokenSampled) and event.index == 4:
            session.cancel.set()  # what Esc does, through the worker
    finished = events[-1]
    assert finished.stats.stop == "cancelled" and not finished.error
    assert session.messages[-1].content == finished.text != ""  # the partial answer stays
    assert llama_server.wait_idle(), "the server kept generating after the client left"
    generated = llama_server.metric("llamacpp:tokens_predicted_total") - before
    assert generated < 100  # of up to 400: it stopped within a few tokens of the cut


def test_cancel_while_the_server_is_silent_in_prefill(llama_server):
    """Esc during a long prefill cuts the connection at once, not at the next token."""
    session = session_for(llama_server, SamplingSettings(temperature=0, max_new_tokens=8))
    long_prompt = "Summarize: " + " ".join(f"item {i} is blue;" for i in range(180))  # ~1300 tokens
    before = llama_server.metric("llamacpp:prompt_tokens_total")
    events = []
    for event in session.send(long_prompt):
        events.append(event)
        if isinstance(event, PhaseChanged) and event.phase == "prefill":
            threading.Timer(0.3, session.cancel.set).start()
    finished = events[-1]
    assert finished.stats.stop == "cancelled"
    assert not tokens(events)  # it stopped before the first token
    assert llama_server.wait_idle()
    prefilled = llama_server.metric("llamacpp:prompt_tokens_total") - before
    assert prefilled < finished.stats.prompt_tokens  # the server dropped the prefill part-way


def test_a_prompt_longer_than_the_servers_window_is_refused_before_sending(llama_server):
    session = session_for(llama_server)
    events = list(session.send("Summarize: " + " ".join(f"item {i} is blue;" for i in range(300))))
    assert len(events) == 1 and "context window is 2048: shorten it" in events[0].message
    assert session.messages == []  # taken back, as the local engine does


def test_killing_the_server_mid_answer_keeps_the_conversation(own_llama_server, tmp_path):
    session = session_for(own_llama_server, SamplingSettings(temperature=0, max_new_tokens=400))
    store = Store(tmp_path)
    chat = SavedChat(session, store)
    events = []
    for event in chat.send(STORY):
        events.append(event)
        if isinstance(event, TokenSampled) and event.index == 4:
            own_llama_server.kill()
    finished = next(e for e in events if isinstance(e, TurnFinished))
    assert finished.stats.stop == "error"
    assert finished.error.startswith(f"the connection to {own_llama_server.url} broke mid-answer: ")
    assert "\n" not in finished.error
    assert finished.text  # the tokens that arrived before the server died
    assert [m.role for m in session.messages] == ["user", "assistant"]
    saved = store.conversation(chat.conversation_id)
    assert [m.content for m in store.path(saved.id)] == [STORY, finished.text]
    # The session stays usable: the next turn fails the same clean way while the server is down.
    _, again = turn(session, "Are you there?")
    assert again.stats.stop == "error" and "cannot reach" in again.error


def test_unknown_model_and_unreachable_server_are_one_line(llama_server):
    with pytest.raises(RemoteError, match="does not serve 'nope'; it serves: "):
        session_for(llama_server, model="nope")
    with pytest.raises(RemoteError, match="cannot reach http://127.0.0.1:9/v1"):
        connect(RemoteTarget("http://127.0.0.1:9/v1"))


def test_https_to_a_plain_http_server_is_one_line(llama_server):
    """llama-server waits for a request line that a TLS hello never sends: a connect timeout."""
    with pytest.raises(RemoteError, match=r"^no answer from https://127.0.0.1:\d+/v1 within 0.5 s .*https\?"):
        connect(RemoteTarget(llama_server.url.replace("http://", "https://"), connect_timeout_s=0.5))


def test_a_server_with_a_key(tmp_path, monkeypatch):
    pytest.importorskip("xllamacpp")
    server = LlamaServer(tmp_path / "server.log", api_key="sk-test-123")
    try:
        with pytest.raises(RemoteError, match=r"refused the request \(401.*pass --api-key-env VAR") as caught:
            connect(RemoteTarget(server.url))
        monkeypatch.setenv("WRONG_KEY", "sk-wrong")
        with pytest.raises(RemoteError, match=r"401.*check the key in \$WRONG_KEY") as wrong:
            connect(RemoteTarget(server.url, api_key_env="WRONG_KEY"))
        assert "sk-" not in str(caught.value) + str(wrong.value)
        monkeypatch.setenv("GOOD_KEY", "sk-test-123")
        session = connect(RemoteTarget(server.url, api_key_env="GOOD_KEY"), GREEDY)
        _, finished = turn(session, QUESTION)
        assert "Paris" in finished.text
    finally:
        server.stop()


def test_an_answer_cut_by_the_servers_window_and_the_turn_after(tmp_path):
    pytest.importorskip("xllamacpp")
    server = LlamaServer(tmp_path / "server.log", n_ctx=128)  # llama.cpp makes it 256, its least
    try:
        session = session_for(server, SamplingSettings(temperature=0, max_new_tokens=400))
        _, cut = turn(session, STORY)
        assert cut.stats.stop == "context" and not cut.error
        assert cut.stats.prompt_tokens + cut.stats.generated_tokens == session.context == 256
        events, after = turn(session, "Go on.")  # the oldest exchange goes, as with the local engine
        trimmed = next(e for e in events if isinstance(e, ContextTrimmed))
        assert trimmed.dropped_messages == 2 and after.stats.stop != "error"
    finally:
        server.stop()


def test_worker_connects_and_answers(llama_server):
    """The worker and the saved chat take a remote session like a local one."""
    from engine.worker import InferenceWorker

    seen = []
    done = threading.Event()

    def emit(event):
        seen.append(event)
        if isinstance(event, TurnFinished):
            done.set()

    worker = InferenceWorker(emit, GREEDY, store=Store())
    worker.connect(RemoteTarget(llama_server.url))
    worker.send(QUESTION)
    assert done.wait(120)
    worker.shutdown()
    ready = next(e for e in seen if isinstance(e, ModelReady))
    assert ready.info.server.kind == "llama.cpp"
    finished = next(e for e in seen if isinstance(e, TurnFinished))
    assert "Paris" in finished.text
    records = Store().conversation(worker.chat.conversation_id)
    assert records.model == f"{ready.info.server.model} @ {llama_server.url}"


@pytest.mark.server
def test_thought_the_server_parts_out_streams_as_thought(tmp_path):
    """DeepSeek-R1's template opens a <think> block in the prompt, so llama-server sends what
    SmolLM2 writes next as `reasoning_content` (it never closes the block): thought tokens, each
    with the server's id, counted apart and kept inside <think> for the saved answer."""
    pytest.importorskip("xllamacpp")
    template = Path(__file__).parents[1] / "data" / "deepseek_r1_distill_chat_template.jinja"
    server = LlamaServer(tmp_path / "server.log", chat_template=template)
    try:
        events, finished = turn(
            session_for(server, SamplingSettings(temperature=0, max_new_tokens=12)), QUESTION
        )
    finally:
        server.stop()
    thought = tokens(events)
    assert thought and all(t.thinking and t.id is not None for t in thought)
    stats = finished.stats
    assert stats.thought_tokens == len(thought) and stats.first_answer_s is None
    assert stats.first_thought_s == stats.ttft_s
    assert finished.text.startswith("<think>") and "</think>" not in finished.text
    assert finished.text[len("<think>") :] == "".join(t.text for t in thought)
