"""The conversation store: the tree of messages, search, export, durability and bad files."""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine.saved.store import DB_NAME, SCHEMA_VERSION, AnswerRecord, Store, StoreError, data_dir, fts_query

ROOT = Path(__file__).resolve().parent.parent

RECORD = AnswerRecord(
    model="tiny", precision="fp32", sampling={"temperature": 0.0, "seed": 7, "top_k": 0}, stop="eos",
    prompt_tokens=20, reused_tokens=0, tokens=5, ttft_s=0.25, itl_p50_s=0.01, itl_p90_s=0.02,
    prefill_tok_s=80.0, decode_tok_s=100.0,
)  # fmt: skip


@pytest.fixture
def store(tmp_path):
    with Store(tmp_path) as s:
        yield s


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def two_turns(store: Store):
    conversation = store.create_conversation("tiny", "fp32", "Be brief.")
    ids = [
        store.add_message(conversation.id, "user", "What is the capital of France?").id,
        store.add_message(conversation.id, "assistant", "Paris.", record=RECORD).id,
        store.add_message(conversation.id, "user", "And of Germany?").id,
        store.add_message(conversation.id, "assistant", "Berlin.", record=RECORD).id,
    ]
    return conversation.id, ids


# -- the basics -----------------------------------------------------------------------
def test_messages_survive_reopening_with_their_record(tmp_path):
    with Store(tmp_path) as store:
        conversation_id, ids = two_turns(store)
    with Store(tmp_path) as store:
        path = store.path(conversation_id)
        conversation = store.conversation(conversation_id)
    assert [m.content for m in path] == [
        "What is the capital of France?",
        "Paris.",
        "And of Germany?",
        "Berlin.",
    ]
    assert [m.parent_id for m in path] == [None, *ids[:3]]
    assert path[1].record == RECORD and path[0].record is None
    assert conversation.leaf_id == ids[-1]
    assert conversation.system_prompt == "Be brief."
    assert conversation.title == "What is the capital of France?"


def test_data_dir_comes_from_the_argument_then_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMCHAT_DATA_DIR", str(tmp_path / "from-env"))
    assert data_dir() == tmp_path / "from-env"
    assert data_dir(tmp_path / "arg") == tmp_path / "arg"
    with Store() as store:
        assert store.db_path == tmp_path / "from-env" / DB_NAME
    assert (tmp_path / "from-env" / DB_NAME).is_file()


def test_list_shows_title_turns_and_model_newest_first(store):
    first, _ = two_turns(store)
    second = store.create_conversation("other-model", "bf16").id
    store.add_message(second, "user", "  A   long question " + "word " * 20)
    rows = store.list_conversations()
    assert [r.id for r in rows] == [second, first]
    assert rows[1].turns == 2 and rows[1].model == "tiny" and rows[1].precision == "fp32"
    assert rows[0].turns == 1 and rows[0].model == "other-model"
    assert rows[0].title.startswith("A long question word") and len(rows[0].title) <= 60
    assert store.resolve("last") == second
    assert store.resolve(str(first)) == first
    assert [r.id for r in store.list_conversations(limit=1)] == [second]


def test_resolve_explains_bad_references(store):
    with pytest.raises(StoreError, match="no saved conversations"):
        store.resolve("last")
    with pytest.raises(StoreError, match="not a conversation id"):
        store.resolve("yesterday")
    with pytest.raises(StoreError, match="no conversation 42"):
        store.resolve("42")


def test_the_model_of_the_latest_answer_is_the_conversations_model(store):
    conversation_id, _ = two_turns(store)
    store.add_message(conversation_id, "user", "Again?")
    other = dataclasses.replace(RECORD, model="smollm2-135m", precision="int8")
    store.add_message(conversation_id, "assistant", "Yes.", record=other)
    conversation = store.conversation(conversation_id)
    assert (conversation.model, conversation.precision) == ("smollm2-135m", "int8")


def test_rename_and_delete(store):
    conversation_id, _ = two_turns(store)
    keep, _ = two_turns(store)
    store.rename(conversation_id, "  Capitals  ")
    assert store.conversation(conversation_id).title == "Capitals"
    cache = store.cache_path(conversation_id)
    cache.parent.mkdir(parents=True)
    cache.write_bytes(b"kv")
    store.delete(conversation_id)
    assert not cache.exists()
    assert [r.id for r in store.list_conversations()] == [keep]
    assert {h.conversation_id for h in store.search("Paris")} == {keep}
    with pytest.raises(StoreError, match="no conversation"):
        store.path(conversation_id)
    with pytest.raises(StoreError, match="no conversation"):
        store.delete(conversation_id)


