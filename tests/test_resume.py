"""Saved chats: resume with and without the KV cache file, branches, and the CLI on top."""

from __future__ import annotations

import json
import queue

import pytest
from typer.testing import CliRunner

from engine.events import (
    ConversationLoaded,
    Failed,
    MessageSaved,
    Notice,
    PromptTokens,
    StepPaused,
    TokenSampled,
    TurnFinished,
)
from engine.sampling import SamplingSettings
from engine.saved.chat import SavedChat
from engine.saved.store import Store
from engine.session import ChatSession
from tui.fmt import human_bytes

GREEDY = SamplingSettings(temperature=0.0, max_new_tokens=8)
QUESTIONS = ("What is the capital of France?", "How does inference work?", "And Germany?")


def new_chat(loaded, store, sampling=GREEDY, **kwargs) -> SavedChat:
    return SavedChat(ChatSession(loaded, sampling, **kwargs), store)


def turn(events) -> dict:
    """What a consumer saw of one turn."""
    seen = {
        "tokens": [],
        "notices": [],
        "saved": [],
        "loaded": None,
        "failed": None,
        "reused": None,
        "text": None,
    }
    for event in events:
        if isinstance(event, PromptTokens):
            seen["reused"], seen["prompt"] = event.reused, list(event.ids)
        elif isinstance(event, TokenSampled):
            seen["tokens"].append(event.id)
        elif isinstance(event, TurnFinished):
            seen["text"], seen["stop"] = event.text, event.stats.stop
        elif isinstance(event, MessageSaved):
            seen["saved"].append(event)
        elif isinstance(event, ConversationLoaded):
            seen["loaded"] = event
        elif isinstance(event, Notice):
            seen["notices"].append(event.message)
        elif isinstance(event, Failed):
            seen["failed"] = event.message
    return seen


@pytest.fixture
def store(tmp_path):
    with Store(tmp_path) as s:
        yield s


def chat_two_turns(loaded, store) -> SavedChat:
    chat = new_chat(loaded, store, system_prompt="Answer briefly.")
    for question in QUESTIONS[:2]:
        turn(chat.send(question))
    return chat


# -- resume --------------------------------------------------------------------------------
def test_resume_with_the_saved_cache_answers_like_a_fresh_prefill_and_prefills_nothing_old(
    tiny_loaded, store
):
    live = chat_two_turns(tiny_loaded, store)
    saved = live.save_cache().message
    size = store.cache_path(live.conversation_id).stat().st_size
    assert saved == f"KV cache saved: {len(live.session.cache)} tokens, {human_bytes(size)}"  # as the panels

    with_cache = new_chat(tiny_loaded, store)
    opened = turn(with_cache.resume(live.conversation_id))
    assert opened["notices"] == [
        f"KV cache loaded from disk: {len(live.session.cache)} tokens, no prefill needed"
    ]
    assert with_cache.session.cache.ids == live.session.cache.ids
    assert with_cache.session.system_prompt == "Answer briefly."
    without_cache = new_chat(tiny_loaded, store)
    turn(without_cache.resume(live.conversation_id, use_cache=False))
    assert len(without_cache.session.cache) == 0
    # Three writers from one head: the store would refuse all but the first (issue 17), so only live saves.
    with_cache.store = without_cache.store = None

    never_closed = turn(live.send(QUESTIONS[2]))
    resumed = turn(with_cache.send(QUESTIONS[2]))
    fresh = turn(without_cache.send(QUESTIONS[2]))

    assert resumed["tokens"] == fresh["tokens"] == never_closed["tokens"]
    assert resumed["prompt"] == fresh["prompt"] == never_closed["prompt"]
    assert fresh["reused"] == 0
    # Resuming from the file reuses exactly what the never-closed session reused.
    assert resumed["reused"] == never_closed["reused"] > len(resumed["prompt"]) // 2


