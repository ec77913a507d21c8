"""Conversations in the app: the conversations screen, resume, edits and version arrows.

The screen's tests use a store filled directly and the fake engine (the screen reads the
store, not the model); resume, edit and branch navigation run the real inference worker
with the tiny model and a store in a temporary directory ($LLMCHAT_DATA_DIR).
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time
from pathlib import Path

import pytest
from textual.widgets import DataTable, Input

from engine.events import (
    ConversationLoaded,
    MessageSaved,
    Notice,
    PhaseChanged,
    PromptTokens,
    SavedMessage,
    TokenSampled,
    TurnFinished,
)
from engine.saved.store import Store
from tests.tui_fakes import FakeEngine, FakeFactory, fake_app, real_tiny_app
from tests.tui_screen import screen_text, wait_for, widget_text
from tui.engine_link import inference_worker
from tui.screens.conversations import ConversationsScreen, export_path, highlight, search_rows
from tui.screens.dialogs import ConfirmDialog, TextDialog
from tui.widgets.chat_log import Answer, ChatLog, UserMessage
from tui.widgets.kv_cache import KVCachePanel
from tui.widgets.prompt_input import PromptInput

WIDE = (160, 45)
NOON = 1_780_000_000.0  # 2026-05-28 20:26:40 UTC: fixed dates for the list and the snapshot


def run(scenario):
    asyncio.run(scenario())


@pytest.fixture
def data_dir(tmp_path, monkeypatch) -> Path:
    directory = tmp_path / "data"
    monkeypatch.setenv("LLMCHAT_DATA_DIR", str(directory))
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield directory
    monkeypatch.undo()
    time.tzset()


def seed(directory: Path) -> tuple[int, int]:
    """Two saved conversations: France (two turns, updated last) and inference (one turn)."""
    with Store(directory) as store:
        inference = store.create_conversation("smollm2-135m", "fp32").id
        store.add_message(inference, "user", "How does inference work?")
        store.add_message(inference, "assistant", "Prefill then decode, one token at a time.")
        france = store.create_conversation("smollm2-135m", "bf16").id
        for role, text in (
            ("user", "What is the capital of France?"),
            ("assistant", "Paris."),
            ("user", "And Germany?"),
            ("assistant", "Berlin is the capital of Germany."),
        ):
            store.add_message(france, role, text)
    with sqlite3.connect(directory / "conversations.db") as db:
        db.execute(
            "UPDATE conversations SET created = ?, updated = ? WHERE id = ?", (NOON, NOON + 60, inference)
        )
        db.execute(
            "UPDATE conversations SET created = ?, updated = ? WHERE id = ?", (NOON, NOON + 3600, france)
        )
    return france, inference


async def open_conversations(pilot) -> ConversationsScreen:
    await pilot.press("ctrl+o")
    await wait_for(
        pilot, lambda: isinstance(pilot.app.screen, ConversationsScreen), what="the conversations screen"
    )
    screen = pilot.app.screen
    await wait_for(pilot, lambda: screen.query_one("#status").content != "loading…", what="the list")
    return screen


def table_rows(screen: ConversationsScreen) -> list[list[str]]:
    table = screen.query_one(DataTable)
    return [[str(cell) for cell in table.get_row_at(i)] for i in range(table.row_count)]


def status(screen: ConversationsScreen) -> str:
    return str(screen.query_one("#status").content)


# -- the screen, on a store filled directly --------------------------------------------------
def test_the_list_shows_title_date_turns_and_model(data_dir, tmp_path):
    france, inference = seed(data_dir)

    async def scenario():
        app = fake_app(FakeFactory(), tmp_path)
        async with app.run_test(size=WIDE) as pilot:
            screen = await open_conversations(pilot)
            assert table_rows(screen) == [
                [
                    "",
                    str(france),
                    "What is the capital of France?",
                    "2026-05-28 21:26",
                    "2",
                    "smollm2-135m bf16",
                ],
                [
                    "",
                    str(inference),
                    "How does inference work?",
                    "2026-05-28 20:27",
                    "1",
                    "smollm2-135m fp32",
                ],
            ]
            assert status(screen) == "2 conversations, newest first."
            await pilot.press("escape")
            await wait_for(pilot, lambda: not isinstance(app.screen, ConversationsScreen))
            titles = {command.title for command in app.get_system_commands(app.screen)}
            assert {"Conversations", "Edit last message", "Previous version", "Next version"} <= titles

    run(scenario)


def test_search_finds_words_in_any_message(data_dir, tmp_path):
    france, inference = seed(data_dir)

    async def scenario():
        app = fake_app(FakeFactory(), tmp_path)
        async with app.run_test(size=WIDE) as pilot:
            screen = await open_conversations(pilot)
            await pilot.press("slash", *"berl")  # a prefix of a word in an answer of the second turn
            await wait_for(pilot, lambda: "match" in status(screen))
            rows = table_rows(screen)
            assert [row[1] for row in rows] == [str(france)]
            assert rows[0][3] == "assistant: Berlin is the capital of Germany."
            assert "1 conversation matches “berl”." == status(screen)
            await pilot.press(*"xyz")
            await wait_for(pilot, lambda: "Nothing matches" in status(screen))
            assert table_rows(screen) == []
            await pilot.press("escape")  # clears the search: the whole list again
            await wait_for(pilot, lambda: len(table_rows(screen)) == 2)
            assert screen.query_one("#search", Input).value == ""

    run(scenario)


def test_search_highlights_the_match_and_also_finds_titles():
    content = highlight((("user: What is the ", False), ("capital", True), (" of\n France?", False)))
    assert content.plain == "user: What is the capital of France?"
    assert [content.plain[s.start : s.end] for s in content.spans] == ["capital"]


def test_search_rows_one_per_conversation_then_title_matches(data_dir):
    france, inference = seed(data_dir)
    with Store(data_dir) as store:
        store.rename(inference, "Notes about Germany")
        rows = search_rows(store, "germany")
    assert [(row.id, row.match) for row in rows] == [
        (france, rows[0].match),
        (inference, "title"),
    ]
    assert rows[0].match.startswith(("assistant:", "user:")) and "[Germany]" in rows[0].match


def test_rename(data_dir, tmp_path):
    france, inference = seed(data_dir)

    async def scenario():
        app = fake_app(FakeFactory(), tmp_path)
        async with app.run_test(size=WIDE) as pilot:
            screen = await open_conversations(pilot)
            await pilot.press("r")
            await wait_for(pilot, lambda: isinstance(app.screen, TextDialog))
            assert app.screen.query_one(Input).value == "What is the capital of France?"
            app.screen.query_one(Input).value = "Capitals"
            await pilot.press("enter")
            await wait_for(pilot, lambda: "renamed" in status(screen))
            await wait_for(pilot, lambda: table_rows(screen)[0][2] == "Capitals")
            with Store(data_dir) as store:
                assert store.conversation(france).title == "Capitals"

    run(scenario)


def test_a_rename_during_a_search_shows_the_new_title(data_dir, tmp_path):
    france, inference = seed(data_dir)

    async def scenario():
        app = fake_app(FakeFactory(), tmp_path)
        async with app.run_test(size=WIDE) as pilot:
            screen = await open_conversations(pilot)
            await pilot.press("slash", *"berl", "enter")  # search, then to the results
            await wait_for(pilot, lambda: "match" in status(screen))
            await pilot.press("r")
            await wait_for(pilot, lambda: isinstance(app.screen, TextDialog))
            app.screen.query_one(Input).value = "Capitals"
            await pilot.press("enter")
            await wait_for(pilot, lambda: "renamed" in status(screen))
            await wait_for(pilot, lambda: table_rows(screen)[0][2] == "Capitals")
            assert screen.query_one("#search", Input).value == "berl"  # still the search's results
            assert len(table_rows(screen)) == 1

    run(scenario)


def test_every_column_fits_an_80_column_terminal(data_dir, tmp_path):
    france, inference = seed(data_dir)
    with Store(data_dir) as store:
        store.rename(inference, "A title far too long to fit beside the date, the turns and the model")

    async def scenario():
        app = fake_app(FakeFactory(), tmp_path)
        async with app.run_test(size=(80, 24)) as pilot:
            screen = await open_conversations(pilot)
            await wait_for(pilot, lambda: "smollm2-135m bf16" in screen_text(app), what="the last column")
            shown = screen_text(app)
            assert "smollm2-135m fp32" in shown and "A title far too long to…" in shown
            table = screen.query_one(DataTable)
            assert table.virtual_size.width <= table.size.width  # nothing to scroll sideways to
            await pilot.press("slash", *"capital")
            await wait_for(pilot, lambda: "match" in status(screen))
            assert table.virtual_size.width <= table.size.width

    run(scenario)


def test_delete_asks_first_and_removes_the_cache_file_too(data_dir, tmp_path):
    france, inference = seed(data_dir)
    with Store(data_dir) as store:
        cache_file = store.cache_path(france)
    cache_file.parent.mkdir(parents=True)
    cache_file.write_bytes(b"a saved cache")

    async def scenario():
        app = fake_app(FakeFactory(), tmp_path)
        async with app.run_test(size=WIDE) as pilot:
            screen = await open_conversations(pilot)
            await pilot.press("d")
            await wait_for(pilot, lambda: isinstance(app.screen, ConfirmDialog))
            assert "Delete conversation" in screen_text(app) and "cannot be undone" in screen_text(app)
            await pilot.press("enter")  # the focus is on Cancel: a stray Enter deletes nothing
            await wait_for(pilot, lambda: app.screen is screen)
            assert status(screen) == "Nothing was deleted."
            assert len(table_rows(screen)) == 2 and cache_file.exists()
            await pilot.press("delete")
            await wait_for(pilot, lambda: isinstance(app.screen, ConfirmDialog))
            await pilot.press("y")
            await wait_for(pilot, lambda: "deleted" in status(screen))
            await wait_for(pilot, lambda: len(table_rows(screen)) == 1)
            assert table_rows(screen)[0][1] == str(inference)
            assert not cache_file.exists()
            with Store(data_dir) as store:
                assert [c.id for c in store.list_conversations()] == [inference]

    run(scenario)


def test_the_open_conversation_is_marked_and_not_deleted(data_dir, tmp_path):
    france, inference = seed(data_dir)

    async def scenario():
        app = fake_app(FakeFactory(), tmp_path)
        async with app.run_test(size=WIDE) as pilot:
            app.history.conversation_id = france  # as after a resume or a saved turn
            screen = await open_conversations(pilot)
            assert table_rows(screen)[0][0] == "●"
            await pilot.press("d")
            await pilot.pause(0.1)
            assert not isinstance(app.screen, ConfirmDialog)
            assert "open in the chat" in status(screen)
            with Store(data_dir) as store:
                assert len(store.list_conversations()) == 2

    run(scenario)


def test_export_markdown_and_json_to_the_current_directory(data_dir, tmp_path, monkeypatch):
    france, inference = seed(data_dir)
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.chdir(out)

    async def scenario():
        app = fake_app(FakeFactory(), tmp_path)
        async with app.run_test(size=WIDE) as pilot:
            screen = await open_conversations(pilot)
            await pilot.press("m")
            markdown = out / f"llmchat-conversation-{france}.md"
            await wait_for(pilot, lambda: "Exported" in status(screen))
            assert status(screen) == f"Exported conversation {france} (Markdown) to {markdown}"
            text = markdown.read_text()
            assert text.startswith("# What is the capital of France?")
            assert "## Assistant\n\nBerlin is the capital of Germany." in text
            await pilot.press("m")  # again: a second file, the first is not overwritten
            await wait_for(pilot, lambda: status(screen).endswith("-2.md"))
            assert markdown.read_text() == text
            await pilot.press("down", "j")
            await wait_for(pilot, lambda: status(screen).endswith(".json"))
            exported = json.loads((out / f"llmchat-conversation-{inference}.json").read_text())
            assert exported["format"] == "llmchat-conversation"
            assert [m["content"] for m in exported["messages"]] == [
                "How does inference work?",
                "Prefill then decode, one token at a time.",
            ]

    run(scenario)


def test_export_path_never_overwrites(tmp_path):
    (tmp_path / "llmchat-conversation-3.md").write_text("mine")
    (tmp_path / "llmchat-conversation-3-2.md").write_text("mine too")
    assert export_path(tmp_path, 3, "md") == tmp_path / "llmchat-conversation-3-3.md"


def test_a_broken_store_is_reported_on_the_screen(tmp_path, monkeypatch):
    directory = tmp_path / "data"
    directory.mkdir()
    (directory / "conversations.db").write_bytes(b"this is not a database" * 100)
    monkeypatch.setenv("LLMCHAT_DATA_DIR", str(directory))

    async def scenario():
        app = fake_app(FakeFactory(), tmp_path)
        async with app.run_test(size=WIDE) as pilot:
            screen = await open_conversations(pilot)
            assert "is not a readable llmchat database" in status(screen)
            assert screen.query_one("#status").has_class("-error")

    run(scenario)
    assert (directory / "conversations.db").read_bytes() == b"this is not a database" * 100


class StoreFake(FakeEngine):
    """The fake engine, plus a resume that sends what the store holds (as SavedChat does)."""

    def resume(self, ref, use_cache: bool = True) -> None:
        self.calls.append(("resume", ref))
        with Store() as store:
            conversation = store.conversation(store.resolve(ref))
            path = store.path(conversation.id)
            messages = tuple(SavedMessage(m.id, m.role, m.content, 1, 1) for m in path)
        self.emit(ConversationLoaded(conversation.id, conversation.title, messages))


class StoreFakeFactory(FakeFactory):
    def __call__(self, emit, sampling, system, context) -> StoreFake:
        self.engine = StoreFake(emit, sampling, **self.options)
        return self.engine


def test_enter_resumes_the_highlighted_conversation(data_dir, tmp_path):
    france, inference = seed(data_dir)
    factory = StoreFakeFactory()

    async def scenario():
        app = fake_app(factory, tmp_path)
        async with app.run_test(size=WIDE) as pilot:
            await wait_for(pilot, lambda: app.turns.ready)
            await open_conversations(pilot)
            await pilot.press("down", "enter")
            await wait_for(pilot, lambda: not isinstance(app.screen, ConversationsScreen))
            await wait_for(pilot, lambda: len(app.query_one(ChatLog).messages()) == 2)
            assert ("resume", inference) in factory.engine.calls
            chat = widget_text(app.query_one(ChatLog))
            assert f"Conversation {inference} · How does inference work? · 1 turn" in chat
            assert "Prefill then decode, one token at a time." in chat
            assert app.history.conversation_id == inference
            assert "resumed: the next turn prefills the history" in widget_text(app.query_one(KVCachePanel))
            assert app.focused is app.query_one(PromptInput)

    run(scenario)


def test_the_conversations_screen_snapshot(snap_compare, data_dir, tmp_path):
    seed(data_dir)

    async def opened(pilot) -> None:
        await wait_for(pilot, lambda: pilot.app.turns.ready)
        await open_conversations(pilot)
        await pilot.pause(0.2)

    app = fake_app(FakeFactory(), tmp_path)
    assert snap_compare(app, terminal_size=(120, 32), run_before=opened)


# -- the real worker and the tiny model ---------------------------------------------------------
class Recorder:
    """Keeps every event the real worker emits on its way to the app; can hold the worker at one token."""

    def __init__(self, hold_at: int | None = None) -> None:
        self.events: list = []
        self.lock = threading.Lock()
        self.hold_at = hold_at
        self.holding = threading.Event()
        self.release = threading.Event()

    def factory(self, emit, sampling, system, context):
        def recording_emit(event) -> None:
            with self.lock:
                self.events.append(event)
            if isinstance(event, TokenSampled) and event.index == self.hold_at:
                self.holding.set()
                self.release.wait(30)  # on the inference thread, between two tokens
            emit(event)

        return inference_worker(recording_emit, sampling, system, context)

    def of(self, kind) -> list:
        with self.lock:
            return [e for e in self.events if isinstance(e, kind)]


def tiny_app(recorder: Recorder, tiny_model_dir, tmp_path, **options):
    return real_tiny_app(
        recorder, tiny_model_dir, tmp_path, {"temperature": 0, "max_new_tokens": 6}, **options
    )


async def turns_done(pilot, recorder: Recorder, count: int) -> None:
    await wait_for(
        pilot, lambda: len(recorder.of(TurnFinished)) >= count and not pilot.app.turns.busy, timeout=60
    )
    await pilot.pause(0.1)


def test_resume_shows_the_history_and_the_next_turn_prefills_it(tiny_model_dir, data_dir, tmp_path):
    france, inference = seed(data_dir)
    recorder = Recorder()

    async def scenario():
        app = tiny_app(recorder, tiny_model_dir, tmp_path, resume=france)
        async with app.run_test(size=WIDE) as pilot:
            await wait_for(pilot, lambda: recorder.of(ConversationLoaded) and recorder.of(Notice), timeout=60)
            await wait_for(pilot, lambda: len(app.query_one(ChatLog).messages()) == 4)
            chat = widget_text(app.query_one(ChatLog))
            for text in (
                "Conversation",
                "What is the capital of France?",
                "Paris.",
                "And Germany?",
                "Berlin is the capital of Germany.",
                "no saved KV cache: the history will be prefilled",
            ):
                assert text in chat, text
            assert "resumed: the next turn prefills the history" in widget_text(app.query_one(KVCachePanel))
            await pilot.press(*"And Italy?", "enter")
            await turns_done(pilot, recorder, 1)
            prompt = recorder.of(PromptTokens)[-1]
            prefill = [e for e in recorder.of(PhaseChanged) if e.phase == "prefill"][-1]
            assert prefill.reused == 0 and prefill.tokens == len(prompt.ids)  # the whole history, once
            assert f"0 reused · {len(prompt.ids)} newly prefilled" in widget_text(app.query_one(KVCachePanel))
        with Store(data_dir) as store:
            path = store.path(france)
        assert [m.content for m in path][:5] == [
            "What is the capital of France?",
            "Paris.",
            "And Germany?",
            "Berlin is the capital of Germany.",
            "And Italy?",
        ]
        assert len(path) == 6  # the new answer was saved in the resumed conversation

    run(scenario)


def test_resume_from_the_screen_loads_the_saved_cache_and_reuses_it(tiny_model_dir, data_dir, tmp_path):
    recorder = Recorder()

    async def scenario():
        app = tiny_app(recorder, tiny_model_dir, tmp_path)
        async with app.run_test(size=WIDE) as pilot:
            await wait_for(pilot, lambda: app.turns.ready, timeout=60)
            await pilot.press(*"What is the capital of France?", "enter")
            await turns_done(pilot, recorder, 1)
            conversation = recorder.of(MessageSaved)[-1].conversation_id
            await pilot.press("ctrl+n")  # leaving it saves its KV cache file
            await wait_for(pilot, lambda: any("KV cache saved" in n.message for n in recorder.of(Notice)))
            screen = await open_conversations(pilot)
            assert table_rows(screen)[0][1] == str(conversation)
            await pilot.press("enter")
            await wait_for(
                pilot,
                lambda: any("KV cache loaded from disk" in n.message for n in recorder.of(Notice)),
                timeout=30,
            )
            await wait_for(pilot, lambda: "resumed from disk" in widget_text(app.query_one(KVCachePanel)))
            cached = int(widget_text(app.query_one(KVCachePanel)).split("next turn reuses ")[1].split()[0])
            assert cached > 0
            assert "KV cache loaded from disk" in widget_text(app.query_one(ChatLog))
            await pilot.press(*"And Germany?", "enter")
            await turns_done(pilot, recorder, 2)
            prefill = [e for e in recorder.of(PhaseChanged) if e.phase == "prefill"][-1]
            # The history comes from the file, not a prefill: reuse runs up to the first token where the
            # re-templated history differs (the random model's answer may not re-tokenize the same).
            assert 0 < prefill.reused <= cached
            assert prefill.tokens == len(recorder.of(PromptTokens)[-1].ids) - prefill.reused
            assert f"{prefill.reused} reused" in widget_text(app.query_one(KVCachePanel))

    run(scenario)


def version_of(widget) -> str:
    return widget_text(widget).strip().splitlines()[-1] if widget.saved and widget.saved.versions > 1 else ""


def test_edit_and_regenerate_make_versions_and_the_arrows_move_between_them(
    tiny_model_dir, data_dir, tmp_path
):
    recorder = Recorder()

    async def scenario():
        app = real_tiny_app(recorder, tiny_model_dir, tmp_path, {"temperature": 1.0, "max_new_tokens": 6})
        async with app.run_test(size=WIDE) as pilot:
            chat = app.query_one(ChatLog)
            await wait_for(pilot, lambda: app.turns.ready, timeout=60)
            await pilot.press(*"What is the capital of France?", "enter")
            await turns_done(pilot, recorder, 1)
            first_answer = recorder.of(TurnFinished)[0].text

            # Edit the first message: select it (Alt+Up selects the last message, Up the one before), press e.
            await pilot.press("alt+up", "up")
            assert app.focused is chat.query_one(UserMessage)
            await pilot.press("e")
            prompt = app.query_one(PromptInput)
            assert app.focused is prompt and prompt.editing == 0
            assert prompt.text == "What is the capital of France?"
            prompt.text = "And Germany?"
            await pilot.press("enter")
            await turns_done(pilot, recorder, 2)
            user, answer = chat.messages()
            assert user.text == "And Germany?" and "‹ 2/2 ›" in widget_text(user)
            assert len(chat.query(UserMessage)) == 1 and prompt.editing is None

            # ← on the edited message: the first version and its answer come back.
            user.focus()
            await pilot.press("left")
            await wait_for(pilot, lambda: len(recorder.of(ConversationLoaded)) == 1)
            await wait_for(
                pilot, lambda: [m.text for m in chat.messages()[:1]] == ["What is the capital of France?"]
            )
            user, answer = chat.messages()
            assert "‹ 1/2 ›" in widget_text(user) and answer.text == first_answer
            assert app.focused is user  # still selected, so ← → can be pressed again
            await pilot.press("right")
            await wait_for(pilot, lambda: [m.text for m in chat.messages()[:1]] == ["And Germany?"])

            # Regenerate: the answer gets a second version; ← shows the first again.
            second_answer = recorder.of(TurnFinished)[1].text
            await pilot.press("ctrl+r")
            await turns_done(pilot, recorder, 3)
            answer = chat.messages()[1]
            assert "‹ 2/2 ›" in widget_text(answer)
            answer.focus()
            await pilot.press("left")
            await wait_for(pilot, lambda: len(recorder.of(ConversationLoaded)) == 3)
            await pilot.pause(0.1)
            answer = chat.messages()[1]
            assert "‹ 1/2 ›" in widget_text(answer) and answer.text == second_answer
        with Store(data_dir) as store:
            conversation = store.list_conversations()[0]
            versions = store.siblings(store.path(conversation.id)[0].id)
        assert [m.content for m in versions] == ["What is the capital of France?", "And Germany?"]

    run(scenario)


def test_a_store_that_cannot_open_leaves_the_chat_running_unsaved(tiny_model_dir, tmp_path, monkeypatch):
    directory = tmp_path / "data"
    directory.mkdir()
    newer = directory / "conversations.db"
    with sqlite3.connect(newer) as db:
        db.execute("PRAGMA user_version = 99")  # written by a newer llmchat
    before = newer.read_bytes()
    monkeypatch.setenv("LLMCHAT_DATA_DIR", str(directory))
    recorder = Recorder()

    async def scenario():
        app = tiny_app(recorder, tiny_model_dir, tmp_path)
        async with app.run_test(size=WIDE) as pilot:
            await wait_for(pilot, lambda: app.turns.ready, timeout=60)
            await pilot.press(*"Hello", "enter")
            await turns_done(pilot, recorder, 1)
            chat = widget_text(app.query_one(ChatLog))
            assert "conversations are not being saved" in chat and "newer llmchat" in chat
            assert len(app.query(Answer)) == 1 and not recorder.of(MessageSaved)

    run(scenario)
    assert newer.read_bytes() == before


def test_the_resume_flag_is_checked_before_the_app_opens(data_dir, monkeypatch):
    from typer.testing import CliRunner

    import tui.app
    from tui import cli
    from tui.config import Config
    from tui.options import options_from

    france, inference = seed(data_dir)
    started = []
    monkeypatch.setattr(tui.app, "run_app", lambda **flags: started.append(flags))
    runner = CliRunner()
    assert runner.invoke(cli.app, ["--resume", "last"]).exit_code == 0
    assert runner.invoke(cli.app, ["--resume", str(inference)]).exit_code == 0
    assert [flags["resume"] for flags in started] == [france, inference]
    for ref, reason in (("99", "no conversation 99"), ("abc", "'abc' is not a conversation id")):
        result = runner.invoke(cli.app, ["--resume", ref])
        assert result.exit_code == 2 and f"--resume: {reason}" in result.output
    assert len(started) == 2
    assert options_from(Config(), resume=france).resume == france


def test_a_turn_that_ends_while_the_screen_is_open_is_saved_and_shown(tiny_model_dir, data_dir, tmp_path):
    recorder = Recorder(hold_at=2)

    async def scenario():
        app = tiny_app(recorder, tiny_model_dir, tmp_path)
        async with app.run_test(size=WIDE) as pilot:
            await wait_for(pilot, lambda: app.turns.ready, timeout=60)
            await pilot.press(*"What is the capital of France?", "enter")
            await wait_for(pilot, recorder.holding.is_set, timeout=60)
            screen = await open_conversations(pilot)
            assert len(table_rows(screen)) == 1  # the question is saved before it is answered
            recorder.release.set()
            await wait_for(pilot, lambda: recorder.of(TurnFinished) and not app.turns.busy, timeout=60)
            await pilot.pause(0.2)
            assert app.screen is screen  # the answer went to the chat underneath
            await pilot.press("escape")
            await wait_for(pilot, lambda: not isinstance(app.screen, ConversationsScreen))
            user, answer = app.query_one(ChatLog).messages()
            assert (user.index, answer.index) == (0, 1)
            assert answer.saved.content == recorder.of(TurnFinished)[0].text
            assert app.history.conversation_id == recorder.of(MessageSaved)[-1].conversation_id

    run(scenario)