def test_a_message_must_belong_to_its_conversation(store):
    first, ids = two_turns(store)
    second = store.create_conversation().id
    with pytest.raises(StoreError, match="not in conversation"):
        store.add_message(second, "user", "hi", parent_id=ids[0])
    with pytest.raises(StoreError, match="role"):
        store.add_message(first, "system", "hi")
    assert store.conversation(second).leaf_id is None


def test_delete_message_takes_back_an_unanswered_prompt(store):
    conversation_id, ids = two_turns(store)
    refused = store.add_message(conversation_id, "user", "far too long").id
    store.delete_message(refused)
    assert store.conversation(conversation_id).leaf_id == ids[-1]
    assert [m.id for m in store.path(conversation_id)] == ids
    with pytest.raises(StoreError, match="has replies"):
        store.delete_message(ids[0])


# -- search ------------------------------------------------------------------------------
def test_search_matches_every_word_and_a_prefix_of_the_last(store):
    conversation_id, ids = two_turns(store)
    hits = store.search("capital fra")
    assert [(h.conversation_id, h.message_id, h.role) for h in hits] == [(conversation_id, ids[0], "user")]
    assert "[capital]" in hits[0].snippet
    assert [h.message_id for h in store.search("berlin")] == [ids[3]]
    assert store.search("capital berlin") == []
    assert store.search("   ") == []


@pytest.mark.parametrize("query", ['"', "a OR", "NEAR(", "-x", "*", "col:umn", "o'brien", "(((", "AND"])
def test_search_treats_syntax_characters_as_text(store, query):
    two_turns(store)
    assert isinstance(store.search(query), list)


def test_fts_query_quotes_every_word():
    assert fts_query('say "hi" now') == '"say" """hi""" "now"*'
    assert fts_query("") == ""


# -- branches ----------------------------------------------------------------------------
def test_edit_and_regenerate_keep_old_branches_and_switch_between_them(store):
    conversation_id, (q1, a1, q2, a2) = two_turns(store)
    # Regenerate the last answer: a sibling of a2.
    a2b = store.add_message(
        conversation_id, "assistant", "Berlin, since 1990.", parent_id=q2, record=RECORD
    ).id
    # Edit the second question: a sibling of q2, answered on its own branch.
    q2b = store.add_message(conversation_id, "user", "And of Italy?", parent_id=a1).id
    a2c = store.add_message(conversation_id, "assistant", "Rome.", record=RECORD).id
    assert [m.id for m in store.path(conversation_id)] == [q1, a1, q2b, a2c]
    assert [m.id for m in store.siblings(q2)] == [q2, q2b]
    assert [m.id for m in store.siblings(a2)] == [a2, a2b]
    assert [m.id for m in store.siblings(a2c)] == [a2c]
    assert [m.id for m in store.siblings(q1)] == [q1]

    # Back to the first version of question 2: lands on its newest answer.
    path = store.switch_branch(q2)
    assert [m.id for m in path] == [q1, a1, q2, a2b]
    assert store.conversation(conversation_id).leaf_id == a2b
    assert [m.id for m in store.switch_branch(a2)] == [q1, a1, q2, a2]
    # New messages continue the branch that is current.
    q3 = store.add_message(conversation_id, "user", "Thanks").id
    assert [m.id for m in store.path(conversation_id)] == [q1, a1, q2, a2, q3]
    assert len(store.messages(conversation_id)) == 8


def test_a_first_message_can_have_versions_too(store):
    conversation_id, (q1, *_rest) = two_turns(store)
    q1b = store.add_message(conversation_id, "user", "Hello?", parent_id=None).id
    assert [m.id for m in store.siblings(q1)] == [q1, q1b]
    assert [m.id for m in store.path(conversation_id)] == [q1b]
    assert store.list_conversations()[0].turns == 1


