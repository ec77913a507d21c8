"""Pilot tests of the app driving the real inference worker with the tiny random model."""

from __future__ import annotations

import asyncio
import threading

from textual.widgets import Input, Markdown, Select

from engine.events import CacheChanged, ModelReady, PhaseChanged, PromptTokens, TokenSampled, TurnFinished
from tests.tui_fakes import real_tiny_app
from tests.tui_screen import wait_for, widget_text
from tui.engine_link import inference_worker
from tui.fmt import ms, visible_controls
from tui.screens.settings import SettingsScreen
from tui.widgets.chat_log import Answer, ChatLog
from tui.widgets.kv_cache import KVCachePanel
from tui.widgets.phase import PhasePanel
from tui.widgets.status_bar import StatusBar
from tui.widgets.token_stream import TokenStream
from tui.widgets.top_k import TopKPanel

WIDE = (160, 45)


class Recorder:
    """Wraps the real worker's emit: keeps every event, and can hold the worker at one token."""

    def __init__(self, hold_at: int | None = None) -> None:
        self.events: list = []
        self.hold_at = hold_at
        self.holding = threading.Event()
        self.release = threading.Event()

    def factory(self, emit, sampling, system, context):
        def recording_emit(event) -> None:
            self.events.append(event)
            if isinstance(event, TokenSampled) and event.index == self.hold_at:
                self.holding.set()
                self.release.wait(30)  # on the inference thread, between two tokens
            emit(event)

        return inference_worker(recording_emit, sampling, system, context)

    def of(self, kind) -> list:
        return [e for e in self.events if isinstance(e, kind)]


def run(scenario):
    asyncio.run(scenario())


async def turns_done(pilot, recorder: Recorder, count: int) -> None:
    await wait_for(
        pilot, lambda: len(recorder.of(TurnFinished)) >= count and not pilot.app.turns.busy, timeout=60
    )
    await pilot.pause(0.2)


def test_panels_show_what_the_real_engine_said(tiny_model_dir, tmp_path):
    recorder = Recorder()

    async def scenario():
        app = real_tiny_app(recorder, tiny_model_dir, tmp_path, {"temperature": 0, "max_new_tokens": 8})
        async with app.run_test(size=WIDE) as pilot:
            await wait_for(pilot, lambda: app.turns.ready, timeout=60)
            await pilot.press(*"What is the capital of France?", "enter")
            await turns_done(pilot, recorder, 1)
            info = recorder.of(ModelReady)[0].info
            cache = recorder.of(CacheChanged)[-1]
            finished = recorder.of(TurnFinished)[0]
            last = recorder.of(TokenSampled)[-1]
            prompt = recorder.of(PromptTokens)[0]

            answer = app.query_one(Answer)
            assert answer.query_one(Markdown).source == visible_controls(
                finished.text
            )  # as a terminal shows it
            assert (
                f"{finished.stats.generated_tokens} tokens · TTFT {ms(finished.stats.ttft_s)}"
                in widget_text(answer)
            )
            phase = widget_text(app.query_one(PhasePanel))
            assert f"TTFT {ms(finished.stats.ttft_s)}" in phase
            assert f"decode {finished.stats.decode_tok_s:.1f} tok/s" in phase
            kv = widget_text(app.query_one(KVCachePanel))
            assert f"{cache.tokens:,} / {cache.capacity:,}" in kv
            assert f"{info.kv_bytes_per_token:,} B/token" in kv
            assert f"{info.layers} layers × {info.kv_heads} kv heads × {info.head_dim} dims" in kv
            assert f"0 reused · {len(prompt.ids)} newly prefilled" in kv
            top = widget_text(app.query_one(TopKPanel))
            assert f"step {last.index + 1} · position {last.position}" in top
            assert f"{last.top_k[0].prob:6.1%}".strip() in top
            tokens = widget_text(app.query_one(TokenStream))
            assert f"prompt {len(prompt.ids)} tokens" in tokens
            assert f"answer {finished.stats.generated_tokens} tokens" in tokens
            assert f"{info.precision} · cpu" in widget_text(app.query_one(StatusBar))

    run(scenario)


