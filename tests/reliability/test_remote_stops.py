"""Issue 31, hangs and lost answers: a stop is acted on at once whatever the server is doing,
and a shown answer is always saved.

Esc, Ctrl+Q and `ask`'s Ctrl+C used to wait for a slow side call (/apply-template, /tokenize:
the prompt is being prepared) or a chat request the server took and never answered: 12-16 s,
the question unsaved. Each now cuts the call in flight: the turn ends 'cancelled' at once and
the question is saved. A turn that a server's reply breaks in a way nobody foresaw ends like a
failed one, its partial answer saved, so the next prompt is not a second question in a row.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time

import pytest

import engine.remote.session as remote_session
from engine.events import TurnFinished
from engine.remote.session import connect
from engine.remote.target import RemoteTarget
from engine.saved.chat import SavedChat
from engine.saved.store import Store
from tests.reliability.endless import ROOT, Drain, private_env
from tests.reliability.hostile_server import HELLO, chunk, json_reply, late, models_of, stream_reply
from tests.tui_fakes import FakeFactory, fake_app
from tests.tui_screen import wait_for, widget_text
from tui.engine_link import inference_worker
from tui.widgets.chat_log import Answer
from tui.widgets.prompt_input import PromptInput

QUESTION = "Why is the sky blue?"
SILENT_S = 30.0
"""How long a slow call stays silent: far beyond any bound a test allows a stop."""
STOP_BOUND_S = 3.0
"""A stop takes well under a second; the bug took 12-16 s."""

SLOW_PLACES = {
    "apply-template": {
        ("GET", "/v1/models"): models_of("llamacpp"),
        ("POST", "/apply-template"): late(json_reply({"prompt": QUESTION}), SILENT_S),
    },
    "llama.cpp tokenize": {
        ("GET", "/v1/models"): models_of("llamacpp"),
        ("POST", "/apply-template"): json_reply({"prompt": QUESTION}),
        ("POST", "/tokenize"): late(json_reply({"tokens": []}), SILENT_S),
    },
    "vllm tokenize": {
        ("GET", "/v1/models"): models_of("vllm"),
        ("POST", "/tokenize"): late(json_reply({"tokens": [1, 2]}), SILENT_S),
    },
    "chat request never answered": {("POST", "/v1/chat/completions"): late(HELLO, SILENT_S)},
}
SLOW_PATH = {
    "apply-template": "/apply-template",
    "llama.cpp tokenize": "/tokenize",
    "vllm tokenize": "/tokenize",
    "chat request never answered": "/v1/chat/completions",
}


def requested(server, path: str) -> bool:
    return any(p.split("?")[0] == path for _, p, _, _ in server.requests)


def wait_until_requested(server, path: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not requested(server, path):
        assert time.monotonic() < deadline, f"{path} was never requested: {server.requests}"
        time.sleep(0.02)
    time.sleep(0.2)  # the call is in flight, waiting for the silent server


def saved_turns(data_dir) -> list:
    with Store(data_dir) as store:
        [summary] = store.list_conversations()
        return store.path(summary.id)


def open_chat(server, tmp_path) -> SavedChat:
    session = connect(RemoteTarget(server.url, read_timeout_s=SILENT_S * 2))
    return SavedChat(session, Store(tmp_path / "data"))


# -- the engine: a stop cuts the call in flight ---------------------------------------------------
@pytest.mark.parametrize("place", list(SLOW_PLACES))
def test_a_stop_before_the_stream_starts_ends_the_turn_at_once(hostile, tmp_path, place):
    server = hostile(SLOW_PLACES[place])
    chat = open_chat(server, tmp_path)
    stopped_at: list[float] = []

    def press_esc() -> None:
        wait_until_requested(server, SLOW_PATH[place])
        stopped_at.append(time.monotonic())
        chat.session.cancel.set()

    threading.Thread(target=press_esc, daemon=True).start()
    events = list(chat.send(QUESTION))
    took = time.monotonic() - stopped_at[0]
    chat.session.close()

    [finished] = [e for e in events if isinstance(e, TurnFinished)]
    assert finished.stats.stop == "cancelled" and not finished.error
    assert took < STOP_BOUND_S, f"the stop took {took:.1f} s"
    question, answer = saved_turns(tmp_path / "data")
    assert (question.role, question.content) == ("user", QUESTION)
    assert answer.role == "assistant" and answer.record.stop == "cancelled"
    if place != "chat request never answered":  # stopped before it was asked: nothing to generate
        assert not requested(server, "/v1/chat/completions")


# -- ask: Ctrl+C -----------------------------------------------------------------------------------
def test_ask_ctrl_c_while_the_prompt_is_prepared_exits_at_once_and_saves_the_question(hostile, tmp_path):
    server = hostile(SLOW_PLACES["apply-template"])
    command = [sys.executable, "-m", "tui.cli", "ask", "--server", server.url, "--json", QUESTION]
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env=private_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, errors = Drain(process.stdout), Drain(process.stderr)
        wait_until_requested(server, "/apply-template")
        process.send_signal(signal.SIGINT)
        sent = time.monotonic()
        code = process.wait(timeout=SILENT_S)
        took = time.monotonic() - sent
    finally:
        process.kill()
    errors = "".join(errors.join())
    assert code == 130, errors
    assert took < STOP_BOUND_S, f"Ctrl+C took {took:.1f} s"
    assert "Traceback" not in errors and "interrupted" in errors
    [turn] = [json.loads(line) for line in out.join() if '"event": "turn"' in line]
    assert turn["stop"] == "cancelled"
    question, answer = saved_turns(tmp_path / "data")
    assert question.content == QUESTION and answer.record.stop == "cancelled"


# -- the app: Esc and Ctrl+Q -------------------------------------------------------------------------
def remote_app(server, tmp_path, monkeypatch):
    monkeypatch.setenv("LLMCHAT_DATA_DIR", str(tmp_path / "data"))
    return fake_app(inference_worker, tmp_path, server=server.url, read_timeout_s=SILENT_S * 2)


async def ask_in_app(pilot, server) -> None:
    app = pilot.app
    await wait_for(pilot, lambda: app.turns.ready, timeout=60, what="the server to answer")
    await pilot.press(*QUESTION, "enter")
    await asyncio.to_thread(wait_until_requested, server, "/apply-template")


def test_esc_while_the_prompt_is_prepared_stops_the_turn_at_once(hostile, tmp_path, monkeypatch):
    server = hostile(SLOW_PLACES["apply-template"])

    async def scenario():
        app = remote_app(server, tmp_path, monkeypatch)
        async with app.run_test(size=(120, 40)) as pilot:
            await ask_in_app(pilot, server)
            await pilot.press("escape")
            await wait_for(pilot, lambda: not app.turns.busy, timeout=STOP_BOUND_S, what="the turn to end")
            await pilot.pause(0.2)
            shown = widget_text(app.query_one(Answer))
            assert "stopped (Esc)" in shown and "sending" not in shown

    asyncio.run(scenario())
    question, answer = saved_turns(tmp_path / "data")
    assert question.content == QUESTION and answer.record.stop == "cancelled"


def test_ctrl_q_while_the_prompt_is_prepared_quits_at_once(hostile, tmp_path, monkeypatch):
    server = hostile(SLOW_PLACES["apply-template"])
    quit_took: list[float] = []

    async def scenario():
        app = remote_app(server, tmp_path, monkeypatch)
        async with app.run_test(size=(120, 40)) as pilot:
            await ask_in_app(pilot, server)
            pressed = time.monotonic()
            await pilot.press("ctrl+q")
        quit_took.append(time.monotonic() - pressed)

    asyncio.run(scenario())
    assert quit_took[0] < STOP_BOUND_S, f"Ctrl+Q took {quit_took[0]:.1f} s"
    question, answer = saved_turns(tmp_path / "data")
    assert question.content == QUESTION and answer.record.stop == "cancelled"


# -- Esc with a queued prompt ----------------------------------------------------------------------
def test_a_queued_prompt_taken_back_by_esc_is_continued_at_its_end(tmp_path):
    factory = FakeFactory(hold_after=1)

    async def scenario():
        app = fake_app(factory, tmp_path)
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.turns.ready, what="the model")
            await pilot.press(*"first", "enter")
            await wait_for(pilot, factory.engine.holding.is_set, what="the first answer")
            await pilot.press(*"second", "enter")  # queued behind the first answer
            await pilot.press("escape")  # stops the answer; the queued prompt comes back to the input
            prompt = app.query_one(PromptInput)
            await wait_for(pilot, lambda: prompt.text == "second" and not app.turns.busy, what="it back")
            assert prompt.cursor_location == prompt.document.end
            factory.engine.release.set()  # the next answer runs to its end
            await pilot.press(*" please", "enter")
            await wait_for(pilot, lambda: len(factory.engine.turns) == 2 and not app.turns.busy)

    asyncio.run(scenario())
    sent = [call[1] for call in factory.engine.calls if call[0] == "send"]
    assert sent == ["first", "second please"]


# -- an unforeseen failure mid-answer ---------------------------------------------------------------
def failing_after(count: int, monkeypatch) -> None:
    """Make reading the stream's chunk number `count` raise, as a value no check foresaw would."""
    parse, seen = remote_session.parse, []

    def parse_or_fail(raw):
        seen.append(raw)
        if len(seen) == count:
            raise OverflowError("math range error")
        return parse(raw)

    monkeypatch.setattr(remote_session, "parse", parse_or_fail)