# -- export --------------------------------------------------------------------------------
def test_export_markdown_shows_the_current_branch_and_how_answers_were_made(store):
    conversation_id, (q1, a1, q2, a2) = two_turns(store)
    store.add_message(conversation_id, "user", "And of Italy?", parent_id=a1)
    text = store.export_markdown(conversation_id)
    assert text.startswith("# What is the capital of France?\n")
    assert "## System\n\nBe brief." in text
    assert "## User\n\nAnd of Italy?" in text
    assert "Germany" not in text  # the other branch is not on the current path
    assert "## Assistant\n\nParis." in text
    record = (
        "*tiny · fp32 · seed 7, temperature 0.0, top_k 0 · TTFT 250 ms · 100.0 tok/s · 5 tokens · stop: eos*"
    )
    assert record in text


def test_export_json_holds_every_branch(store):
    conversation_id, (q1, a1, q2, a2) = two_turns(store)
    q2b = store.add_message(conversation_id, "user", "And of Italy?", parent_id=a1).id
    data = json.loads(json.dumps(store.export_json(conversation_id)))
    assert data["format"] == "llmchat-conversation" and data["version"] == SCHEMA_VERSION
    assert data["conversation"]["system_prompt"] == "Be brief."
    assert data["current_path"] == [q1, a1, q2b]
    by_id = {m["id"]: m for m in data["messages"]}
    assert set(by_id) == {q1, a1, q2, a2, q2b}
    assert by_id[q2]["parent_id"] == a1 and by_id[q2b]["parent_id"] == a1
    assert by_id[a2]["record"]["sampling"] == {"seed": 7, "temperature": 0.0, "top_k": 0}
    assert by_id[a2]["record"]["ttft_s"] == 0.25
    assert by_id[q1]["record"] is None


# -- bad files: a clear error, and the file is left as it was --------------------------------
def test_a_corrupt_file_is_refused_and_left_untouched(tmp_path):
    db = tmp_path / DB_NAME
    db.write_bytes(os.urandom(8192))
    before = digest(db)
    with pytest.raises(StoreError, match="not a readable llmchat database") as error:
        Store(tmp_path)
    assert "\n" not in str(error.value)
    assert digest(db) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [DB_NAME]


def test_a_damaged_database_gives_a_store_error_not_a_crash(tmp_path):
    with Store(tmp_path) as store:
        for _ in range(30):
            two_turns(store)
    db = tmp_path / DB_NAME
    data = bytearray(db.read_bytes())
    page = 4096
    data[page : len(data)] = b"\xff" * (len(data) - page)  # keep the header page, ruin the rest
    db.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="not a readable llmchat database"):
        with Store(tmp_path) as store:
            store.list_conversations()
            store.search("Paris")


def test_a_newer_format_is_refused_and_left_untouched(tmp_path):
    db = tmp_path / DB_NAME
    raw = sqlite3.connect(db)
    raw.execute("CREATE TABLE future (x)")
    raw.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    raw.commit()
    raw.close()
    before = digest(db)
    with pytest.raises(StoreError, match=f"newer llmchat \\(format {SCHEMA_VERSION + 1}"):
        Store(tmp_path)
    assert digest(db) == before


def test_a_foreign_database_is_refused_and_left_untouched(tmp_path):
    db = tmp_path / DB_NAME
    raw = sqlite3.connect(db)
    raw.execute("CREATE TABLE notes (text)")
    raw.execute("INSERT INTO notes VALUES ('mine')")
    raw.commit()
    raw.close()
    before = digest(db)
    with pytest.raises(StoreError, match="did not write"):
        Store(tmp_path)
    assert digest(db) == before


