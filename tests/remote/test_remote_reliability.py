"""main's reliability rules on the remote path: a prompt the session refuses saves nothing, bad
flags and unreachable servers are one line (an `error` event with --json), a stop cuts a silent
stream, and what a server says reaches the terminal with its control characters shown."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from engine.events import Failed, ServerInfo
from engine.saved.chat import SavedChat
from engine.saved.store import Store
from tests.remote.test_llama_server import session_for
from tests.tui_fakes import INFO
from tui.cli.stops import Stops
from tui.widgets.status_bar import describe

UNREACHABLE = "http://127.0.0.1:9/v1"


@pytest.fixture
def cli(tmp_path, monkeypatch):
    from tui.cli import app

    monkeypatch.setenv("LLMCHAT_DATA_DIR", str(tmp_path / "data"))
    runner = CliRunner()
    return lambda *args: runner.invoke(app, list(args))


@pytest.mark.parametrize(
    "text, reason",
    [
        ("caf\udce9", "the message is not valid UTF-8 (byte 0xE9 at character 3)"),
        ("Summarize: " + " ".join(f"item {i} is blue;" for i in range(300)), "shorten it"),
    ],
)
def test_a_refused_prompt_leaves_nothing_in_the_store(llama_server, tmp_path, text, reason):
    store = Store(tmp_path)
    chat = SavedChat(session_for(llama_server), store)
    events = list(chat.send(text))
    assert [type(e) for e in events] == [Failed] and reason in events[0].message
    assert chat.conversation_id is None and store.list_conversations() == []
    assert chat.session.messages == []


@pytest.mark.parametrize(
    "flags, said",
    [
        (("--repeats", "0"), "--repeats must be at least 1, got 0"),
        (("--concurrency", "1,x"), "--concurrency must be comma-separated whole numbers, got '1,x'"),
        (("--concurrency", "2,0"), "--concurrency must be at least 1, got 0"),
        (("--prompt-lengths", ","), "--prompt-lengths needs at least one value"),
        (("--decode-tokens", "1"), "--decode-tokens must be at least 2, got 1"),
    ],
)
def test_bench_server_flags_are_checked_before_connecting(cli, flags, said):
    result = cli("bench", "--server", UNREACHABLE, *flags)
    assert result.exit_code == 2 and result.stderr.strip() == f"llmchat: {said}"


def test_ask_json_ends_with_an_error_event_when_the_server_cannot_be_reached(cli):
    result = cli("ask", "--server", UNREACHABLE, "--json", "hi")
    assert result.exit_code == 2
    last = json.loads(result.stdout.splitlines()[-1])
    assert last["event"] == "error" and last["message"].startswith(f"cannot reach {UNREACHABLE}")


def test_ask_server_refuses_bad_text_and_context_before_connecting(cli):
    assert "not valid UTF-8" in cli("ask", "--server", UNREACHABLE, "caf\udce9").stderr
    zero = cli("ask", "--server", UNREACHABLE, "--context", "0", "hi")
    assert zero.exit_code == 2 and "--context must be a positive" in zero.stderr


def test_the_first_stop_calls_on_stop_once():
    calls = []
    stops = Stops(on_stop=lambda: calls.append(1))
    stops.stop(143, "stopped by SIGTERM")
    stops.stop(129, "stopped: the terminal closed (SIGHUP)")
    assert calls == [1] and stops.code == 143


def test_the_header_fits_80_columns_and_shows_a_servers_control_characters():
    server = ServerInfo(
        url="http://gpu-node-17.cluster.example.org:8000/v1",
        kind="vllm",
        version="0.9.1\x1b]0;owned\x07",
        model="meta-llama/Llama-3.1-70B-Instruct",
        parallelism="tensor parallel 8",
        quantization="fp8",
    )
    info = replace(INFO, name="Llama-3.1-70B-Instruct", server=server)
    wide = describe(info)
    assert "\x1b" not in wide and "\x07" not in wide and "␛" in wide and "tensor parallel 8" in wide
    short = describe(info, 80 - len(" llmchat ") - 1)
    assert len(short) <= 70 and "Llama-3.1-70B-Instruct" in short
