"""How a command ends when it cannot go on: one line on stderr and the exit status README.md
documents. 2: what the user gave cannot be used (a flag, a path, a server, a key); 1: the work
failed (a cut answer, a conversation that cannot be read)."""

from __future__ import annotations

import json
import sys
from typing import NoReturn

import typer

from tui.fmt import visible_controls

USAGE = 2
FAILED = 1


def fail(message: str, code: int = USAGE) -> NoReturn:
    """Say why on stderr and exit; the message may quote a path or a server: shown, never obeyed."""
    typer.echo(f"llmchat: {visible_controls(message)}", err=True)
    raise typer.Exit(code)


def refuse(message: str, as_json: bool) -> NoReturn:
    """`fail`, after an `error` event when the output is JSON Lines (so a reader sees why it ended)."""
    if as_json:
        from engine.events import Failed, to_json

        sys.stdout.write(json.dumps(to_json(Failed(message))) + "\n")
        sys.stdout.flush()
    fail(message)
