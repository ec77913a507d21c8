"""Hostile text (terminal escape sequences, markup brackets) in saved conversations and model output.

Text that came from the store or from the model reaches a terminal only with its control
characters made visible (ESC as ␛, BEL as ␇, ...), so it can neither retitle the window nor
clear the screen; `ask` and `export` stay byte-exact when their output is not a terminal.
"""

from __future__ import annotations

import asyncio
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest
from textual.widgets import DataTable, Input
from typer.testing import CliRunner

from engine.saved.store import Store
from tests.tui_fakes import FakeFactory, fake_app
from tests.tui_screen import screen_text, wait_for, widget_text
from tui.screens.conversations import ConversationsScreen
from tui.screens.dialogs import ConfirmDialog, TextDialog
from tui.widgets.chat_log import Answer, ChatLog
from tui.widgets.prompt_input import PromptInput

WIDE = (160, 45)
TITLE = "Hi \x1b]0;pwned\x07 \x1b[2J"
"""Sets the window title to 'pwned' and clears the screen when printed raw."""
SHOWN_TITLE = "Hi ␛]0;pwned␇ ␛[2J"
ANSWER = "Sure \x1b[31mred\x1b[0m \x9b2J and \x7f."
SHOWN_ANSWER = "Sure ␛[31mred␛[0m \\u009b2J and \\u007f."
RAW = ("\x1b", "\x07", "\x9b", "\x7f")


def hostile_conversation() -> int:
    """A conversation whose title, question and answer hold escape sequences (as `ask` saves them)."""
    with Store() as store:
        conversation = store.create_conversation("smollm2-135m", "fp32").id
        store.add_message(conversation, "user", TITLE)
        store.add_message(conversation, "assistant", ANSWER)
    return conversation


def assert_visible(text: str, *shown: str) -> None:
    assert not any(ch in text for ch in RAW), repr(text)
    for part in shown:
        assert part in text, (part, text)


async def screen_shows(pilot, *shown: str) -> None:
    """`assert_visible` on the screen once it has painted `shown` (a list loaded a moment before
    its rows are painted: read at once, the screen could still be the empty table)."""
    await wait_for(pilot, lambda: all(part in screen_text(pilot.app) for part in shown), what=repr(shown))
    assert_visible(screen_text(pilot.app), *shown)


def cli(*args: str, input: str | None = None):
    from tui.cli import app

    return CliRunner().invoke(app, list(args), input=input)


# -- the conversations commands --------------------------------------------------------------
def test_list_shows_a_hostile_title_visibly():
    hostile_conversation()
    result = cli("conversations", "list")
    assert result.exit_code == 0
    assert_visible(result.output, SHOWN_TITLE)


def test_search_results_show_hostile_text_visibly():
    hostile_conversation()
    result = cli("conversations", "list", "--search", "sure")
    assert result.exit_code == 0
    assert_visible(result.output, SHOWN_TITLE, "␛[31m")


def test_show_prints_hostile_messages_visibly():
    conversation = hostile_conversation()
    result = cli("conversations", "show", str(conversation))
    assert result.exit_code == 0
    assert_visible(result.output, f"# {SHOWN_TITLE}", SHOWN_ANSWER)


def test_the_delete_prompt_shows_a_hostile_title_visibly():
    conversation = hostile_conversation()
    result = cli("conversations", "delete", str(conversation), input="n\n")
    assert result.exit_code == 1 and "nothing deleted" in result.output
    assert_visible(result.output, f"Delete conversation {conversation} ({SHOWN_TITLE})?")


def on_a_terminal(args: list[str], timeout: float = 120) -> tuple[str, str]:
    """Run `llmchat ARGS` with its stdout on a pseudo-terminal; what it printed there, and its stderr."""
    controller, terminal = pty.openpty()
    with open(os.devnull) as stdin:
        child = subprocess.Popen(
            [sys.executable, "-m", "tui.cli", *args], stdin=stdin, stdout=terminal, stderr=subprocess.PIPE
        )
    os.close(terminal)
    received = b""
    while True:
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # EIO: the child closed its end
            break
        if not chunk:
            break
        received += chunk
    os.close(controller)
    stderr = child.communicate(timeout=timeout)[1]
    assert child.returncode == 0, stderr.decode(errors="replace")
    return received.decode("utf-8").replace("\r\n", "\n"), stderr.decode(errors="replace")