def test_a_smaller_context_is_the_window_shown_from_the_start(tiny_model_dir, tmp_path):
    """`--context 96` on a model of 512: the top line and the KV cache panel show 96 before any
    turn (both showed the model's 512 until the first answer's cache arrived); the `ready` event
    names both."""
    recorder = Recorder()

    async def scenario():
        app = real_tiny_app(recorder, tiny_model_dir, tmp_path, {"temperature": 0}, context=96)
        async with app.run_test(size=WIDE) as pilot:
            await wait_for(pilot, lambda: app.turns.ready, timeout=60)
            await pilot.pause(0.2)
            info = recorder.of(ModelReady)[0].info
            assert (info.context, info.context_limit, info.window) == (512, 96, 96)
            assert "context 96 of 512" in widget_text(app.query_one(StatusBar))
            assert "0 / 96 in the window" in widget_text(app.query_one(KVCachePanel))

    run(scenario)


def test_temperature_change_mid_answer_changes_the_next_tokens(tiny_model_dir, tmp_path):
    """At T=1 the tiny model's top choice has p >= 0.14; at T=5 the distribution flattens below 0.1."""
    recorder = Recorder(hold_at=3)

    async def scenario():
        app = real_tiny_app(
            recorder, tiny_model_dir, tmp_path, {"temperature": 1.0, "seed": 1, "max_new_tokens": 12}
        )
        async with app.run_test(size=WIDE) as pilot:
            await wait_for(pilot, lambda: app.turns.ready, timeout=60)
            await pilot.press(*"What is the capital of France?", "enter")
            await wait_for(pilot, recorder.holding.is_set, timeout=60)
            await pilot.press("ctrl+s")
            await wait_for(pilot, lambda: isinstance(app.screen, SettingsScreen))
            field = app.screen.query_one("#temperature", Input)
            field.focus()
            field.value = ""
            await pilot.press("5", "enter", "escape")
            await wait_for(pilot, lambda: app.sampling.temperature == 5.0)
            recorder.release.set()
            await turns_done(pilot, recorder, 1)
            tokens = recorder.of(TokenSampled)
            before = [t.top_k[0].prob for t in tokens if t.index <= 3]
            after = [t.top_k[0].prob for t in tokens if t.index > 3]
            assert len(before) == 4 and after
            assert max(after) < 0.1 <= min(before), (before, after)
            assert "T 5 · top-k –" in widget_text(app.query_one(TopKPanel))

    run(scenario)


def test_precision_switch_reloads_keeps_the_chat_and_reprefills(tiny_model_dir, tmp_path):
    recorder = Recorder()

    async def scenario():
        app = real_tiny_app(recorder, tiny_model_dir, tmp_path, {"temperature": 0, "max_new_tokens": 6})
        async with app.run_test(size=WIDE) as pilot:
            await wait_for(pilot, lambda: app.turns.ready, timeout=60)
            await pilot.press(*"What is the capital of France?", "enter")
            await turns_done(pilot, recorder, 1)
            await pilot.press("ctrl+s")
            await wait_for(pilot, lambda: isinstance(app.screen, SettingsScreen))
            app.screen.query_one("#precision", Select).value = "bf16"
            await pilot.press("escape")
            await wait_for(pilot, lambda: app.turns.ready and app.precision == "bf16", timeout=60)
            assert "bf16 · cpu" in widget_text(app.query_one(StatusBar))
            kv = widget_text(app.query_one(KVCachePanel))
            assert "× 4 B (fp32) = " in kv  # a 16-bit model's cache stays fp32 on a CPU and "new cache" in kv
            assert "Now running at bf16" in widget_text(app.query_one(ChatLog))
            await pilot.press(*"And Germany?", "enter")
            await turns_done(pilot, recorder, 2)
            first, second = recorder.of(PromptTokens)
            prefill = [e for e in recorder.of(PhaseChanged) if e.phase == "prefill"][1]
            assert len(second.ids) > len(first.ids)  # the conversation was kept
            assert second.reused == prefill.reused == 0 and prefill.tokens == len(second.ids)
            assert f"0 reused · {len(second.ids)} newly prefilled" in widget_text(app.query_one(KVCachePanel))
            assert len(app.query(Answer)) == 2

    run(scenario)
