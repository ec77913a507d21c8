"""`llmchat web`: the app in a browser, served by textual-serve.

Each browser tab runs its own `llmchat` process (textual-serve starts one per session), so each
student has a model, a KV cache and instruments of their own. Each gets a fresh data and config
directory too: no tab reads the host's saved conversations or rewrites its config.json, and no
tab sees another's chats. The weights, the converted GGUF and the compiled steps come from the
shared cache directory, so a tab starts as fast as the app does.
"""

from __future__ import annotations

import shlex
import sys

import typer
from typer.exceptions import TyperException

from tui.cli.checks import check_engine_flags
from tui.cli.exits import fail

ENGINE_FLAGS = (
    *("server", "precision", "device", "context", "speculative", "draft_tokens"),
    *("kv_cache", "raw", "chat_template", "thinking"),
)
"""What `check_engine_flags` reads; `lecture` has only some of them."""
LOOPBACK = ("127.0.0.1", "localhost", "::1")
FRESH_DIRS = 'd="$(mktemp -d -t llmchat-web-XXXXXX)" && LLMCHAT_DATA_DIR="$d" LLMCHAT_CONFIG_DIR="$d" exec'
"""The shell prefix of each tab's command: a data and config directory of its own."""


def served_command(app_args: list[str]) -> str:
    """The shell command textual-serve runs for each tab."""
    return " ".join([FRESH_DIRS, *(shlex.quote(a) for a in (sys.executable, "-m", "tui.cli", *app_args))])


def check_app_args(command, app_args: list[str]) -> None:
    """The app's flags parsed now, as the tabs' command will parse them: a wrong one fails here
    in one line rather than in every browser tab."""
    if "--help" in app_args:  # the tabs would print it and end
        fail("the app's flags are listed by `llmchat --help`")
    try:
        parsed = command.make_context("llmchat", list(app_args)).params
    except TyperException as e:  # Typer's own click: a wrong flag, a bad value
        fail(f"the app's flags: {e.format_message()}")
    check_engine_flags({**dict.fromkeys(ENGINE_FLAGS), **parsed})


def serve(host: str, port: int, lecture: bool, app_args: list[str], app: typer.Typer) -> None:
    """Serve the app (`lecture`: its projector preset) with `app_args` on host:port until Ctrl+C;
    a host beyond this machine is warned about."""
    group = typer.main.get_command(app)
    check_app_args(group.commands["lecture"] if lecture else group, app_args)
    if lecture:
        app_args = ["lecture", *app_args]
    if not 1 <= port <= 65535:
        fail(f"--port must be 1-65535, got {port}")
    if host not in LOOPBACK:
        print(
            f"llmchat web: ⚠ serving on {host}:{port}: anyone who can reach it starts llmchat on this "
            "machine (a model each: ~1 GB of memory and its share of the cores per tab)",
            file=sys.stderr,
        )
    from textual_serve.server import Server

    server = Server(served_command(app_args), host=host, port=port, title="llmchat")
    try:
        server.serve()
    except OSError as e:
        fail(f"cannot serve on {host}:{port}: {e.strerror or e}")
