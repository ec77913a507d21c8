"""`llmchat demo` and `llmchat lecture`: the shipped script run whole through Pilot on the real engine
with the tiny model, bad scripts refused in one line, and the lecture preset."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys

import pytest
from textual.widgets import Input, TextArea

from engine.events import DecodeStep
from tests.test_tui_instruments import Recorder
from tests.tui_fakes import FakeFactory, fake_app
from tests.tui_screen import screen_text, wait_for
from tui.config import Config
from tui.demo import DemoApp
from tui.demo_script import ScriptError, load
from tui.instruments import SCREENS
from tui.options import AppOptions, options_from
from tui.widgets.demo_caption import DemoCaption

INSTRUMENTS = set(SCREENS)


def run(scenario) -> None:
    asyncio.run(scenario())


def test_the_shipped_demo_walks_the_seeds_chapters_in_order():
    script = load("inference", INSTRUMENTS)
    opened = [step.instrument for step in script.steps if step.instrument]
    chapters = ["tokenizer", "embeddings", "attention", "lens", "phases", "context", "lab", "precision"]
    assert opened == chapters  # GQA is read in the KV panel's table, on the main screen
    assert script.settings_at(13).speculative == "lookup" and script.settings_at(14).kv_cache == "int8"
    assert script.settings_at(14).speculative == "off" and script.settings_at(12).kv_cache is None


BAD = [
    ("[[step]]\nprompt = 'hi'\n", "step 1: every step needs a caption"),
    (
        "[[step]]\ncaption = 'a'\n[[step]]\ncaption = 'b'\ninstrument = 'f7'\n",
        "step 2: unknown instrument 'f7'",
    ),
    ("[[step]]\ncaption = 'a'\nkeys = ['m']\n", "step 1: keys are pressed in an instrument"),
    ("[[step]]\ncaption = 'a'\ncolour = 'red'\n", "step 1: unknown field 'colour'"),
    ("[[step]]\ncaption = 'a'\nsampling = { heat = 1 }\n", "step 1: sampling takes"),
    ("[[step]]\ncaption = 'a'\nkv_cache = 'int4'\n", "step 1: kv_cache is one of"),
    ("caption = 'a'\n", "has no steps"),
    ("[[step]\ncaption = 'a'\n", "is not valid TOML"),
]


@pytest.mark.parametrize("text, said", BAD)
def test_a_bad_script_is_refused_in_one_line_naming_its_step(tmp_path, text, said):
    path = tmp_path / "demo.toml"
    path.write_text(text)
    with pytest.raises(ScriptError) as refused:
        load(str(path), INSTRUMENTS)
    assert said in str(refused.value) and "\n" not in str(refused.value)


def test_the_command_refuses_a_bad_script_before_the_app_opens(tmp_path):
    missing = subprocess.run(
        [sys.executable, "-m", "tui.cli", "demo", str(tmp_path / "none.toml")], capture_output=True, text=True
    )
    assert missing.returncode == 2 and "cannot read the demo script" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1
    path = tmp_path / "hot.toml"
    path.write_text("[[step]]\ncaption = 'a'\nsampling = { temperature = -1 }\n")
    hot = subprocess.run([sys.executable, "-m", "tui.cli", "demo", str(path)], capture_output=True, text=True)
    assert hot.returncode == 2 and "temperature" in hot.stderr


def test_the_lecture_preset_sits_between_the_config_file_and_the_flags():
    saved = Config(sampling={"temperature": 0.9, "top_k": 20}, system="Be a pirate.", theme="llmchat-light")
    lecture = options_from(saved, lecture=True)
    assert lecture.sampling == {"temperature": 0.0, "top_k": 20} and lecture.warm_first
    assert lecture.system == "You are a helpful assistant. Keep answers short."
    assert lecture.theme == "llmchat-high-contrast"
    assert not lecture.theme_from_flag  # a lecture never rewrites the user's saved theme
    flagged = options_from(
        saved, lecture=True, sampling={"temperature": 0.3}, system="Hi.", theme="textual-dark"
    )
    assert (flagged.sampling["temperature"], flagged.system, flagged.theme) == (0.3, "Hi.", "textual-dark")
    assert not options_from(saved).warm_first and options_from(saved).sampling["temperature"] == 0.9


def test_a_lecture_holds_the_first_question_until_the_compiled_step_is_ready(tmp_path):
    async def scenario():
        building = DecodeStep("eager", "kernel", "building", "compiling in the background", 1.0)
        factory = FakeFactory(decode_step=building)
        app = fake_app(factory, tmp_path, warm_first=True)
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.press(*"What is the capital of France?", "enter")
            await wait_for(pilot, lambda: app.turns.ready, what="the model to load")
            await pilot.pause(0.2)
            assert app.turns.waiting and not app.turns.busy and not factory.engine.turns
            assert "waiting for the compiled decode step" in " ".join(screen_text(app).split())
            factory.engine.emit(DecodeStep("compiled", "kernel", "ready", "whole model in one graph", 9.0))
            await wait_for(pilot, lambda: not app.turns.warming, timeout=5, what="the compiled step")
            await wait_for(pilot, lambda: factory.engine.turns and not app.turns.stoppable, what="the answer")
            assert "The capital of France is Paris." in screen_text(app)

    run(scenario)


def tiny_demo(script, tiny_model_dir, tmp_path) -> DemoApp:
    """The demo on the real engine with the tiny model: greedy, 6 tokens an answer."""
    options = AppOptions(
        model=str(tiny_model_dir),
        device="cpu",
        cursor_blink=False,
        config_path=tmp_path / "config.json",
        sampling={"temperature": 0.0, "max_new_tokens": 6},
    )
    return DemoApp(script, options, Recorder().factory)


def _caption_shown(app, number: int, steps: int, caption: str) -> bool:
    """The step's number and every word of its caption on the screen (wrapped, never cut)."""
    text = " ".join(screen_text(app).split())
    words = " ".join(caption.split())
    return f"{number}/{steps} " in text and words in text


