"""Renames, exports and listings that used to accept or do the wrong thing.

Titles are one line of at most TITLE_MAX characters, checked by the store so the command
line and the app both refuse the same way; `export -o` never overwrites a file unless
told to; `list -n` takes a count of at least one.
"""

from __future__ import annotations

import asyncio

import pytest
from textual.widgets import Input
from typer.testing import CliRunner

from engine.saved.store import TITLE_MAX, Store, StoreError
from tests.tui_fakes import FakeFactory, fake_app
from tests.tui_screen import wait_for
from tui.screens.conversations import ConversationsScreen
from tui.screens.dialogs import TextDialog

BAD_TITLES = (
    ("x" * 10_000, f"at most {TITLE_MAX} characters"),
    ("first line\nsecond line", "one line"),
    ("tab\there", "one line"),
    ("\x1b]0;pwned\x07", "one line"),
)


def cli(*args: str, input: str | None = None):
    from tui.cli import app

    return CliRunner().invoke(app, list(args), input=input)


def saved(title: str = "") -> int:
    with Store() as store:
        conversation = store.create_conversation("smollm2-135m", "fp32").id
        store.add_message(conversation, "user", "What is the capital of France?")
        store.add_message(conversation, "assistant", "Paris.")
        if title:
            store.rename(conversation, title)
    return conversation


def title_of(conversation: int) -> str:
    with Store() as store:
        return store.conversation(conversation).title


# -- rename ----------------------------------------------------------------------------------
def test_the_store_refuses_a_title_that_is_not_one_short_line():
    conversation = saved()
    with Store() as store:
        for title, reason in BAD_TITLES:
            with pytest.raises(StoreError, match=reason) as refused:
                store.rename(conversation, title)
            assert "\n" not in str(refused.value) and len(str(refused.value)) < 120
            assert store.conversation(conversation).title == "What is the capital of France?"
        store.rename(conversation, "  " + "é" * TITLE_MAX + "  ")  # the longest allowed
        assert store.conversation(conversation).title == "é" * TITLE_MAX


@pytest.mark.parametrize("title, reason", BAD_TITLES, ids=["10000-chars", "newline", "tab", "escape"])
def test_rename_on_the_command_line_refuses_it_in_one_line(title, reason):
    conversation = saved()
    result = cli("conversations", "rename", str(conversation), title)
    assert result.exit_code == 1
    assert result.stdout == "" and len(result.stderr.splitlines()) == 1
    assert result.stderr.startswith("llmchat: ") and reason in result.stderr
    assert "\x1b" not in result.stderr and len(result.stderr) < 120
    assert title_of(conversation) == "What is the capital of France?"
    assert cli("conversations", "list").output.splitlines()[1].endswith("What is the capital of France?")


def test_rename_in_the_app_says_why_a_long_title_is_refused(tmp_path):
    conversation = saved()

    async def scenario():
        app = fake_app(FakeFactory(), tmp_path)
        async with app.run_test(size=(160, 45)) as pilot:
            await pilot.press("ctrl+o")
            await wait_for(pilot, lambda: isinstance(app.screen, ConversationsScreen))
            screen = app.screen
            status = screen.query_one("#status")
            await wait_for(pilot, lambda: status.content != "loading…")
            await pilot.press("r")
            await wait_for(pilot, lambda: isinstance(app.screen, TextDialog))
            app.screen.query_one(Input).value = "y" * 300
            await pilot.press("enter")
            await wait_for(pilot, lambda: status.has_class("-error"))
            assert f"at most {TITLE_MAX} characters" in str(status.content)
            assert "\n" not in str(status.content)

    asyncio.run(scenario())
    assert title_of(conversation) == "What is the capital of France?"


# -- export -o ---------------------------------------------------------------------------------
def test_export_refuses_to_overwrite_a_file_unless_forced(tmp_path):
    conversation = saved()
    mine = tmp_path / "notes.md"
    mine.write_text("my own notes\n")
    refused = cli("conversations", "export", str(conversation), "-o", str(mine))
    assert refused.exit_code == 1 and refused.stdout == ""
    assert len(refused.stderr.splitlines()) == 1 and "--force" in refused.stderr
    assert str(mine) in refused.stderr and "exists" in refused.stderr
    assert mine.read_text() == "my own notes\n"

    forced = cli("conversations", "export", str(conversation), "-o", str(mine), "--force")
    assert forced.exit_code == 0, forced.output
    assert mine.read_text().startswith("# What is the capital of France?")

    fresh = tmp_path / "new.json"
    made = cli("conversations", "export", str(conversation), "-f", "json", "-o", str(fresh))
    assert made.exit_code == 0 and fresh.exists()


# -- list -n -------------------------------------------------------------------------------------
def test_list_refuses_a_limit_below_one_instead_of_saying_there_are_none():
    saved("first")
    saved("second")
    for limit in ("0", "-1"):
        for search in ([], ["--search", "capital"]):
            result = cli("conversations", "list", "-n", limit, *search)
            assert result.exit_code != 0, (limit, search)
            assert "no saved conversations" not in result.output and "no matches" not in result.output
            assert len(result.stderr.splitlines()) == 1, result.stderr
            assert "--limit" in result.stderr and "at least 1" in result.stderr
    one = cli("conversations", "list", "-n", "1")
    assert one.exit_code == 0
    assert [line.split()[-1] for line in one.stdout.splitlines()] == ["title", "second"]