def test_a_locked_store_is_a_clear_error_and_works_once_free(tmp_path):
    with Store(tmp_path) as store:
        conversation_id, _ = two_turns(store)
    blocker = sqlite3.connect(tmp_path / DB_NAME, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    try:
        with Store(tmp_path, timeout_s=0.2) as store:
            assert len(store.path(conversation_id)) == 4  # WAL: reading goes on
            with pytest.raises(StoreError, match="locked by another process"):
                store.add_message(conversation_id, "user", "blocked")
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    with Store(tmp_path) as store:
        store.add_message(conversation_id, "user", "free again")
        assert [m.content for m in store.path(conversation_id)][-2:] == ["Berlin.", "free again"]


def test_a_store_locked_while_opening_is_a_clear_error(tmp_path):
    db = tmp_path / DB_NAME
    blocker = sqlite3.connect(db, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")  # a new file is in rollback mode: this blocks even reads
    try:
        with pytest.raises(StoreError, match="locked by another process"):
            Store(tmp_path, timeout_s=0.2)
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()


def test_a_data_dir_that_cannot_be_created_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(StoreError, match="cannot create the data directory"):
        Store(blocker / "llmchat")
    assert blocker.read_text() == "not a directory"


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_an_unwritable_data_dir_is_a_clear_error(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(StoreError, match="cannot be opened for writing"):
            Store(locked)
    finally:
        locked.chmod(0o700)


# -- two processes, and kill -9 --------------------------------------------------------------
WRITER = textwrap.dedent(
    """
    import sys
    from engine.saved.store import Store
    directory, conversation_id, name, count = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    with Store(directory, timeout_s=30) as store:
        own = store.create_conversation(name).id
        for i in range(count):
            store.add_message(conversation_id, "user", f"{name} {i}")
            store.add_message(own, "user", f"{name} own {i}")
    """
)


def test_two_writer_processes_at_once_lose_nothing(tmp_path):
    count = 150
    with Store(tmp_path) as store:
        shared = store.create_conversation("shared").id
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(tmp_path), str(shared), name, str(count)], cwd=ROOT
        )
        for name in ("alpha", "beta")
    ]
    assert [w.wait(timeout=120) for w in writers] == [0, 0]
    raw = sqlite3.connect(tmp_path / DB_NAME)
    assert raw.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    raw.close()
    with Store(tmp_path) as store:
        path = store.path(shared)
        # Each append read the leaf and extended it in one transaction: one unbroken chain.
        assert len(path) == 2 * count
        for name in ("alpha", "beta"):
            assert [m.content for m in path if m.content.startswith(name)] == [
                f"{name} {i}" for i in range(count)
            ]
        owns = [r for r in store.list_conversations() if r.id != shared]
        assert sorted(r.model for r in owns) == ["alpha", "beta"]
        assert all(r.turns == count for r in owns)
        assert len(store.search("alpha own")) == 50  # the search limit; the index saw every row
        assert len(store.search("alpha own", limit=1000)) == count


CHILD = textwrap.dedent(
    """
    import sys, time
    from engine import models
    from engine.saved.chat import SavedChat
    from engine.events import TokenSampled, TurnFinished
    from engine.sampling import SamplingSettings
    from engine.session import ChatSession
    from engine.saved.store import Store

    loaded = models.load(sys.argv[1], "fp32", "cpu")
    session = ChatSession(loaded, SamplingSettings(temperature=0.0, max_new_tokens=12))
    session.stop_ids = set()  # answers run to max_new_tokens, so the last one is surely in progress
    chat = SavedChat(session, Store(sys.argv[2]))
    for prompt in ("first question", "second question"):
        for event in chat.send(prompt):
            if isinstance(event, TurnFinished):
                print("FINISHED", repr(event.text), flush=True)
    session.sampling = SamplingSettings(temperature=0.0, max_new_tokens=400)
    for event in chat.send("third question"):
        if isinstance(event, TokenSampled):
            if event.index == 0:
                print("DECODING", chat.conversation_id, flush=True)
            time.sleep(0.05)
    print("NOT KILLED", flush=True)
    """
)


def test_finished_turns_survive_kill_9_mid_answer(tmp_path, tiny_model_dir):
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tiny_model_dir), str(tmp_path)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    finished = []
    try:
        for line in child.stdout:
            if line.startswith("FINISHED"):
                finished.append(ast.literal_eval(line.removeprefix("FINISHED ")))
            if line.startswith("DECODING"):
                conversation_id = int(line.split()[1])
                child.send_signal(signal.SIGKILL)
                break
    finally:
        child.kill()
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    assert len(finished) == 2
    with Store(tmp_path) as store:
        path = store.path(conversation_id)
    assert [(m.role, m.content) for m in path] == [
        ("user", "first question"),
        ("assistant", finished[0]),
        ("user", "second question"),
        ("assistant", finished[1]),
        ("user", "third question"),  # saved before the answer began; the answer was not finished
    ]
    assert path[1].record.stop == "length" and path[1].record.tokens == 12