@pytest.mark.parametrize("size", [(160, 48), (80, 24)])
def test_the_shipped_demo_runs_start_to_end_and_back(tmp_path, tiny_model_dir, size, recwarn):
    """The whole of demos/inference.toml on the real engine: each step's question answered, its
    instrument open with its keys pressed, its caption whole under it; ← restores settings. No
    view's fetch is left never awaited (the demo's keys replace an exclusive worker before it ran)
    and no file left open (/proc's maps, read to find the weights' mappings)."""
    script = load("inference", INSTRUMENTS)
    steps = len(script.steps)

    async def scenario():
        app = tiny_demo(script, tiny_model_dir, tmp_path)
        async with app.run_test(size=size) as pilot:
            for index, step in enumerate(script.steps):
                if index:
                    await pilot.press("space" if index % 2 else "right")
                await wait_for(pilot, lambda: app.at == index, timeout=30, what=f"step {index + 1}")
                await wait_for(
                    pilot,
                    lambda: app.turns.ready and not app.turns.stoppable,
                    timeout=60,
                    what=f"step {index + 1}'s answer",
                )
                if step.instrument:
                    wanted = SCREENS[step.instrument][1]
                    await wait_for(
                        pilot,
                        lambda: type(app.screen).__name__ == wanted and app.screen.query(DemoCaption),
                        timeout=30,
                        what=f"step {index + 1}'s {wanted}",
                    )
                    # The demo's keys act: no text box holds them (the embeddings lesson's took the
                    # presenter's Space as text, and the demo stood still at step 4).
                    assert not isinstance(app.focused, (Input, TextArea)), app.focused
                else:
                    assert len(app.screen_stack) == 1
                await wait_for(
                    pilot,
                    lambda: _caption_shown(app, index + 1, steps, step.caption),
                    timeout=10,
                    what=f"step {index + 1}'s caption, whole",
                )
            asked = [m.content for m in app.engine.session.messages if m.role == "user"]
            assert asked == [s.prompt for s in script.steps if s.prompt]
            assert app.kv_cache == "int8" and app.speculation[0] is None
            await pilot.press("left", "pageup")  # back to speculation, with the cache as it was before
            await wait_for(pilot, lambda: app.at == steps - 3, what="the step before")
            assert app.speculation[0] == "lookup" and app.kv_cache in (None, "fp32")
            assert len([m for m in app.engine.session.messages if m.role == "user"]) == len(asked)
            await pilot.press("q")
            await wait_for(pilot, lambda: app.ended, what="the demo to end")
            assert not app.query(DemoCaption) and "The demo has ended" in screen_text(app)
            await pilot.press("q")  # a letter again, in the prompt
            assert "q" in app.query_one("#prompt").text

    run(scenario)
    gc.collect()  # a coroutine never awaited, or a file never closed, warns when it is collected
    said = [str(w.message) for w in recwarn]
    left = [text for text in said if "never awaited" in text or "unclosed" in text]
    assert not left, left


def test_the_demo_keys_give_way_to_the_scripts_keys_and_to_typing(tmp_path, tiny_model_dir):
    async def scenario():
        path = tmp_path / "demo.toml"
        path.write_text(
            '[[step]]\ncaption = "one"\n[[step]]\ncaption = "two"\n'
            '[[step]]\ncaption = "three"\ninstrument = "inspector"\n'
            'keys = ["home", "right", "right", "left"]\n'
        )
        app = tiny_demo(load(str(path), INSTRUMENTS), tiny_model_dir, tmp_path)
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.at == 0 and app.turns.ready, timeout=60, what="step 1")
            app.query_one("#prompt").focus()
            await pilot.press(*"a b")  # typed, spaces and all: the demo does not move
            assert app.at == 0 and app.query_one("#prompt").text == "a b"
            await pilot.press("enter")
            await wait_for(pilot, lambda: not app.turns.stoppable, timeout=30, what="the answer")
            app.set_focus(None)
            await pilot.press("pagedown", "pagedown")
            await wait_for(
                pilot, lambda: type(app.screen).__name__ == "InspectorScreen", what="the inspector"
            )
            await wait_for(pilot, lambda: not app.replaying, what="the keys")
            await pilot.pause(0.2)
            assert app.at == 2  # the script's Home → → ← went to the inspector, not to the demo
            assert "step 2 of 6" in screen_text(app)
            await pilot.press("pageup")
            await wait_for(pilot, lambda: app.at == 1 and len(app.screen_stack) == 1, what="step 2 again")

    run(scenario)


def test_lecture_and_demo_open_the_app_with_the_preset(monkeypatch):
    """The commands as a user types them, up to the app's start (which needs a terminal)."""
    from typer.testing import CliRunner

    import tui.app
    from tui import cli

    opened = []
    monkeypatch.setattr(tui.app, "run_app", lambda **flags: opened.append(flags))
    runner = CliRunner()
    assert runner.invoke(cli.app, ["lecture", "--precision", "bf16"]).exit_code == 0
    assert runner.invoke(cli.app, ["demo", "inference"]).exit_code == 0
    lecture, demo = opened
    assert lecture["lecture"] and lecture["precision"] == "bf16" and lecture["make"].__name__ == "make_app"
    assert demo["lecture"] and demo["make"].func is DemoApp and demo["make"].args[0].steps