FIVE_TOKENS = stream_reply(
    chunk("One"), chunk(" two"), chunk(" three"), chunk(" four"), chunk("", finish="stop")
)


def test_an_unforeseen_error_mid_answer_ends_the_turn_and_saves_the_partial_answer(
    hostile, tmp_path, monkeypatch
):
    server = hostile({("POST", "/v1/chat/completions"): FIVE_TOKENS})
    chat = open_chat(server, tmp_path)
    failing_after(3, monkeypatch)
    events = list(chat.send(QUESTION))
    [finished] = [e for e in events if isinstance(e, TurnFinished)]
    assert finished.stats.stop == "error" and finished.text == "One two"
    assert finished.error == "OverflowError: math range error"

    monkeypatch.setattr(remote_session, "parse", parse_original)
    list(chat.send("And at sunset?"))
    chat.session.close()
    turns = saved_turns(tmp_path / "data")
    assert [(m.role, m.content) for m in turns] == [
        ("user", QUESTION),
        ("assistant", "One two"),
        ("user", "And at sunset?"),
        ("assistant", "One two three four"),
    ]
    assert turns[1].record.stop == "error"


parse_original = remote_session.parse


def test_ask_reports_an_unforeseen_error_and_saves_the_partial_answer(hostile, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from tui.cli import app

    server = hostile({("POST", "/v1/chat/completions"): FIVE_TOKENS})
    monkeypatch.setenv("LLMCHAT_DATA_DIR", str(tmp_path / "data"))
    failing_after(3, monkeypatch)
    result = CliRunner().invoke(app, ["ask", "--server", server.url, "--json", QUESTION])
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    events = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    [turn] = [e for e in events if e["event"] == "turn"]
    assert turn["stop"] == "error" and turn["text"] == "One two"
    assert turn["error"] == "OverflowError: math range error"
    question, answer = saved_turns(tmp_path / "data")
    assert (answer.content, answer.record.stop) == ("One two", "error")


def test_the_app_shows_an_unforeseen_error_as_a_failed_turn_and_keeps_the_answer(
    hostile, tmp_path, monkeypatch
):
    server = hostile({("POST", "/v1/chat/completions"): FIVE_TOKENS})
    failing_after(3, monkeypatch)

    async def scenario():
        app = remote_app(server, tmp_path, monkeypatch)
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.turns.ready, timeout=60, what="the server to answer")
            await pilot.press(*QUESTION, "enter")
            await wait_for(pilot, lambda: requested(server, "/v1/chat/completions") and not app.turns.busy)
            await pilot.pause(0.3)
            assert "One two" in widget_text(app.query_one(Answer))
            monkeypatch.setattr(remote_session, "parse", parse_original)
            await pilot.press(*"And at sunset?", "enter")
            await wait_for(pilot, lambda: len(app.query(Answer)) == 2 and not app.turns.busy)
            await pilot.pause(0.3)

    asyncio.run(scenario())
    turns = saved_turns(tmp_path / "data")
    assert [m.role for m in turns] == ["user", "assistant", "user", "assistant"]
    assert turns[1].content == "One two" and turns[1].record.stop == "error"


