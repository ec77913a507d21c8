"""Issue 17, data lost: an answer stopped from outside keeps what was generated.

`llmchat ask` treats SIGTERM, a closed terminal (SIGHUP) and a closed stdout (a reader such as
`head` gone) like Ctrl+C: the answer stops, its part so far is saved, and the exit code says
why (128 + the signal: 143 TERM, 129 HUP; 141 for a closed pipe, as if SIGPIPE had ended
it). The app saves on SIGTERM and on a closed terminal as it does on Ctrl+Q.

Real processes throughout, with a tiny model that never stops by itself (its end-of-turn
token can never be the most probable one), so each signal lands mid-answer.
"""

from __future__ import annotations

import json
import os
import pty
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.saved.store import Store
from tests.reliability.endless import ROOT, Drain, build_endless_model, private_env, read_until_token
from tests.reliability.endless import ask_command as ask_with

PROMPT = "How does inference work?"


@pytest.fixture(scope="module")
def endless_model_dir(tmp_path_factory) -> Path:
    return build_endless_model(tmp_path_factory.mktemp("endless-llama"))


def ask_command(model_dir: Path, *flags: str) -> list[str]:
    return ask_with(model_dir, PROMPT, *flags)


def saved_turn(tmp_path: Path) -> list:
    """The current branch of the one conversation saved under tmp_path."""
    with Store(tmp_path / "data") as store:
        [summary] = store.list_conversations()
        return store.path(summary.id)


def assert_partial_answer_saved(tmp_path: Path, streamed: list[str] | None = None) -> None:
    question, answer = saved_turn(tmp_path)
    assert (question.role, question.content) == ("user", PROMPT)
    assert answer.role == "assistant" and answer.record.stop == "cancelled"
    assert answer.record.tokens >= 1 and answer.content
    if streamed is not None:  # the saved text is the text the turn ended with
        [turn] = [json.loads(line) for line in streamed if '"event": "turn"' in line]
        assert turn["text"] == answer.content


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_ask_stopped_by_a_signal_saves_the_partial_answer(endless_model_dir, tmp_path, signum):
    process = subprocess.Popen(
        ask_command(endless_model_dir, "--json"),
        cwd=ROOT,
        env=private_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        streamed = read_until_token(process.stdout)
        rest, errors = Drain(process.stdout), Drain(process.stderr)
        process.send_signal(signum)
        code = process.wait(timeout=120)
    finally:
        process.kill()
    errors = "".join(errors.join())
    assert code == 128 + signum, errors
    assert "Traceback" not in errors
    assert_partial_answer_saved(tmp_path, streamed + rest.join())


def test_ask_in_a_terminal_that_closes_saves_the_partial_answer(endless_model_dir, tmp_path):
    """The terminal itself goes (its window closed): SIGHUP, then every write to it fails."""
    command, env = ask_command(endless_model_dir, "--json"), private_env(tmp_path)
    pid, terminal = pty.fork()  # the child's controlling terminal, stdin, stdout and stderr
    if pid == 0:
        os.chdir(ROOT)
        os.execve(sys.executable, command, env)
    try:
        with os.fdopen(terminal, "r", errors="replace", closefd=False) as screen:
            read_until_token(screen)
    finally:
        os.close(terminal)  # hang up
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 128 + signal.SIGHUP
    assert_partial_answer_saved(tmp_path)


def test_ask_into_a_pipe_closed_by_its_reader_saves_the_partial_answer(endless_model_dir, tmp_path):
    """`llmchat ask ... | head -c 20`: the reader takes 20 bytes and goes."""
    process = subprocess.Popen(
        ask_command(endless_model_dir),
        cwd=ROOT,
        env=private_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert len(process.stdout.read(20)) == 20
        process.stdout.close()
        errors = process.stderr.read().decode()
        code = process.wait(timeout=120)
    finally:
        process.kill()
    assert code == 141, errors
    assert "Traceback" not in errors and "Exception ignored" not in errors
    assert "saved as conversation" in errors
    assert_partial_answer_saved(tmp_path)


# -- the app --------------------------------------------------------------------------------
TMUX = f"llmchat-signals-{os.getpid()}"


def tmux(*args: str, check: bool = True) -> str:
    return subprocess.run(
        ["tmux", "-L", TMUX, "-f", "/dev/null", *args], capture_output=True, text=True, check=check
    ).stdout.strip()


def wait_until(condition, what: str, timeout: float = 120.0) -> None:
    """A guard against hanging, not a timing assertion: the condition only has to come true."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"never saw {what}:\n{tmux('capture-pane', '-p', check=False)}")
        time.sleep(0.2)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def child_of(parent: int) -> int:
    """The one process whose parent is `parent` (from /proc)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == parent:
                return int(stat.parent.name)
        except (OSError, ValueError, IndexError):
            continue
    raise AssertionError(f"process {parent} has no child")


@pytest.mark.tmux
@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
@pytest.mark.parametrize("how", ["SIGTERM", "terminal closed"])
def test_the_app_stopped_mid_answer_saves_the_partial_answer(endless_model_dir, tmp_path, how):
    env = private_env(tmp_path)
    private = " ".join(
        f"{name}={env[name]}" for name in ("LLMCHAT_DATA_DIR", "LLMCHAT_CONFIG_DIR", "XDG_CONFIG_HOME")
    )
    app = f"{sys.executable} -m tui.cli --model {endless_model_dir} --device cpu --temperature 0"
    # The shell records the app's exit code itself: tmux's own record of it proved unreliable
    # when the pane's terminal closes before the process ends.
    status_file = tmp_path / "exit-status"
    command = (
        f"env -u COLUMNS -u LINES {private} LLMCHAT_COMPILE=0 {app} --max-new-tokens 1000000; "
        f"echo $? > {status_file}"
    )
    tmux("new-session", "-d", "-s", "app", "-x", "160", "-y", "45", "-c", str(ROOT), command)
    shell = int(tmux("display-message", "-p", "-t", "app", "#{pane_pid}"))
    pid = None
    try:
        tmux("set-option", "-t", "app", "remain-on-exit", "on")
        wait_until(lambda: "Ask something" in tmux("capture-pane", "-p", "-t", "app"), "the app")
        pid = int(
            subprocess.run(["pgrep", "-P", str(shell)], capture_output=True, text=True).stdout.split()[0]
        )
        tmux("send-keys", "-t", "app", PROMPT, "Enter")
        wait_until(lambda: "DECODE" in tmux("capture-pane", "-p", "-t", "app"), "the answer streaming")
        if how == "SIGTERM":
            os.kill(pid, signal.SIGTERM)
            wait_until(status_file.exists, "the exit status")
            wait_until(lambda: status_file.read_text().strip() != "", "the exit status")
            assert status_file.read_text().strip() == "143"
        else:
            tmux("kill-session", "-t", "app")
            wait_until(lambda: not alive(pid), "the app end")
    finally:
        tmux("kill-server", check=False)
        for leftover in (pid, shell):
            if leftover is not None and alive(leftover):  # a failed test leaves no app behind
                os.kill(leftover, signal.SIGKILL)
    assert_partial_answer_saved(tmp_path)