def piped(args: list[str], timeout: float = 120) -> bytes:
    """Run `llmchat ARGS` with its stdout on a pipe; the bytes it wrote."""
    done = subprocess.run(
        [sys.executable, "-m", "tui.cli", *args],
        capture_output=True,
        stdin=subprocess.DEVNULL,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    return done.stdout


def test_export_is_visible_on_a_terminal_and_byte_exact_through_a_pipe():
    conversation = hostile_conversation()
    shown, _ = on_a_terminal(["conversations", "export", str(conversation)])
    assert_visible(shown, f"# {SHOWN_TITLE}", SHOWN_ANSWER)
    raw = piped(["conversations", "export", str(conversation)]).decode("utf-8")
    assert raw.startswith(f"# {TITLE}\n") and ANSWER in raw


# -- ask: model output -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def escape_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model rewired so that greedy decoding emits ESC (the byte 0x1b) at every step.

    Every token embeds to the same vector and no layer adds anything to it, so the final
    hidden state is the same at every position; only ESC's output row is non-zero.
    """
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir)
    (esc,) = tokenizer.encode("\x1b", add_special_tokens=False)
    with torch.no_grad():
        model.model.embed_tokens.weight.fill_(1.0)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.zero_()
        model.lm_head.weight[esc] = 1.0
    directory = tmp_path_factory.mktemp("escape-model")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_ask_shows_escapes_on_a_terminal_and_stays_byte_exact_through_a_pipe(escape_model_dir):
    args = ["ask", "-m", str(escape_model_dir), "--device", "cpu", "-t", "0", "-n", "4", "--no-save", "hi"]
    raw = piped(args)
    assert raw == b"\x1b" * 4 + b"\n"  # a pipe gets exactly what the model said
    shown, stderr = on_a_terminal(args)
    assert shown == "␛" * 4 + "\n", (shown, stderr)


# -- the app -------------------------------------------------------------------------------
def run(scenario) -> None:
    asyncio.run(scenario())


async def open_conversations(pilot) -> ConversationsScreen:
    await pilot.press("ctrl+o")
    await wait_for(pilot, lambda: isinstance(pilot.app.screen, ConversationsScreen), what="the screen")
    screen = pilot.app.screen
    await wait_for(pilot, lambda: screen.query_one("#status").content != "loading…", what="the list")
    return screen


def test_the_conversations_screen_and_its_dialogs_show_hostile_text_visibly(tmp_path):
    conversation = hostile_conversation()

    async def scenario():
        app = fake_app(FakeFactory(), tmp_path)
        async with app.run_test(size=WIDE) as pilot:
            screen = await open_conversations(pilot)
            await screen_shows(pilot, SHOWN_TITLE)
            await pilot.press("d")
            await wait_for(pilot, lambda: isinstance(app.screen, ConfirmDialog))
            await screen_shows(pilot, f"Delete conversation {conversation}, “{SHOWN_TITLE}”")
            await pilot.press("n")
            await wait_for(pilot, lambda: app.screen is screen)
            await pilot.press("r")
            await wait_for(pilot, lambda: isinstance(app.screen, TextDialog))
            await screen_shows(pilot, SHOWN_TITLE)
            await pilot.press("enter")  # unchanged: nothing is renamed
            await wait_for(pilot, lambda: app.screen is screen)
            await pilot.press("slash", *"sure")
            await wait_for(pilot, lambda: "match" in str(screen.query_one("#status").content))
            await screen_shows(pilot, SHOWN_TITLE, "assistant: Sure ␛[31mred␛[0m")
        with Store() as store:
            assert store.conversation(conversation).title == TITLE

    run(scenario)


def test_the_chat_shows_hostile_history_and_answers_visibly(tmp_path):
    from tests.test_tui_conversations import StoreFakeFactory

    hostile_conversation()
    pieces = ("Sure ", "\x1b[31m", "red", "\x1b]0;pwned\x07", "<|im_end|>")
    factory = StoreFakeFactory(answer=tuple((i, piece, 0.9) for i, piece in enumerate(pieces)))

    async def scenario():
        app = fake_app(factory, tmp_path)
        async with app.run_test(size=WIDE) as pilot:
            await wait_for(pilot, lambda: app.turns.ready)
            await open_conversations(pilot)
            await pilot.press("enter")  # resume it
            await wait_for(pilot, lambda: len(app.query_one(ChatLog).messages()) == 2)
            await pilot.pause(0.1)
            assert_visible(widget_text(app.query_one(ChatLog)), SHOWN_TITLE, "Sure ␛[31mred␛[0m")
            prompt = app.query_one(PromptInput)
            prompt.focus()
            prompt.text = "again \x1b[2J"
            await pilot.press("enter")
            await wait_for(pilot, lambda: len(app.query(Answer)) == 2 and not app.turns.busy)
            await pilot.pause(0.1)
            assert app.query(Answer).last().text == "Sure \x1b[31mred\x1b]0;pwned\x07"  # kept as said
            assert_visible(screen_text(app), "again ␛[2J", "Sure ␛[31mred␛]0;pwned␇")

    run(scenario)


def test_search_shows_brackets_in_a_message_as_text_not_as_a_match(tmp_path):
    with Store() as store:
        conversation = store.create_conversation("smollm2-135m", "fp32").id
        store.add_message(conversation, "user", "See [docs] and a[i] for the capital of France")

    async def scenario():
        app = fake_app(FakeFactory(), tmp_path)
        async with app.run_test(size=WIDE) as pilot:
            screen = await open_conversations(pilot)
            await pilot.press("slash", *"capital")
            await wait_for(pilot, lambda: "match" in str(screen.query_one("#status").content))
            match = screen.query_one(DataTable).get_row_at(0)[3]
            assert match.plain == "user: See [docs] and a[i] for the capital of France"
            assert [match.plain[s.start : s.end] for s in match.spans] == ["capital"]
            assert screen.query_one("#search", Input).value == "capital"

    run(scenario)
