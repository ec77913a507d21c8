"""The tokenizer view (F5) with --server: the real llama.cpp server's own tokenizer, checked
against the local tokenizer of the same GGUF (SmolLM2: the same ids, bytes and template)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from engine.detok import PieceNamer
from engine.events import TurnFinished
from engine.instruments.tokview import text_cost, tokenizer_view
from engine.prompt_format import CHAT_TEMPLATE
from engine.remote import dialects
from engine.remote.client import RemoteClient, RemoteError
from engine.remote.session import connect
from engine.remote.target import RemoteTarget
from engine.remote.token_bytes import SeenTokens
from engine.remote.tokenizer import ServerTokenizer
from engine.sampling import SamplingSettings
from tests.remote.test_remote_app import WIDE, remote_app, turns_done
from tests.test_tui_model import Recorder
from tests.tui_screen import screen_text, wait_for
from tui.screens.tokenizer import EXAMPLES, TokenizerScreen


def local_pieces(tokenizer, text: str) -> list[tuple[int, bytes | None]]:
    return [(p.id, p.bytes) for p in text_cost(tokenizer, text).pieces]


@pytest.fixture
def session(llama_server):
    s = connect(RemoteTarget(llama_server.url), SamplingSettings(temperature=0, max_new_tokens=12))
    yield s
    s.close()


def test_the_servers_tokenizer_splits_text_as_the_local_one(session, smollm2):
    server = session.server_tokenizer
    for text in EXAMPLES:
        cost = server.text_cost(text)
        assert [(p.id, p.bytes) for p in cost.pieces] == local_pieces(smollm2.tokenizer, text)
    assert server.text_cost(EXAMPLES[0]).tokens == 5
    assert server.text_cost(EXAMPLES[1]).tokens == 32  # Hangul: bytes split over tokens, as locally


def test_a_turn_from_the_server_matches_the_local_view_of_the_same_ids(session, smollm2):
    for text in ("Hello! What is 2+2?", "And 3+3?"):
        events = list(session.send(text))
        assert not [e for e in events if isinstance(e, TurnFinished)][-1].error
    trace = session.messages[-1].trace
    turn = session.server_tokenizer.turn_view(session, trace)
    view = turn.view
    answer_ids = [step.id for step in trace.steps]
    assert [p.id for p in view.pieces] == [*trace.prompt_ids, *answer_ids]
    assert view.reused > 0 and view.generated == len(answer_ids)
    assert set(turn.specials) == {"<|im_start|>", "<|im_end|>"}

    # The same ids through the local tokenizer of the same GGUF: the same view.
    local_session = SimpleNamespace(
        messages=session.messages,
        system_prompt=None,
        tokenizer=smollm2.tokenizer,
        namer=PieceNamer(smollm2.tokenizer),
        prompt_format=CHAT_TEMPLATE,
        sampled_ids=lambda message: None,  # a server's answers go back to it as text
    )
    local = tokenizer_view(local_session, trace.prompt_ids, trace.reused, answer_ids)
    assert [(p.id, p.text, p.bytes, p.source) for p in view.pieces] == [
        (p.id, p.text, p.bytes, p.source) for p in local.pieces
    ]
    assert view.spans == local.spans
    assert [s.role for s in view.spans] == ["system", "user", "assistant", "user", "assistant"]
    assert view.spans[0].default  # SmolLM2's template puts in its own system prompt
    assert view.template == local.template and view.template_cached == local.template_cached


def test_a_server_without_a_tokenize_endpoint_says_so(llama_server):
    client = RemoteClient(RemoteTarget(llama_server.url))
    try:
        tokenizer = ServerTokenizer(client, dialects.OLLAMA, "m", SeenTokens())
        assert not tokenizer.available
        assert "has no tokenize endpoint" in tokenizer.missing and "(ollama)" in tokenizer.missing
        with pytest.raises(RemoteError, match="no tokenize endpoint"):
            tokenizer.text_cost("hi")
    finally:
        client.close()


def test_f5_shows_the_turn_and_the_costs_from_the_server(llama_server, tmp_path):
    recorder = Recorder()

    async def scenario():
        app = remote_app(recorder, tmp_path, llama_server, max_new_tokens=8)
        async with app.run_test(size=WIDE) as pilot:
            await wait_for(pilot, lambda: app.turns.ready, timeout=60, what="the server to answer")
            await pilot.press(*"Say hi.", "enter")
            await turns_done(pilot, recorder, 1)
            await pilot.press("f5")
            await wait_for(pilot, lambda: isinstance(app.screen, TokenizerScreen), what="the tokenizer view")
            await wait_for(pilot, lambda: "5 tokens" in screen_text(app), timeout=30, what="the costs")
            await wait_for(pilot, lambda: "generated" in screen_text(app), timeout=30, what="the turn")
            shown = screen_text(app)
            assert "32 tokens" in shown and "6.4×" in shown
            finished = recorder.of(TurnFinished)[-1].stats
            assert f"prompt {finished.prompt_tokens} tokens" in shown
            assert f"{finished.generated_tokens} generated" in shown
            assert f"{llama_server.url}'s own tokenizer (/tokenize, /detokenize)" in shown
            assert "$text-muted" not in shown
            assert "system (template)" in shown and "user #1" in shown
            assert not any("needs the local engine" in n.message for n in app._notifications)

    asyncio.run(scenario())
