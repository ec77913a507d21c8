"""Hostile input on the command line (issue 17): each is one clear `llmchat: ...` line and a
nonzero exit, never a traceback, and nothing half-made is left in the store."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from engine.events import Failed, MessageSaved, TurnFinished
from engine.sampling import SamplingSettings
from engine.saved.chat import SavedChat
from engine.saved.store import Store
from engine.session import ChatSession

HUGE = "99999999999999999999999"  # beyond SQLite's 64-bit integers
NOT_UTF8 = "Say hi \udcff\udcfe ok"  # what Python makes of the bytes b"Say hi \xff\xfe ok" in argv
LONG = "inference " * 150


@pytest.fixture
def cli(tmp_path, monkeypatch, tiny_model_dir):
    """`llmchat ARGS` in this process; the app itself is never opened (run_app only records)."""
    import tui.app
    from tui.cli import app

    monkeypatch.setenv("LLMCHAT_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("LLMCHAT_CONFIG_DIR", str(tmp_path / "config"))
    opened: list[dict] = []
    monkeypatch.setattr(tui.app, "run_app", lambda **flags: opened.append(flags))
    runner = CliRunner()

    def run(*args: str):
        return runner.invoke(app, list(args))

    run.model = str(tiny_model_dir)
    run.data = tmp_path / "data"
    run.opened = opened
    return run


def saved_conversations(data) -> list:
    with Store(data) as store:
        return store.list_conversations()


def one_error(result, *words: str) -> str:
    """The run failed with exactly one `llmchat:` line on stderr that holds `words`, and no traceback."""
    assert result.exit_code not in (0, None), result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("llmchat: "), result.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def run_cli(*args, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    """`python -m tui.cli ARGS` as a real process (args may be bytes: argv as a shell passes it)."""
    return subprocess.run(
        [sys.executable, "-m", "tui.cli", *args], capture_output=True, timeout=timeout, **kwargs
    )


def stderr_lines(process: subprocess.CompletedProcess) -> list[str]:
    return [line for line in process.stderr.decode("utf-8", "replace").splitlines() if line.strip()]


# -- 1. text that is not UTF-8 ------------------------------------------------------------------
def test_a_prompt_of_invalid_utf8_from_argv_is_refused_and_nothing_is_saved(tiny_model_dir, tmp_path):
    data = tmp_path / "data"
    process = run_cli("ask", "-m", str(tiny_model_dir), "-n", "3", b"Say hi \xff\xfe ok", env=_env(data=data))
    assert process.returncode == 2, process.stderr
    lines = stderr_lines(process)
    assert lines == [
        "llmchat: the prompt is not valid UTF-8 (bytes 0xFF 0xFE at character 7); "
        "fix the text or the terminal's encoding"
    ]
    assert saved_conversations(data) == []


@pytest.mark.parametrize(
    "args, what",
    [
        (("--no-save", NOT_UTF8), "the prompt"),
        (("fine", NOT_UTF8), "prompt 2"),
        (("--system", NOT_UTF8, "hello"), "--system"),
    ],
)
def test_invalid_utf8_is_refused_with_every_option(cli, args, what):
    result = cli("ask", "-m", cli.model, "-n", "3", *args)
    assert result.exit_code == 2
    one_error(result, f"{what} is not valid UTF-8", "0xFF 0xFE")
    assert saved_conversations(cli.data) == []


def test_invalid_utf8_in_json_mode_ends_with_an_error_event(cli):
    result = cli("ask", "-m", cli.model, "-n", "3", "--json", NOT_UTF8)
    one_error(result, "the prompt is not valid UTF-8")
    events = [json.loads(line) for line in result.stdout.splitlines()]
    assert events[-1]["event"] == "error" and "not valid UTF-8" in events[-1]["message"]
    assert saved_conversations(cli.data) == []


def test_a_title_or_search_of_invalid_utf8_is_refused(cli):
    assert cli("ask", "-m", cli.model, "-n", "2", "hello").exit_code == 0
    one_error(cli("conversations", "rename", "1", NOT_UTF8), "the title is not valid UTF-8")
    one_error(cli("conversations", "list", "--search", NOT_UTF8), "--search is not valid UTF-8")
    assert [c.title for c in saved_conversations(cli.data)] == ["hello"]


def test_the_app_refuses_a_system_prompt_of_invalid_utf8_before_it_opens(cli):
    result = cli("--system", NOT_UTF8)
    assert result.exit_code == 2
    one_error(result, "--system is not valid UTF-8")
    assert cli.opened == []


def test_the_session_refuses_invalid_utf8_from_any_caller(tiny_loaded, tmp_path):
    with Store(tmp_path / "data") as store:
        chat = SavedChat(ChatSession(tiny_loaded, SamplingSettings(temperature=0, max_new_tokens=3)), store)
        events = list(chat.send(NOT_UTF8))
        assert [type(e) for e in events] == [Failed]
        assert "not valid UTF-8" in events[0].message
        assert chat.session.messages == [] and store.list_conversations() == []
        assert any(isinstance(e, TurnFinished) for e in chat.send("hello"))  # the chat goes on


# -- 2. ids beyond SQLite's integers --------------------------------------------------------------
@pytest.mark.parametrize(
    "args",
    [
        ("conversations", "show", HUGE),
        ("conversations", "rename", HUGE, "new title"),
        ("conversations", "delete", "--yes", HUGE),
        ("conversations", "export", HUGE),
    ],
)
def test_a_huge_conversation_id_is_just_not_there(cli, args):
    saved_conversations(cli.data)  # an existing, empty store
    one_error(cli(*args), f"no conversation {HUGE}")


def test_a_huge_id_to_resume_or_continue_is_just_not_there(cli):
    one_error(cli("--resume", HUGE), f"--resume: no conversation {HUGE}")
    assert cli.opened == []
    one_error(cli("ask", "-m", cli.model, "-c", HUGE, "hello"), f"no conversation {HUGE}")


# -- 3. bench arguments ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args, message",
    [
        (("--prompt-lengths", "abc"), "--prompt-lengths must be comma-separated whole numbers, got 'abc'"),
        (("--prompt-lengths", "16,0"), "--prompt-lengths must be at least 1, got 0"),
        (("--prompt-lengths", ","), "--prompt-lengths needs at least one length"),
        (("--repeats", "0"), "--repeats must be at least 1, got 0"),
        (("--decode-tokens", "0"), "--decode-tokens must be at least 2, got 0"),
        (("--turns", "0"), "--turns must be in [1, 4], got 0"),
        (("--long-context", "-5"), "--long-context must be at least 0, got -5"),
    ],
)
def test_bench_checks_its_arguments_before_measuring(cli, args, message):
    result = cli("bench", "-m", cli.model, "--no-compile", *args)
    assert result.exit_code == 2
    assert one_error(result) == f"llmchat: {message}"


def test_bench_config_checks_its_fields():
    from engine.bench import BenchConfig

    for bad in (dict(repeats=0), dict(decode_tokens=1), dict(prompt_lengths=()), dict(long_context=-1)):
        with pytest.raises(ValueError):
            BenchConfig(**bad)


# -- 5. the context limit -----------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["0", "-3"])
def test_the_context_limit_must_be_a_positive_number(cli, value):
    message = f"--context must be a positive number of tokens, got {value}"
    result = cli("ask", "-m", cli.model, "-n", "3", "--context", value, "hello")
    assert result.exit_code == 2
    one_error(result, message)
    result = cli("--context", value)
    assert result.exit_code == 2
    one_error(result, message)
    assert cli.opened == [] and saved_conversations(cli.data) == []


def test_the_session_refuses_a_context_limit_that_is_not_positive(tiny_loaded):
    for value in (0, -3):
        with pytest.raises(ValueError, match="context"):
            ChatSession(tiny_loaded, context=value)


# -- 6. a prompt that cannot fit ----------------------------------------------------------------------
def test_a_refused_first_prompt_leaves_no_conversation_and_no_title(tiny_loaded, tmp_path):
    with Store(tmp_path / "data") as store:
        session = ChatSession(tiny_loaded, SamplingSettings(temperature=0, max_new_tokens=3), context=110)
        chat = SavedChat(session, store)
        events = list(chat.send(LONG))
        assert isinstance(events[-1], Failed) and not any(isinstance(e, MessageSaved) for e in events)
        assert chat.conversation_id is None and store.list_conversations() == []
        list(chat.send("short"))
        (only,) = store.list_conversations()
        assert only.title == "short" and [m.content for m in store.path(only.id)][0] == "short"


def test_ask_with_a_prompt_too_long_saves_nothing(cli):
    result = cli("ask", "-m", cli.model, "-n", "3", "--context", "100", LONG)
    assert result.exit_code == 1
    line = one_error(result, "the message is", "the context window is 100")
    assert "saved as conversation" not in result.output, line
    assert saved_conversations(cli.data) == []


def test_a_system_prompt_too_long_is_called_the_system_prompt(cli):
    result = cli("ask", "-m", cli.model, "-n", "3", "--context", "100", "--system", LONG, "hi")
    assert result.exit_code == 1
    one_error(result, "the system prompt is", "tokens; the context window is 100")
    assert saved_conversations(cli.data) == []


# -- 7. a hub id with no network -------------------------------------------------------------------------
def test_a_hub_id_fails_at_once_when_the_hub_cannot_be_reached(tmp_path):
    # Port 9 on this machine refuses connections: the same as having no network, on any machine.
    env = _env(data=tmp_path / "data", HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf"))
    process = run_cli("ask", "-m", "someone/some-model", "hi", env=env)
    assert process.returncode == 2, process.stderr
    text = process.stderr.decode()
    assert "Retry" not in text  # no rounds of retries with back-off
    assert stderr_lines(process) == [
        "llmchat: cannot fetch someone/some-model: the Hugging Face hub (127.0.0.1:9) cannot be reached "
        "and the model is not in the local cache; use smollm2-135m (built in), a local model directory, "
        "or a .gguf file"
    ]


# -- 9. the app without a terminal ----------------------------------------------------------------------
def test_the_app_without_a_terminal_says_so_and_exits(tmp_path):
    process = run_cli(stdin=subprocess.DEVNULL, env=_env(data=tmp_path / "data"), timeout=120)
    assert process.returncode == 2
    assert process.stdout == b""
    assert stderr_lines(process) == [
        "llmchat: the chat app needs a terminal (stdin and stdout are not one); "
        "for answers without one use `llmchat ask PROMPT`"
    ]


def _env(data, **extra: str) -> dict:
    import os

    env = dict(os.environ, LLMCHAT_DATA_DIR=str(data), LLMCHAT_CONFIG_DIR=str(data.parent / "config"))
    env.update(extra)
    return env
