"""Issue 17, data lost: two writers on one conversation.

Appends are serialised against the conversation's head: a writer says which leaf it last saw,
and a write to a conversation that moved since fails whole (ConversationChanged). A turn holds
the conversation from its question to its answer (an OS file lock, let go if the process
dies), so a second `llmchat ask --conversation last` that loaded the conversation mid-answer
cannot put its question after the unanswered one (ConversationBusy). The loser gets one line
and a nonzero exit; nothing in the store is corrupted.
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

import engine.saved.store as saved_store
from engine.events import Failed, Notice, TokenSampled, TurnFinished
from engine.sampling import SamplingSettings
from engine.saved.chat import SavedChat
from engine.saved.store import Store
from engine.session import ChatSession
from tests.reliability.endless import (
    ROOT,
    Drain,
    ask_command,
    build_endless_model,
    private_env,
    read_until_token,
)

GREEDY = SamplingSettings(temperature=0.0, max_new_tokens=6)


def branch(store: Store, conversation_id: int) -> list[tuple[str, str]]:
    return [(m.role, m.content) for m in store.path(conversation_id)]


def contents(store: Store, conversation_id: int) -> list[str]:
    """Every message of every branch."""
    return [m.content for m in store.messages(conversation_id)]


# -- the store: two connections racing one head ------------------------------------------
def test_two_stores_appending_to_the_same_head_one_wins_and_the_other_writes_nothing(tmp_path):
    with Store(tmp_path) as first, Store(tmp_path) as second:
        conversation = first.create_conversation()
        question = first.add_message(conversation.id, "user", "Q")
        head = second.conversation(conversation.id).leaf_id  # both read the head...
        first.add_message(conversation.id, "assistant", "A1", question.id, expected_leaf=head)
        with pytest.raises(saved_store.ConversationChanged, match=f"conversation {conversation.id} changed"):
            second.add_message(conversation.id, "assistant", "A2", question.id, expected_leaf=head)
        assert branch(second, conversation.id) == [("user", "Q"), ("assistant", "A1")]
        assert contents(second, conversation.id) == ["Q", "A1"]


def test_a_conversation_is_held_by_one_turn_at_a_time(tmp_path):
    with Store(tmp_path) as first, Store(tmp_path) as second:
        conversation = first.create_conversation()
        with first.turn(conversation.id):
            with pytest.raises(
                saved_store.ConversationBusy, match=f"conversation {conversation.id} is being"
            ):
                with second.turn(conversation.id):
                    pass
            with second.turn(conversation.id + 1):  # another conversation is free
                pass
        with second.turn(conversation.id):  # free again once the turn is over
            pass


# -- saved chats: two views of one conversation -----------------------------------------------
def chat(loaded, directory: Path) -> SavedChat:
    return SavedChat(ChatSession(loaded, GREEDY), Store(directory))


def first_turn(loaded, directory: Path) -> int:
    started = chat(loaded, directory)
    list(started.send("Q1"))
    return started.conversation_id


def test_a_question_to_a_conversation_that_moved_since_it_was_loaded_is_refused(tiny_loaded, tmp_path):
    conversation_id = first_turn(tiny_loaded, tmp_path)
    one, other = chat(tiny_loaded, tmp_path), chat(tiny_loaded, tmp_path)
    list(one.resume(conversation_id))
    list(other.resume(conversation_id))
    list(one.send("Q2"))
    loaded = list(other.session.messages)
    events = list(other.send("Q3"))
    [failed] = [e for e in events if isinstance(e, Failed)]
    assert f"conversation {conversation_id} changed" in failed.message and "\n" not in failed.message
    assert not [e for e in events if isinstance(e, TokenSampled)]  # refused before answering
    store = one.store
    assert [role for role, _ in branch(store, conversation_id)] == ["user", "assistant"] * 2
    assert "Q3" not in contents(store, conversation_id)
    assert other.session.messages == loaded  # the refused question is not in the session either


def test_a_question_while_another_turn_is_answering_is_refused(tiny_loaded, tmp_path):
    conversation_id = first_turn(tiny_loaded, tmp_path)
    one, other = chat(tiny_loaded, tmp_path), chat(tiny_loaded, tmp_path)
    list(one.resume(conversation_id))
    answering = one.send("Q2")
    for event in answering:  # Q2 is saved and its answer is streaming
        if isinstance(event, TokenSampled):
            break
    list(other.resume(conversation_id))  # loads ... Q2, unanswered
    events = list(other.send("Q3"))
    [failed] = [e for e in events if isinstance(e, Failed)]
    assert f"conversation {conversation_id} is being answered" in failed.message
    finished = [e for e in answering if isinstance(e, TurnFinished)]
    assert finished
    store = one.store
    assert branch(store, conversation_id)[2:] == [("user", "Q2"), ("assistant", finished[0].text)]
    assert "Q3" not in contents(store, conversation_id)


def test_an_answer_whose_branch_was_switched_meanwhile_is_kept_as_a_side_version(tiny_loaded, tmp_path):
    with Store(tmp_path) as store:
        conversation_id = store.create_conversation().id
        other_branch = store.add_message(conversation_id, "user", "Q1 (the first version)", None)
        store.add_message(conversation_id, "user", "Q1", None)
        store.add_message(conversation_id, "assistant", "A1")
        one = chat(tiny_loaded, tmp_path)
        list(one.resume(conversation_id))
        answering = one.send("Q2")
        for event in answering:
            if isinstance(event, TokenSampled):
                break
        store.switch_branch(other_branch.id)  # another app moves to the other version meanwhile
        rest = list(answering)
        assert any(
            isinstance(e, Notice) and "changed while this answer was generated" in e.message for e in rest
        )
        assert branch(store, conversation_id) == [("user", "Q1 (the first version)")]  # left as it was moved
        [finished] = [e for e in rest if isinstance(e, TurnFinished)]
        assert contents(store, conversation_id)[-2:] == ["Q2", finished.text]  # the answer is kept


# -- two real `llmchat ask --conversation last` -----------------------------------------------
@pytest.fixture(scope="module")
def endless_model_dir(tmp_path_factory) -> Path:
    return build_endless_model(tmp_path_factory.mktemp("endless-llama"))


def test_two_asks_on_the_last_conversation_at_once(endless_model_dir, tmp_path):
    env = private_env(tmp_path)
    with Store(tmp_path / "data") as store:
        conversation = store.create_conversation(str(endless_model_dir), "fp32")
        store.add_message(conversation.id, "user", "Q1")
        store.add_message(conversation.id, "assistant", "A1")
    first = subprocess.Popen(
        [*ask_command(endless_model_dir, "--conversation", "last", "Q2"), "--json"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        read_until_token(first.stdout)  # Q2 is saved and its answer is streaming
        rest, errors = Drain(first.stdout), Drain(first.stderr)
        second = subprocess.run(
            [*ask_command(endless_model_dir, "--conversation", "last", "Q3"), "--max-new-tokens", "3"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        first.send_signal(signal.SIGINT)  # the first answer stops; its part so far is saved
        assert first.wait(timeout=120) == 130, "".join(errors.join())
    finally:
        first.kill()
    rest.join()
    assert second.returncode == 1
    problems = [line for line in second.stderr.splitlines() if "conversation" in line]
    assert problems == [
        f"llmchat: conversation {conversation.id} is being answered by another llmchat; "
        "try again when that answer has finished"
    ], second.stderr
    with Store(tmp_path / "data") as store:
        path = store.path(conversation.id)
        assert [(m.role, m.content) for m in path[:3]] == [
            ("user", "Q1"),
            ("assistant", "A1"),
            ("user", "Q2"),
        ]
        assert len(path) == 4 and path[3].role == "assistant" and path[3].record.stop == "cancelled"
        assert "Q3" not in contents(store, conversation.id)