def test_resume_restores_the_messages_and_their_ids(tiny_loaded, store):
    live = chat_two_turns(tiny_loaded, store)
    chat = new_chat(tiny_loaded, store)
    seen = turn(chat.resume("last"))
    assert chat.conversation_id == live.conversation_id
    assert chat.session.messages == live.session.messages
    assert chat.message_ids == live.message_ids
    assert [(m.id, m.role, m.content) for m in seen["loaded"].messages] == [
        (i, m.role, m.content) for i, m in zip(live.message_ids, live.session.messages)
    ]
    assert seen["notices"] == ["no saved KV cache: the history will be prefilled"]
    # The next turn continues the same conversation in the store.
    turn(chat.send(QUESTIONS[2]))
    assert len(store.path(live.conversation_id)) == 6


def test_a_cache_file_that_does_not_fit_is_ignored_and_the_answer_is_unchanged(tiny_loaded, store):
    live = chat_two_turns(tiny_loaded, store)
    path = store.cache_path(live.conversation_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x00" * 64)
    chat = new_chat(tiny_loaded, store)
    opened = turn(chat.resume(live.conversation_id))
    assert opened["notices"][0].startswith("saved KV cache ignored (unreadable")
    answer = turn(chat.send(QUESTIONS[2]))
    assert answer["reused"] == 0
    live.store = None  # its view is one turn behind now: the store would refuse its save (issue 17)
    assert answer["tokens"] == turn(live.send(QUESTIONS[2]))["tokens"]


def test_resume_of_an_unknown_conversation_fails_cleanly(tiny_loaded, store):
    chat = new_chat(tiny_loaded, store)
    assert turn(chat.resume(99))["failed"] == "no conversation 99"
    assert turn(new_chat(tiny_loaded, None).resume("last"))["failed"].startswith(
        "conversations are not being saved"
    )


def test_a_prompt_left_unanswered_is_answered_by_regenerate(tiny_loaded, store):
    live = chat_two_turns(tiny_loaded, store)
    store.add_message(live.conversation_id, "user", "Killed before the answer")
    chat = new_chat(tiny_loaded, store)
    turn(chat.resume("last"))
    answer = turn(chat.regenerate())
    assert answer["text"] is not None
    roles = [m.role for m in store.path(live.conversation_id)]
    assert roles == ["user", "assistant"] * 3


# -- saving as it goes ---------------------------------------------------------------------
def test_every_message_is_saved_before_its_turn_finishes(tiny_loaded, store):
    chat = new_chat(tiny_loaded, store)
    watched = (MessageSaved, PromptTokens, TurnFinished)
    order = [type(e).__name__ for e in chat.send(QUESTIONS[0]) if isinstance(e, watched)]
    assert order == ["MessageSaved", "PromptTokens", "MessageSaved", "TurnFinished"]
    answer = store.path(chat.conversation_id)[-1]
    assert answer.record.model == tiny_loaded.info.spec and answer.record.precision == "fp32"
    assert answer.record.sampling["temperature"] == 0.0 and answer.record.sampling["max_new_tokens"] == 8
    assert answer.record.tokens == 8 and answer.record.stop == "length" and answer.record.ttft_s > 0


def test_a_cancelled_answer_is_saved_with_its_partial_text(tiny_loaded, store):
    chat = new_chat(tiny_loaded, store, sampling=SamplingSettings(temperature=0.0, max_new_tokens=50))
    chat.session.stop_ids = set()
    text = None
    for event in chat.send(QUESTIONS[0]):
        if isinstance(event, TokenSampled) and event.index == 2:
            chat.session.cancel.set()
        if isinstance(event, TurnFinished):
            text = event.text
    answer = store.path(chat.conversation_id)[-1]
    assert answer.record.stop == "cancelled" and answer.record.tokens == 3
    assert answer.content == text


def test_trimmed_context_keeps_the_ids_aligned_and_the_store_whole(tiny_loaded, store):
    chat = new_chat(tiny_loaded, store, context=110)
    for i in range(6):
        turn(chat.send(f"question number {i} about inference"))
    path = store.path(chat.conversation_id)
    assert len(path) == 12  # nothing is lost on disk
    assert len(chat.session.messages) < 12  # the session dropped old turns to fit
    kept = len(chat.session.messages)
    assert chat.message_ids == [m.id for m in path][-kept:]
    assert [m.content for m in chat.session.messages] == [m.content for m in path][-kept:]


def test_a_refused_prompt_is_taken_back_out_of_the_store(tiny_loaded, store):
    chat = new_chat(tiny_loaded, store, context=110)
    turn(chat.send("short"))
    before = [m.id for m in store.path(chat.conversation_id)]
    refused = turn(chat.send("inference " * 150))
    assert "context window" in refused["failed"]
    assert [m.id for m in store.path(chat.conversation_id)] == before
    assert len(chat.message_ids) == len(chat.session.messages)
    turn(chat.send("short again"))
    assert [m.content for m in store.path(chat.conversation_id)][-2] == "short again"


def test_a_broken_store_turns_saving_off_and_the_chat_goes_on(tiny_loaded, store):
    chat = new_chat(tiny_loaded, store)
    turn(chat.send(QUESTIONS[0]))
    store.close()
    seen = turn(chat.send(QUESTIONS[1]))
    assert seen["notices"][0].startswith("saving is off for the rest of this conversation")
    assert seen["text"] is not None and chat.store is None
    assert chat.save_cache() is None


# -- branches -------------------------------------------------------------------------------
def test_edit_regenerate_and_version_arrows(tiny_loaded, store):
    sampling = SamplingSettings(temperature=1.0, seed=None, max_new_tokens=6)
    chat = new_chat(tiny_loaded, store, sampling=sampling)
    turn(chat.send("first"))
    turn(chat.send("second"))
    first_answer = chat.session.messages[3].content

    regenerated = turn(chat.regenerate())
    assert [(s.index, s.message.version, s.message.versions) for s in regenerated["saved"]] == [(3, 2, 2)]
    assert len(chat.message_ids) == 4

    back = turn(chat.step_version(3, -1))
    assert chat.session.messages[3].content == first_answer
    assert [(m.version, m.versions) for m in back["loaded"].messages] == [(1, 1), (1, 1), (1, 1), (1, 2)]
    assert store.conversation(chat.conversation_id).leaf_id == chat.message_ids[3]

    edited = turn(chat.edit(2, "second, edited"))
    assert [(s.index, s.message.role, s.message.version, s.message.versions) for s in edited["saved"]] == [
        (2, "user", 2, 2),
        (3, "assistant", 1, 1),
    ]
    assert [m.content for m in chat.session.messages][::2] == ["first", "second, edited"]

    old = turn(chat.step_version(2, -1))  # the first version of the question, with its newest answer
    assert [m.content for m in chat.session.messages][2] == "second"
    assert [(m.version, m.versions) for m in old["loaded"].messages][2:] == [(1, 2), (2, 2)]
    assert turn(chat.step_version(2, -1))["loaded"] is None  # already the first version
    turn(chat.step_version(2, +1))
    assert chat.session.messages[2].content == "second, edited"

    # The cache survives moving between branches: the shared prefix is reused.
    after = turn(chat.send("third"))
    assert after["reused"] > 0
    assert (
        len(store.messages(chat.conversation_id)) == 9
    )  # 4 + a regenerated answer + an edit and its answer + 2
    assert turn(chat.step_version(7, 1))["failed"] is not None


def test_a_forked_answer_is_saved_as_a_new_version(tiny_loaded, store):
    chat = new_chat(tiny_loaded, store)
    turn(chat.send("first"))
    turn(chat.send("second"))
    original = chat.session.messages[3].content
    alternative = chat.session.messages[3].trace.steps[2].top_k[1].id
    forked = turn(chat.fork(2, alternative))
    assert [(s.index, s.message.version, s.message.versions) for s in forked["saved"]] == [(3, 2, 2)]
    path = store.path(chat.conversation_id)
    assert [m.id for m in path] == chat.message_ids
    assert path[3].content == chat.session.messages[3].content != original
    assert [m.content for m in store.siblings(path[3].id)] == [original, path[3].content]
    # Forking an earlier answer drops the turns after it from the current branch, not from the store.
    refork = turn(chat.fork(1, chat.session.messages[1].trace.steps[1].top_k[1].id, answer=1))
    assert refork["failed"] is None, refork["failed"]
    assert len(chat.message_ids) == len(chat.session.messages) == 2
    assert [m.id for m in store.path(chat.conversation_id)] == chat.message_ids
    assert len(store.messages(chat.conversation_id)) == 6


def test_the_markdown_export_says_how_each_answer_was_decoded(tiny_loaded, store):
    """It dropped the fork, step mode, the KV cache precision and speculation."""
    from engine.speculative.drafters import PromptLookup
    from engine.speculative.loop import Speculation

    chat = new_chat(tiny_loaded, store, kv_cache="int8")
    chat.session.speculation = Speculation(PromptLookup(), 4)
    turn(chat.send("How does inference work? How does inference work?"))
    chat.session.speculation = None
    turn(chat.send("again"))
    turn(chat.fork(2, chat.session.messages[3].trace.steps[2].top_k[1].id))
    chat.session.step_gate.pause()
    for event in chat.send("and once more"):
        if isinstance(event, StepPaused):
            chat.session.step_gate.take()
    shown = store.export_markdown(chat.conversation_id)
    assert "KV cache int8 · fused · speculative lookup, K 4" in shown
    assert "KV cache int8 · step mode" in shown
    assert "forked at step 3" in shown


def test_resuming_says_when_the_conversation_was_answered_at_another_precision(tiny_loaded, store):
    import dataclasses

    live = chat_two_turns(tiny_loaded, store)
    bf16 = dataclasses.replace(tiny_loaded, info=dataclasses.replace(tiny_loaded.info, precision="bf16"))
    opened = turn(new_chat(bf16, store).resume(live.conversation_id))
    assert (
        "this conversation was answered at fp32; the model runs at bf16 now "
        "(Settings or --precision fp32 switches it)"
    ) in opened["notices"]
    assert not [n for n in turn(new_chat(tiny_loaded, store).resume("last"))["notices"] if "answered" in n]


# -- the CLI -----------------------------------------------------------------------------------
@pytest.fixture
def cli(tmp_path, monkeypatch, tiny_model_dir):
    from tui.cli import app

    monkeypatch.setenv("LLMCHAT_DATA_DIR", str(tmp_path / "data"))
    runner = CliRunner()

    def run(*args: str, input: str | None = None):
        return runner.invoke(app, list(args), input=input)

    run.model = str(tiny_model_dir)
    run.data = tmp_path / "data"
    return run


def json_events(output: str) -> list[dict]:
    return [json.loads(line) for line in output.splitlines() if line.startswith("{")]


def test_ask_saves_and_continues_a_conversation(cli):
    first = cli("ask", "-m", cli.model, "-t", "0", "-n", "6", "hello", "and then?")
    assert first.exit_code == 0, first.output
    assert "saved as conversation 1" in first.output
    with Store(cli.data) as store:
        assert [m.role for m in store.path(1)] == ["user", "assistant"] * 2
        assert store.cache_path(1).is_file()

    again = cli("ask", "-m", cli.model, "-t", "0", "-n", "6", "--json", "--conversation", "last", "more?")
    assert again.exit_code == 0, again.output
    events = json_events(again.output)
    assert any(
        e["event"] == "notice" and e["message"].startswith("KV cache loaded from disk") for e in events
    )
    prompt = next(e for e in events if e["event"] == "prompt")
    cached_tokens = [e for e in events if e["event"] == "token"]
    assert prompt["reused"] > len(prompt["ids"]) // 2
    assert [e["event"] for e in events if e["event"] in ("saved", "turn")] == ["saved", "saved", "turn"]

    # Without the cache file: a full prefill, and the same answer.
    with Store(cli.data) as store:
        store.cache_path(1).unlink()
        store.switch_branch(store.path(1)[3].id)
    fresh = cli("ask", "-m", cli.model, "-t", "0", "-n", "6", "--json", "-c", "1", "--no-save", "more?")
    events = json_events(fresh.output)
    assert next(e for e in events if e["event"] == "prompt")["reused"] == 0
    assert [e["id"] for e in events if e["event"] == "token"] == [e["id"] for e in cached_tokens]
    with Store(cli.data) as store:
        assert len(store.messages(1)) == 6  # --no-save added nothing
        assert not store.cache_path(1).exists()


def test_an_answer_of_one_token_shows_no_rate_it_did_not_measure(cli):
    """One token has no gap to time: its line read 'ITL p50 0.0 ms p90 0.0 ms | ... | decode 0.0
    tok/s | 1 tokens', --json gave 0.0 for each, the saved record '0.0 tok/s · 1 tokens'."""
    said = cli("ask", "-m", cli.model, "-t", "0", "-n", "1", "hello")
    assert said.exit_code == 0, said.output
    line = next(line for line in said.output.splitlines() if line.startswith("[") and "TTFT" in line)
    assert "ITL p50 – p90 – |" in line and "| decode – |" in line and "| 1 token |" in line, line
    assert "– tok/s · 1 token ·" in cli("conversations", "show", "last").output

    def turn_of(tokens: str) -> dict:
        asked = cli("ask", "-m", cli.model, "-t", "0", "-n", tokens, "--json", "--no-save", "hi")
        return next(e for e in json_events(asked.output) if e["event"] == "turn")

    figures = turn_of("1")
    assert figures["generated_tokens"] == 1 and figures["ttft_ms"] > 0
    assert figures["decode_tok_s"] is figures["itl_ms_p50"] is figures["itl_ms_p90"] is None
    figures = turn_of("3")
    assert figures["decode_tok_s"] > 0 and figures["itl_ms_p90"] >= figures["itl_ms_p50"] > 0


def test_ask_no_save_and_bad_references(cli):
    result = cli("ask", "-m", cli.model, "-t", "0", "-n", "4", "--no-save", "hello")
    assert result.exit_code == 0 and "saved as" not in result.output
    with Store(cli.data) as store:
        assert store.list_conversations() == []
    missing = cli("ask", "-m", cli.model, "-c", "7", "hello")
    assert missing.exit_code == 2 and "no conversation 7" in missing.output
    both = cli("ask", "-m", cli.model, "-c", "last", "--system", "x", "hello")
    assert both.exit_code == 2 and "--system cannot change a saved conversation" in both.output


def test_ask_runs_on_without_a_usable_store(cli):
    cli.data.mkdir()
    (cli.data / "conversations.db").write_bytes(b"garbage" * 100)
    result = cli("ask", "-m", cli.model, "-t", "0", "-n", "4", "hello")
    assert result.exit_code == 0, result.output
    assert (
        "not saving this conversation" in result.output and "not a readable llmchat database" in result.output
    )
    assert (cli.data / "conversations.db").read_bytes() == b"garbage" * 100


def test_conversations_commands(cli):
    cli("ask", "-m", cli.model, "-t", "0", "-n", "4", "What is the capital of France?")
    cli("ask", "-m", cli.model, "-t", "0", "-n", "4", "How does inference work?")
    listing = cli("conversations", "list")
    assert listing.exit_code == 0
    lines = listing.output.splitlines()
    assert lines[0].split() == ["id", "updated", "turns", "model", "title"]
    assert lines[1].split()[0] == "2" and lines[1].endswith("How does inference work?")
    assert lines[2].split()[0] == "1" and lines[2].split()[3] == "1"

    found = cli("conversations", "list", "--search", "capital")
    assert found.exit_code == 0 and "[capital]" in found.output and "inference" not in found.output

    shown = cli("conversations", "show", "1")
    assert shown.exit_code == 0 and shown.output.startswith("# What is the capital of France?")
    assert "## Assistant" in shown.output and "stop: length" in shown.output

    exported = cli("conversations", "export", "last", "--format", "json")
    assert json.loads(exported.output)["conversation"]["id"] == 2
    bad = cli("conversations", "export", "1", "--format", "pdf")
    assert bad.exit_code == 1 and "md or json" in bad.output

    assert cli("conversations", "rename", "1", "Capitals").exit_code == 0
    assert "Capitals" in cli("conversations", "list").output

    kept = cli("conversations", "delete", "1", input="n\n")
    assert kept.exit_code == 1 and "nothing deleted" in kept.output
    gone = cli("conversations", "delete", "1", input="y\n")
    assert gone.exit_code == 0 and "deleted conversation 1" in gone.output
    assert cli("conversations", "show", "1").exit_code == 1


# -- the real model ---------------------------------------------------------------------------
@pytest.mark.real_model
def test_real_model_resume_from_cache_file_equals_a_fresh_prefill(smollm2, tmp_path):
    sampling = SamplingSettings(temperature=0.0, max_new_tokens=24)
    with Store(tmp_path) as store:
        live = new_chat(smollm2, store, sampling=sampling)
        turn(live.send("What is the capital of France?"))
        turn(live.send("Name a famous museum there."))
        assert live.save_cache() is not None
        conversation_id = live.conversation_id

        cached = new_chat(smollm2, store, sampling=sampling)
        assert turn(cached.resume(conversation_id))["notices"][0].startswith("KV cache loaded")
        history = len(cached.session.cache)
        with_cache = turn(cached.send("How old is it?"))

        plain = new_chat(smollm2, store, sampling=sampling)
        turn(plain.resume(conversation_id, use_cache=False))
        without_cache = turn(plain.send("How old is it?"))

    assert without_cache["reused"] == 0
    assert with_cache["reused"] >= history - 2  # at most the re-tokenized end of the last answer differs
    assert with_cache["text"] == without_cache["text"] and with_cache["text"]


# -- through the inference worker ---------------------------------------------------------------
class Recorder:
    """The worker's events, in order; `until` waits for the next one of a kind."""

    def __init__(self):
        self.events: queue.Queue = queue.Queue()

    def __call__(self, event) -> None:
        self.events.put(event)

    def until(self, kind) -> list:
        seen = [self.events.get(timeout=60)]
        while not isinstance(seen[-1], kind):
            seen.append(self.events.get(timeout=60))
        return seen


def test_the_worker_saves_resumes_and_moves_between_versions(tiny_model_dir, tmp_path):
    from engine.worker import InferenceWorker

    sampling = SamplingSettings(temperature=0.0, max_new_tokens=6)
    recorder = Recorder()
    with Store(tmp_path) as store:
        worker = InferenceWorker(recorder, sampling, store=store)
        worker.load(str(tiny_model_dir), "fp32", "cpu")
        worker.send("hello")
        saved = [e for e in recorder.until(TurnFinished) if isinstance(e, MessageSaved)]
        assert [(e.index, e.message.role) for e in saved] == [(0, "user"), (1, "assistant")]
        worker.regenerate()
        recorder.until(TurnFinished)
        worker.shutdown()  # saves the KV cache file on the way out
        conversation_id = saved[0].conversation_id
        assert store.cache_path(conversation_id).is_file()

        recorder = Recorder()
        worker = InferenceWorker(recorder, sampling, store=store)
        worker.load(str(tiny_model_dir), "fp32", "cpu")
        worker.resume("last")
        events = recorder.until(ConversationLoaded)
        loaded = events[-1]
        assert [(m.role, m.version, m.versions) for m in loaded.messages] == [
            ("user", 1, 1),
            ("assistant", 2, 2),
        ]
        assert recorder.until(Notice)[-1].message.startswith("KV cache loaded from disk")
        worker.step_version(1, -1)
        older = recorder.until(ConversationLoaded)[-1]
        assert [(m.version, m.versions) for m in older.messages] == [(1, 1), (1, 2)]
        worker.send("again")
        prompt = next(e for e in recorder.until(TurnFinished) if isinstance(e, PromptTokens))
        assert prompt.reused > 0
        worker.shutdown()
        assert [m.role for m in store.path(conversation_id)] == ["user", "assistant", "user", "assistant"]
