"""The app with `--server`: the real worker talking to a real llama.cpp server, through Pilot."""

from __future__ import annotations

import asyncio

from textual.widgets import Markdown

from engine.events import ModelReady, PromptTokens, TokenSampled, TurnFinished
from tests.test_tui_model import Recorder
from tests.tui_fakes import fake_app
from tests.tui_screen import screen_text, wait_for, widget_text
from tui.fmt import ms
from tui.screens.inspector import InspectorScreen
from tui.widgets.chat_log import Answer
from tui.widgets.kv_cache import KVCachePanel
from tui.widgets.phase import PhasePanel
from tui.widgets.status_bar import StatusBar
from tui.widgets.token_stream import TokenStream
from tui.widgets.top_k import TopKPanel

WIDE = (170, 50)


def remote_app(recorder, tmp_path, server, **sampling):
    return fake_app(
        recorder.factory,
        tmp_path,
        server=server.url,
        sampling={"temperature": 0, "max_new_tokens": 24, **sampling},
    )


async def turns_done(pilot, recorder, count):
    await wait_for(
        pilot, lambda: len(recorder.of(TurnFinished)) >= count and not pilot.app.turns.busy, timeout=120
    )
    await pilot.pause(0.3)


def test_the_panels_show_what_the_server_reported(llama_server, tmp_path):
    recorder = Recorder()

    async def scenario():
        app = remote_app(recorder, tmp_path, llama_server)
        async with app.run_test(size=WIDE) as pilot:
            await wait_for(pilot, lambda: app.turns.ready, timeout=60, what="the server to answer")
            info = recorder.of(ModelReady)[0].info
            status = widget_text(app.query_one(StatusBar))
            assert f"llama.cpp {info.server.version}" in status and llama_server.url in status
            assert "SmolLM2-135M-Instruct.Q4_1.gguf" in status and "1 parallel slot" in status
            assert "not reported:" in screen_text(app)  # the chat says what this server lacks

            await pilot.press(*"What is the capital of France? Answer in one word.", "enter")
            await turns_done(pilot, recorder, 1)
            finished = recorder.of(TurnFinished)[-1]
            answer = app.query_one(Answer)
            assert "Paris" in answer.query_one(Markdown).source
            summary = widget_text(answer)
            assert f"TTFT {ms(finished.stats.ttft_s)} (server prefill" in summary

            phase = widget_text(app.query_one(PhasePanel))
            assert "server's own prefill" in phase and f"TTFT {ms(finished.stats.ttft_s)}" in phase
            kv = widget_text(app.query_one(KVCachePanel))
            held = finished.stats.prompt_tokens + finished.stats.generated_tokens
            assert f"{held:,} / 2,048 on the server (this chat)" in kv
            assert "2×30×3×64×2 B = 23,040 B, f16 assumed" in kv  # from the GGUF the server names
            # the server-wide fill, summed from /slots: the last token was never fed, so one less
            assert f"server {(held - 1) / 2048:.1%} of its KV cache in use (/slots: {held - 1:,}" in kv
            assert "tokens held / 2,048 in 1 slot)" in kv
            top = app.query_one(TopKPanel)
            last = recorder.of(TokenSampled)[-1]
            assert f"position {last.position}" in widget_text(top)
            assert "before llama.cpp's samplers" in str(top.border_subtitle)
            prompt = recorder.of(PromptTokens)[-1]
            assert f"prompt {len(prompt.ids)} tokens" in widget_text(app.query_one(TokenStream))

            await pilot.press(*"And of Germany?", "enter")
            await turns_done(pilot, recorder, 2)
            second = recorder.of(TurnFinished)[-1]
            assert second.stats.reused_tokens > 0
            kv = widget_text(app.query_one(KVCachePanel))
            assert f"{second.stats.reused_tokens:,} reused · {second.stats.prefilled_tokens:,} newly" in kv

            await pilot.press("f2")  # the token inspector works from what the server sent
            await wait_for(pilot, lambda: isinstance(app.screen, InspectorScreen), what="the inspector")
            last = recorder.of(TokenSampled)[-1]
            shown = screen_text(app)
            assert f"ID        {last.id}" in shown and f"KV cache position {last.position}" in shown
            assert "◀ taken" in shown and "the server sends only the top alternatives" in shown
            await pilot.press("f")  # forking needs the local engine
            await pilot.pause(0.2)
            assert any("Forking needs the local engine" in n.message for n in app._notifications)

    asyncio.run(scenario())


def test_esc_stops_the_answer_and_instruments_say_they_need_the_local_engine(llama_server, tmp_path):
    recorder = Recorder(hold_at=3)

    async def scenario():
        app = remote_app(recorder, tmp_path, llama_server, max_new_tokens=400)
        async with app.run_test(size=WIDE) as pilot:
            await wait_for(pilot, lambda: app.turns.ready, timeout=60)
            await pilot.press(*"Write a long story about a dragon.", "enter")
            await wait_for(pilot, recorder.holding.is_set, timeout=60, what="token 3")
            await pilot.press("escape")
            recorder.release.set()
            await turns_done(pilot, recorder, 1)
            finished = recorder.of(TurnFinished)[-1]
            assert finished.stats.stop == "cancelled" and finished.text
            assert "stopped (Esc)" in widget_text(app.query_one(Answer))
            assert llama_server.wait_idle()

            await pilot.press("f7")  # attention: needs the weights
            await pilot.pause(0.2)
            assert any("it needs the local engine" in n.message for n in app._notifications)

    asyncio.run(scenario())


def test_a_server_that_dies_mid_answer_leaves_the_app_usable(own_llama_server, tmp_path):
    recorder = Recorder(hold_at=3)

    async def scenario():
        app = remote_app(recorder, tmp_path, own_llama_server, max_new_tokens=400)
        async with app.run_test(size=WIDE) as pilot:
            await wait_for(pilot, lambda: app.turns.ready, timeout=60)
            await pilot.press(*"Write a long story about a dragon.", "enter")
            await wait_for(pilot, recorder.holding.is_set, timeout=60, what="token 3")
            own_llama_server.kill()
            recorder.release.set()
            await turns_done(pilot, recorder, 1)
            finished = recorder.of(TurnFinished)[-1]
            assert finished.stats.stop == "error" and finished.text
            shown = widget_text(app.query_one(Answer))
            assert "stopped by an error" in shown
            assert app.query_one(Answer).query_one(Markdown).source == finished.text  # kept
            await pilot.press(*"Still there?", "enter")  # the app still takes prompts
            await turns_done(pilot, recorder, 2)
            assert "cannot reach" in recorder.of(TurnFinished)[-1].error
            assert not app.turns.busy

    asyncio.run(scenario())
