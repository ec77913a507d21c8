"""Issue 31: replies no streaming chat server should send, read without loss or traceback.

A 401/403 on the chat request (the model list allowed) exited 1 with no `error` event and saved
an empty answer; a server echoing the refused header showed the key; a non-streamed completion
had its content dropped (an empty answer, 'eos'); a lone surrogate in the content could not be
saved or printed; a 3 MB gzip reply inflated to 3.4 GB, and a stream line without its end grew
without bound.
"""

from __future__ import annotations

import gzip
import json

import pytest
from typer.testing import CliRunner

from engine.events import TurnFinished
from engine.remote.client import MAX_BODY
from engine.remote.session import connect
from engine.remote.target import RemoteTarget
from engine.sampling import SamplingSettings
from engine.saved.store import Store
from tests.reliability.hostile_server import Reply, chunk, json_reply, sse, stream_reply
from tui.cli import app

SECRET = "sk-SECRET-123"


def run(*args: str):
    return CliRunner().invoke(app, list(args))


def refusal(status: int, echo: str = "") -> Reply:
    return json_reply({"error": {"message": f"invalid key {echo}".strip()}}, status=status)


@pytest.mark.parametrize("status", [401, 403])
@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_a_refused_chat_request_exits_2_and_saves_nothing(hostile, status, as_json):
    server = hostile({("POST", "/v1/chat/completions"): refusal(status)})
    result = run("ask", *(["--json"] if as_json else []), "--server", server.url, "hi", "and again")
    assert result.exit_code == 2, (result.output, result.exception)
    if as_json:
        last = json.loads(result.stdout.splitlines()[-1])
        assert last["event"] == "error" and f"refused the request ({status}" in last["message"]
    else:
        assert f"refused the request ({status}" in result.stderr.splitlines()[-1]
    assert len([r for r in server.requests if r[0] == "POST"]) == 1  # the follow-up was not sent
    assert Store().list_conversations() == []  # no empty answer, no question without an answer


def test_a_refused_chat_request_leaves_the_session_as_it_was(hostile):
    server = hostile({("POST", "/v1/chat/completions"): refusal(401)})
    session = connect(RemoteTarget(server.url), SamplingSettings(temperature=0))
    events = list(session.send("hi"))
    assert len(events) == 1 and events[0].lasting and "refused" in events[0].message
    assert session.messages == []


def test_a_server_echoing_the_key_does_not_show_it(hostile, monkeypatch):
    monkeypatch.setenv("LLMCHAT_TEST_KEY", SECRET)
    server = hostile({("POST", "/v1/chat/completions"): refusal(401, echo=f"Bearer {SECRET}")})
    result = run("ask", "--json", "--server", server.url, "--api-key-env", "LLMCHAT_TEST_KEY", "hi")
    assert result.exit_code == 2
    assert SECRET not in result.output and "[the key]" in result.output


def test_a_refused_model_list_echoing_the_key_does_not_show_it(hostile, monkeypatch):
    monkeypatch.setenv("LLMCHAT_TEST_KEY", SECRET)
    server = hostile({("GET", "/v1/models"): refusal(403, echo=SECRET)})
    result = run("ask", "--server", server.url, "--api-key-env", "LLMCHAT_TEST_KEY", "hi")
    assert result.exit_code == 2 and SECRET not in result.output and "(403" in result.stderr


COMPLETION = {
    "id": "c",
    "object": "chat.completion",
    "created": 0,
    "model": "fake",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Paris."}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12},
}


def test_a_completion_sent_whole_instead_of_streamed_is_the_answer(hostile):
    server = hostile({("POST", "/v1/chat/completions"): json_reply(COMPLETION)})
    session = connect(RemoteTarget(server.url), SamplingSettings(temperature=0))
    finished = list(session.send("Capital of France?"))[-1]
    assert isinstance(finished, TurnFinished)
    assert finished.text == "Paris." and not finished.error and finished.stats.stop == "eos"
    assert finished.stats.prompt_tokens == 9
    assert session.messages[-1].content == "Paris."


@pytest.mark.parametrize(
    "body", [{"error": {"message": "busy"}}, [1, 2], "text"], ids=["error", "list", "str"]
)
def test_a_json_reply_that_is_no_completion_is_one_line(hostile, body):
    server = hostile({("POST", "/v1/chat/completions"): json_reply(body)})
    session = connect(RemoteTarget(server.url), SamplingSettings(temperature=0))
    finished = list(session.send("hi"))[-1]
    assert finished.stats.stop == "error" and "\n" not in finished.error
    if isinstance(body, dict):
        assert "busy" in finished.error


def test_a_lone_surrogate_in_the_answer_is_saved_and_printed(hostile):
    server = hostile(
        {("POST", "/v1/chat/completions"): stream_reply(chunk("Hi \ud800!"), chunk("", finish="stop"))}
    )
    result = run("ask", "--server", server.url, "hi")
    assert result.exit_code == 0, (result.output, result.exception)
    assert result.stdout.startswith("Hi \ufffd!")
    [conversation] = Store().list_conversations()
    assert Store().messages(conversation.id)[-1].content == "Hi \ufffd!"


def test_a_model_list_that_inflates_past_the_cap_is_one_line(hostile):
    # 17 MiB of spaces inside a JSON string compress to ~17 KB: a small reply, a huge body.
    body = gzip.compress(b'{"data": [{"id": "' + b" " * (MAX_BODY + 2**20) + b'"}]}')
    server = hostile({("GET", "/v1/models"): Reply(200, [body], headers={"Content-Encoding": "gzip"})})
    result = run("ask", "--server", server.url, "hi")
    assert result.exit_code == 2, (result.output, result.exception)
    assert "more than 16 MiB" in result.stderr and result.stderr.count("\n") == 1


def test_a_small_gzip_reply_is_read(hostile):
    body = gzip.compress(json.dumps({"data": [{"id": "zipped"}]}).encode())
    server = hostile({("GET", "/v1/models"): Reply(200, [body], headers={"Content-Encoding": "gzip"})})
    session = connect(RemoteTarget(server.url), SamplingSettings(temperature=0))
    assert session.server.info.model == "zipped"


def test_a_stream_line_without_its_end_is_cut_at_the_cap(hostile):
    endless = [b"data: {" + b" " * 2**20 for _ in range(MAX_BODY // 2**20 + 2)]
    reply = Reply(200, sse(chunk("Hel")) + endless, content_type="text/event-stream", length=False)
    server = hostile({("POST", "/v1/chat/completions"): reply})
    session = connect(RemoteTarget(server.url), SamplingSettings(temperature=0))
    finished = list(session.send("hi"))[-1]
    assert finished.stats.stop == "error" and "ran past 16 MiB" in finished.error
    assert finished.text == "Hel" and session.messages[-1].content == "Hel"


def test_an_unreported_prefill_is_no_rate_of_zero(hostile):
    result = run("ask", "--no-save", "--server", hostile().url, "hi")  # the server reports no usage
    assert result.exit_code == 0
    assert "prefill – |" in result.stderr and "prefill 0 tok/s" not in result.stderr, result.stderr
