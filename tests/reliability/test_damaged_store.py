"""A damaged conversation store is never written: not by `ask`, not by a chat, not after the first error.

Two kinds of damage: pages of the full-text index overwritten (the integrity check on opening
sees it), and the index's data zeroed inside intact pages (only the first write that touches
the index sees it). Either way the file keeps every byte it had.
"""

from __future__ import annotations

import hashlib
import sqlite3

import pytest
from typer.testing import CliRunner

from engine.events import Notice, TurnFinished
from engine.sampling import SamplingSettings
from engine.saved.chat import SavedChat
from engine.saved.store import DB_NAME, Store, StoreError
from engine.session import ChatSession

FTS_TABLES = ("messages_fts_data", "messages_fts_idx", "messages_fts_docsize", "messages_fts_config")


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def filled_store(directory) -> None:
    """A store with enough conversations that the full-text index spans several pages."""
    with Store(directory) as store:
        for i in range(30):
            conversation = store.create_conversation("tiny", "fp32")
            store.add_message(conversation.id, "user", f"Question {i}: " + "what is the capital? " * 20)
            store.add_message(conversation.id, "assistant", f"Answer {i}: " + "Paris is. " * 20)


def overwrite_fts_pages(db_path) -> list[int]:
    """Overwrite every page of the full-text index's tables (their b-tree headers included)."""
    raw = sqlite3.connect(db_path)
    page_size = raw.execute("PRAGMA page_size").fetchone()[0]
    marks = ",".join("?" * len(FTS_TABLES))
    query = f"SELECT rootpage FROM sqlite_master WHERE name IN ({marks})"
    pages = [row[0] for row in raw.execute(query, FTS_TABLES)]
    raw.close()
    data = bytearray(db_path.read_bytes())
    for page in pages:
        start = (page - 1) * page_size
        data[start : start + page_size] = b"\xa5" * page_size
    db_path.write_bytes(bytes(data))
    return pages


def zero_fts_segments(db_path) -> None:
    """Zero the index's segment data; every page stays a well-formed page."""
    raw = sqlite3.connect(db_path, isolation_level=None)
    raw.execute("UPDATE messages_fts_data SET block = zeroblob(length(block)) WHERE id > 10")
    assert raw.execute("PRAGMA quick_check").fetchone()[0] == "ok"  # opening cannot see this
    raw.close()


def conversation_count(db_path) -> int:
    raw = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        return raw.execute("SELECT count(*) FROM conversations").fetchone()[0]
    finally:
        raw.close()


@pytest.fixture
def data(tmp_path, monkeypatch):
    directory = tmp_path / "data"
    monkeypatch.setenv("LLMCHAT_DATA_DIR", str(directory))
    filled_store(directory)
    return directory


def test_ask_leaves_a_store_with_a_corrupt_full_text_index_byte_for_byte_unchanged(data, tiny_model_dir):
    from tui.cli import app

    db = data / DB_NAME
    assert overwrite_fts_pages(db)
    before = digest(db)
    runner = CliRunner()
    result = runner.invoke(app, ["ask", "-m", str(tiny_model_dir), "-t", "0", "-n", "4", "hello"])
    assert result.exit_code == 0, result.output
    assert "not saving this conversation" in result.output and "damaged" in result.output
    assert "saved as conversation" not in result.output
    assert digest(db) == before
    assert sorted(p.name for p in data.iterdir()) == [DB_NAME]  # no cache file, no journal left
    # What it holds can still be read.
    listing = runner.invoke(app, ["conversations", "list"])
    assert listing.exit_code == 0 and len(listing.output.splitlines()) == 31
    assert digest(db) == before


def test_a_chat_on_a_store_damaged_where_opening_cannot_see_creates_nothing(data, tiny_loaded):
    db = data / DB_NAME
    zero_fts_segments(db)
    before, count = digest(db), conversation_count(db)
    with Store(data) as store:
        chat = SavedChat(ChatSession(tiny_loaded, SamplingSettings(temperature=0.0, max_new_tokens=4)), store)
        events = list(chat.send("what is the capital?"))
        notices = [e.message for e in events if isinstance(e, Notice)]
        assert any(n.startswith("saving is off") for n in notices), notices
        assert any(isinstance(e, TurnFinished) for e in events)  # the chat goes on
        assert chat.conversation_id is None and chat.store is None
        # Once damage is seen, every write is refused, even one that would not touch the index.
        assert store.damaged
        with pytest.raises(StoreError, match="damaged"):
            store.rename(1, "renamed")
        with pytest.raises(StoreError, match="damaged"):
            store.create_conversation("tiny", "fp32")
        assert store.conversation(1).title.startswith("Question 0")  # reading goes on
    assert conversation_count(db) == count
    assert digest(db) == before
