"""Pilot tests of the app with a fake engine that emits real engine events from its own thread."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading

from textual.widgets import Footer, Input, Select

from tests.tui_fakes import FakeFactory, fake_app
from tests.tui_screen import screen_text, wait_for, widget_text
from tui.screens.settings import SettingsScreen
from tui.widgets.chat_log import Answer, ChatLog
from tui.widgets.kv_cache import KVCachePanel
from tui.widgets.phase import PhasePanel
from tui.widgets.prompt_input import PromptInput
from tui.widgets.status_bar import StatusBar
from tui.widgets.token_stream import TokenStream
from tui.widgets.top_k import TopKPanel

WIDE = (160, 45)


def run(scenario):
    asyncio.run(scenario())


async def ready(pilot):
    await wait_for(pilot, lambda: pilot.app.turns.ready, what="the model to load")


async def ask(pilot, text: str = "What is the capital of France?") -> None:
    await pilot.press(*text, "enter")


async def turn_done(pilot):
    await wait_for(
        pilot, lambda: not pilot.app.turns.busy and not pilot.app.turns.waiting, what="the turn to end"
    )
    await pilot.pause(0.1)


def test_a_turn_shows_what_the_events_said(tmp_path):
    async def scenario():
        factory = FakeFactory()
        app = fake_app(factory, tmp_path)
        async with app.run_test(size=WIDE) as pilot:
            await ready(pilot)
            await ask(pilot)
            await turn_done(pilot)
            chat = widget_text(app.query_one(ChatLog))
            assert "What is the capital of France?" in chat
            assert "The capital of France is Paris." in chat
            assert "8 tokens · TTFT 120 ms · 43.5 tok/s · done" in chat
            phase = widget_text(app.query_one(PhasePanel))
            assert "IDLE" in phase and "last turn: 8 tokens, stop: eos" in phase
            assert "TTFT 120 ms" in phase and "median 23.0 ms" in phase and "decode 43.5 tok/s" in phase
            kv = widget_text(app.query_one(KVCachePanel))
            # 15 prompt tokens + 7 fed answer tokens; 46,080 B/token = 2 x 30 x 3 x 64 x 4.
            assert "22 / 8,192" in kv and "990.0 KiB in the tensors" in kv
            assert "30 layers × 3 kv heads × 64 dims" in kv and "46,080 B/token" in kv
            assert "0 reused · 15 newly prefilled" in kv
            top = widget_text(app.query_one(TopKPanel))
            assert "▶ 1 <|im_end|>" in top and "97.0%" in top and "␣city" in top
            assert "entropy ≥ 0.24 bits" in top and "these 4 hold 100%" in top
            tokens = widget_text(app.query_one(TokenStream))
            assert "prompt 15 tokens" in tokens and "␣France₄₆₄₉" in tokens
            assert "answer 8 tokens" in tokens and "␣Paris₇₀₄₂" in tokens
            assert "fake-135m · fp32 · cpu" in widget_text(app.query_one(StatusBar))
            assert factory.engine.calls[0] == ("load", "smollm2-135m", "fp32", "auto")

    run(scenario)


def test_prompt_sent_while_loading_waits_and_says_so(tmp_path):
    async def scenario():
        gate = threading.Event()
        factory = FakeFactory(load_gate=gate)
        app = fake_app(factory, tmp_path)
        async with app.run_test(size=WIDE) as pilot:
            await wait_for(pilot, lambda: factory.engine is not None and app.engine is not None)
            await ask(pilot)
            await pilot.pause(0.1)
            assert "waiting for the model to load" in widget_text(app.query_one(ChatLog))
            assert "loading smollm2-135m at fp32" in widget_text(app.query_one(StatusBar))
            assert not any(call[0] == "send" for call in factory.engine.calls)
            gate.set()
            await ready(pilot)
            await turn_done(pilot)
            assert ("send", "What is the capital of France?") in factory.engine.calls
            chat = widget_text(app.query_one(ChatLog))
            assert "Paris." in chat and "waiting for the model" not in chat

    run(scenario)


def test_escape_stops_mid_answer_and_the_partial_answer_stays(tmp_path):
    async def scenario():
        factory = FakeFactory(hold_after=3)
        app = fake_app(factory, tmp_path)
        async with app.run_test(size=WIDE) as pilot:
            await ready(pilot)
            await ask(pilot)
            await wait_for(pilot, lambda: factory.engine.holding.is_set())
            await wait_for(pilot, lambda: "The capital of" in widget_text(app.query_one(ChatLog)))
            await pilot.press("escape")
            await turn_done(pilot)
            assert ("cancel",) in factory.engine.calls
            chat = widget_text(app.query_one(ChatLog))
            assert "The capital of France" in chat and "Paris" not in chat
            assert "stopped (Esc): the partial answer stays" in chat
            assert "stop: cancelled" in widget_text(app.query_one(PhasePanel))

    run(scenario)


def test_temperature_change_mid_answer_applies_from_the_next_token(tmp_path):
    async def scenario():
        factory = FakeFactory(hold_after=3)
        app = fake_app(factory, tmp_path)
        async with app.run_test(size=WIDE) as pilot:
            await ready(pilot)
            await ask(pilot)
            await wait_for(pilot, lambda: factory.engine.holding.is_set())
            await pilot.press("ctrl+s")
            await wait_for(pilot, lambda: isinstance(app.screen, SettingsScreen))
            field = app.screen.query_one("#temperature", Input)
            field.focus()
            field.value = ""
            await pilot.press("1", ".", "5", "enter")
            await wait_for(pilot, lambda: factory.engine.sampling.temperature == 1.5)
            await pilot.press("escape")
            factory.engine.release.set()
            await turn_done(pilot)
            assert factory.engine.turns[0].temperatures == [0.7] * 3 + [1.5] * 5
            assert "T 1.5 · top-k –" in widget_text(app.query_one(TopKPanel))

    run(scenario)


def test_invalid_settings_get_an_inline_message_and_are_not_applied(tmp_path):
    async def scenario():
        factory = FakeFactory()
        app = fake_app(factory, tmp_path)
        async with app.run_test(size=WIDE) as pilot:
            await ready(pilot)
            await pilot.press("ctrl+s")
            await wait_for(pilot, lambda: isinstance(app.screen, SettingsScreen))
            app.screen.query_one("#temperature", Input).value = "9"
            app.screen.query_one("#top_k", Input).value = "many"
            await pilot.pause(0.1)
            text = screen_text(app)
            assert "temperature must be in [0, 5], got 9" in text
            assert "top_k must be a whole number, got 'many'" in text
            await pilot.press("ctrl+s")  # apply: refused while anything is invalid
            await pilot.pause(0.1)
            assert isinstance(app.screen, SettingsScreen)
            assert not any(call[0] == "set_sampling" for call in factory.engine.calls)
            app.screen.query_one("#temperature", Input).value = "0"
            app.screen.query_one("#top_k", Input).value = "40"
            await pilot.pause(0.1)
            assert "must be" not in screen_text(app)
            await pilot.press("ctrl+s")
            await wait_for(pilot, lambda: not isinstance(app.screen, SettingsScreen))
            applied = [call[1] for call in factory.engine.calls if call[0] == "set_sampling"]
            assert applied and applied[-1].temperature == 0 and applied[-1].top_k == 40

    run(scenario)


def test_precision_switch_keeps_the_conversation_and_reprefills(tmp_path):
    async def scenario():
        factory = FakeFactory()
        app = fake_app(factory, tmp_path)
        async with app.run_test(size=WIDE) as pilot:
            await ready(pilot)
            await ask(pilot)
            await turn_done(pilot)
            await pilot.press("ctrl+s")
            await wait_for(pilot, lambda: isinstance(app.screen, SettingsScreen))
            app.screen.query_one("#precision", Select).value = "bf16"
            await wait_for(pilot, lambda: ("load", "smollm2-135m", "bf16", "auto") in factory.engine.calls)
            await pilot.press("escape")
            await wait_for(pilot, lambda: app.turns.ready and app.precision == "bf16")
            assert "fake-135m · bf16 · cpu" in widget_text(app.query_one(StatusBar))
            kv = widget_text(app.query_one(KVCachePanel))
            assert "× 2 B (bf16) = 23,040 B/token" in kv and "new cache" in kv
            chat = widget_text(app.query_one(ChatLog))
            assert "Paris." in chat and "Now running at bf16" in chat
            await ask(pilot, "And Germany?")
            await turn_done(pilot)
            assert "0 reused · 15 newly prefilled" in widget_text(app.query_one(KVCachePanel))
            assert len(app.query(Answer)) == 2

    run(scenario)


def test_load_failure_is_shown_and_the_app_stays_usable(tmp_path):
    async def scenario():
        factory = FakeFactory(fail_load="no model at 'nowhere'; use smollm2-135m (built in)")
        app = fake_app(factory, tmp_path)
        async with app.run_test(size=WIDE) as pilot:
            await wait_for(pilot, lambda: not app.turns.loading and app.engine is not None)
            assert "✖ no model at 'nowhere'" in widget_text(app.query_one(StatusBar))
            assert "✖ no model at 'nowhere'" in widget_text(app.query_one(ChatLog))
            await ask(pilot, "hello?")
            await pilot.pause(0.1)
            assert "no model is loaded" in widget_text(app.query_one(ChatLog))
            await pilot.press("f1")
            await pilot.pause(0.1)
            assert "The panels" in screen_text(app)
            await pilot.press("escape")
            await pilot.press("ctrl+s")
            await wait_for(pilot, lambda: isinstance(app.screen, SettingsScreen))

    run(scenario)


def test_a_failed_turn_is_shown(tmp_path):
    async def scenario():
        factory = FakeFactory()
        app = fake_app(factory, tmp_path)
        async with app.run_test(size=WIDE) as pilot:
            await ready(pilot)
            await pilot.press("ctrl+r")  # nothing to regenerate yet
            await turn_done(pilot)
            assert "✖ nothing to regenerate yet" in widget_text(app.query_one(ChatLog))
            assert not app.turns.busy

    run(scenario)


def test_regenerate_and_new_chat(tmp_path):
    async def scenario():
        factory = FakeFactory()
        app = fake_app(factory, tmp_path)
        async with app.run_test(size=WIDE) as pilot:
            await ready(pilot)
            await ask(pilot)
            await turn_done(pilot)
            await pilot.press("ctrl+r")
            await turn_done(pilot)
            assert ("regenerate",) in factory.engine.calls
            assert len(app.query(Answer)) == 1
            await pilot.press("ctrl+n")
            await pilot.pause(0.1)
            assert ("new_chat",) in factory.engine.calls
            assert "Paris" not in widget_text(app.query_one(ChatLog))
            assert "the tokens of the next turn" in widget_text(app.query_one(TokenStream))

    run(scenario)


def test_enter_sends_and_ctrl_j_inserts_a_newline(tmp_path):
    async def scenario():
        factory = FakeFactory()
        app = fake_app(factory, tmp_path)
        async with app.run_test(size=WIDE) as pilot:
            await ready(pilot)
            await pilot.press("a", "ctrl+j", "b")
            assert app.query_one(PromptInput).text == "a\nb"
            assert not app.turns.waiting and not app.turns.busy
            await pilot.press("enter")
            await turn_done(pilot)
            assert ("send", "a\nb") in factory.engine.calls
            assert app.query_one(PromptInput).text == ""

    run(scenario)


def test_keys_are_in_the_footer_and_the_command_palette(tmp_path):
    async def scenario():
        app = fake_app(FakeFactory(), tmp_path)
        async with app.run_test(size=(80, 24)) as pilot:
            await ready(pilot)
            footer = widget_text(app.query_one(Footer))
            for label in (
                "esc Stop",
                "^n New",
                "^r Regenerate",
                "^s Settings",
                "^t Panels",
                "f1 Help",
                "^q Quit",
                "^p",
            ):
                assert label in footer, footer
            titles = {command.title for command in app.get_system_commands(app.screen)}
            assert {
                "Stop",
                "New chat",
                "Regenerate",
                "Settings",
                "Toggle panels",
                "Help",
                "Quit",
                "Theme",
            } <= titles

    run(scenario)


def test_panels_collapse_on_80x24_and_toggle(tmp_path):
    async def scenario():
        app = fake_app(FakeFactory(), tmp_path)
        async with app.run_test(size=(80, 24)) as pilot:
            await ready(pilot)
            await ask(pilot)
            await turn_done(pilot)
            assert not app.query_one(KVCachePanel).display or app.query_one(KVCachePanel).region.height == 0
            strip = widget_text(app.query_one(PhasePanel))
            assert "IDLE" in strip and "43.5 tok/s" in strip and strip.count("\n") <= 1
            assert "Paris." in widget_text(app.query_one(ChatLog))
            await pilot.press("ctrl+t")  # small screen: the panels replace the chat
            await pilot.pause(0.1)
            assert app.query_one(ChatLog).region.height == 0
            assert "decode 43.5 tok/s" in widget_text(app.query_one(PhasePanel))
            assert "tokens 22 / 8,192" in widget_text(app.query_one(KVCachePanel))
            assert "answer 8 tokens" in widget_text(app.query_one(TokenStream))
            await pilot.press("ctrl+t")
            await pilot.pause(0.1)
            assert "Paris." in widget_text(app.query_one(ChatLog))
            await pilot.resize_terminal(160, 45)
            await pilot.pause(0.1)
            assert "46,080 B/token" in widget_text(app.query_one(KVCachePanel))
            assert "Paris." in widget_text(app.query_one(ChatLog))

    run(scenario)


def test_theme_switch_persists(tmp_path):
    async def scenario():
        app = fake_app(FakeFactory(), tmp_path)
        async with app.run_test(size=WIDE) as pilot:
            await ready(pilot)
            assert app.theme == "llmchat-dark"
            await pilot.press("ctrl+s")
            await wait_for(pilot, lambda: isinstance(app.screen, SettingsScreen))
            app.screen.query_one("#theme", Select).value = "llmchat-high-contrast"
            await pilot.pause(0.1)
            assert app.theme == "llmchat-high-contrast"
        saved = json.loads((tmp_path / "config.json").read_text())
        assert saved["theme"] == "llmchat-high-contrast"

    run(scenario)


def test_token_updates_are_batched_not_one_per_token(tmp_path, monkeypatch):
    """A burst of 600 tokens (GPU speed) reaches the panels in a few dozen batches, all of them."""
    batches: list[int] = []
    original = TokenStream.add
    monkeypatch.setattr(
        TokenStream,
        "add",
        lambda self, tokens, repaint=True: (batches.append(len(tokens)), original(self, tokens, repaint)),
    )
    answer = tuple((1000 + i, f" w{i}", 0.5) for i in range(600)) + ((2, "<|im_end|>", 0.9),)

    async def scenario():
        app = fake_app(FakeFactory(answer=answer), tmp_path)
        async with app.run_test(size=WIDE) as pilot:
            await ready(pilot)
            await ask(pilot)
            await turn_done(pilot)
            assert sum(batches) == 601
            assert len(batches) < 100, batches
            # The answer's last repaint may land a frame after the turn ends on a loaded machine.
            await wait_for(
                pilot, lambda: "w599" in widget_text(app.query_one(ChatLog)), what="the whole answer shown"
            )

    run(scenario)


def test_the_app_opens_without_importing_torch():
    code = "import sys, tui.cli, tui.app; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
