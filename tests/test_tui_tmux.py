"""The real app with the real model in a real terminal (tmux): ask a question, read the screen."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.tmux,
    pytest.mark.real_model,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
]
ROOT = Path(__file__).resolve().parent.parent
SOCKET = f"llmchat-test-{os.getpid()}"
"""A private tmux server: its own options and sessions, whatever else runs tmux on this machine."""


def tmux(*args: str, check: bool = True) -> str:
    return subprocess.run(
        ["tmux", "-L", SOCKET, "-f", "/dev/null", *args], capture_output=True, text=True, check=check
    ).stdout


def screen(session: str) -> str:
    return tmux("capture-pane", "-p", "-t", session)


def wait_for_screen(session: str, *texts: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        shown = screen(session)
        if all(text in shown for text in texts):
            return shown
        if time.monotonic() > deadline:
            raise AssertionError(f"never saw {texts} on the screen:\n{shown}")
        time.sleep(0.5)


def test_the_real_app_answers_in_tmux(tmp_path):
    session = f"llmchat-test-{os.getpid()}"
    # The private dirs are passed explicitly, and COLUMNS/LINES (set under pytest) dropped: the app
    # would take them over the real terminal size.
    private = f"LLMCHAT_CONFIG_DIR={tmp_path / 'config'} LLMCHAT_DATA_DIR={tmp_path / 'data'}"
    command = (
        f"env -u COLUMNS -u LINES {private} {sys.executable} -m tui.cli --temperature 0 --max-new-tokens 40"
    )
    tmux("new-session", "-d", "-s", session, "-x", "160", "-y", "45", "-c", str(ROOT), command)
    try:
        # The window is up before the model is (torch is imported in the background).
        wait_for_screen(session, "llmchat", "Phase", "Ask something", timeout=20)
        # A first run converts the GGUF (~35 s); later ones load it in seconds.
        wait_for_screen(session, "SmolLM2", "params", timeout=180)
        tmux("send-keys", "-t", session, "What is the capital of France?", "Enter")
        # Tests run with the compile off (LLMCHAT_COMPILE=0): the speed says it came from the eager step.
        shown = wait_for_screen(session, "Paris", "tok/s (eager step) ·", "last turn", timeout=120)
        for panel_text in (
            "Phase",
            "TTFT",
            "KV cache",
            "46,080 B/token",
            "newly prefilled",
            "Top-k",
            "entropy",
            "Tokens",
            "prompt",
            "answer",
        ):
            assert panel_text in shown, panel_text
    finally:
        tmux("send-keys", "-t", session, "C-q", check=False)
        time.sleep(0.5)
        tmux("kill-server", check=False)