QUIET_WHILE_CONNECTING = {
    "models never listed": ({("GET", "/v1/models"): late(models_of("me"), SILENT_S)}, "/v1/models"),
    "slots never answered": (
        {("GET", "/v1/models"): models_of("llamacpp"), ("GET", "/slots"): late(json_reply([]), SILENT_S)},
        "/slots",
    ),
}


@pytest.mark.parametrize("case", list(QUIET_WHILE_CONNECTING))
def test_ctrl_q_while_connecting_quits_at_once(hostile, tmp_path, monkeypatch, case):
    routes, path = QUIET_WHILE_CONNECTING[case]
    server = hostile(routes)
    quit_took: list[float] = []

    async def scenario():
        app = remote_app(server, tmp_path, monkeypatch)
        async with app.run_test(size=(120, 40)) as pilot:
            await asyncio.to_thread(wait_until_requested, server, path)
            pressed = time.monotonic()
            await pilot.press("ctrl+q")
        quit_took.append(time.monotonic() - pressed)

    asyncio.run(scenario())
    assert quit_took[0] < STOP_BOUND_S, f"Ctrl+Q took {quit_took[0]:.1f} s"


def test_an_unforeseen_error_while_the_prompt_is_tokenized_leaves_the_answer_to_come(
    hostile, tmp_path, monkeypatch
):
    server = hostile(
        {("GET", "/v1/models"): models_of("vllm"), ("POST", "/tokenize"): json_reply({"tokens": [1]})}
    )
    chat = open_chat(server, tmp_path)

    def unreadable(*args):
        raise TypeError("int() argument must be a string, a bytes-like object or a real number, not 'dict'")

    monkeypatch.setattr(remote_session.prompts, "tokenize", unreadable)
    events = list(chat.send(QUESTION))
    chat.session.close()
    [finished] = [e for e in events if isinstance(e, TurnFinished)]
    assert (finished.text, finished.stats.stop, finished.error) == ("Hello", "eos", "")
    assert [(m.role, m.content) for m in saved_turns(tmp_path / "data")] == [
        ("user", QUESTION),
        ("assistant", "Hello"),
    ]


def test_a_shown_answer_is_saved_whatever_count_the_server_reports(hostile, tmp_path):
    usage = {"prompt_tokens": 10**30, "completion_tokens": 2, "total_tokens": 10**30 + 2}
    absurd = stream_reply(chunk("Hel"), chunk("lo"), chunk("", finish="stop"), chunk(None, usage=usage))
    server = hostile({("POST", "/v1/chat/completions"): absurd})
    chat = open_chat(server, tmp_path)
    events = list(chat.send(QUESTION))
    chat.session.close()
    [finished] = [e for e in events if isinstance(e, TurnFinished)]
    assert finished.text == "Hello"
    question, answer = saved_turns(tmp_path / "data")
    assert (answer.role, answer.content, answer.record.tokens) == ("assistant", "Hello", 2)
