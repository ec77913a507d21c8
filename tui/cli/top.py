"""`llmchat top`: the flags checked, the server reached, then one reading printed (`--once`) or
the live view (tui/top/app.py). Textual is imported only for the live view."""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Optional

import typer

from tui.cli import exits
from tui.cli.remote import target
from tui.fmt import visible_controls

if TYPE_CHECKING:
    from engine.remote.server_stats import Watch

INTERVALS = (0.1, 60.0)
"""The shortest and longest pause between polls, in seconds."""


@dataclass(frozen=True)
class TopFlags:
    server: Optional[str]
    api_key_env: Optional[str]
    interval: str
    """As typed: checked here, so that any bad value is one line."""
    once: bool
    as_json: bool


def watch(flags: TopFlags) -> None:
    """Check the flags, reach the server (exit 2 with one line if it cannot), then show it."""
    interval = check(flags)
    where = target(flags.server or "", None, flags.api_key_env, None, exits.fail)
    timeout = max(5.0, 2 * interval)  # a poll that hangs is reported before long
    where = replace(where, read_timeout_s=timeout, connect_timeout_s=timeout)
    from engine.remote.client import RemoteError
    from engine.remote.server_stats import watch as open_watch

    try:
        server = open_watch(where)
    except RemoteError as e:
        exits.fail(visible_controls(str(e), one_line=True))
    if flags.once:
        once(server, interval, flags.as_json)
    else:
        live(server, interval)


def check(flags: TopFlags) -> float:
    """The interval in seconds; a flag no run can use is one line and exit 2, before anything
    connects."""
    if not flags.server:
        exits.fail("top needs --server URL, the server to watch (e.g. http://host:8000/v1)")
    low, high = INTERVALS
    try:
        interval = float(flags.interval)
    except ValueError:
        interval = math.nan
    if not (low <= interval <= high):  # NaN too
        exits.fail(f"--interval must be a number of seconds from {low:g} to {high:g}, got {flags.interval!r}")
    if flags.as_json and not flags.once:
        exits.fail("--json prints one reading: add --once")
    return interval


def once(server: Watch, interval_s: float, as_json: bool) -> None:
    """Two polls `interval_s` apart, printed: the second with the rates between them (exit 1 if
    the server stopped answering)."""
    from tui.top.figures import as_json as reading_json
    from tui.top.figures import lines

    try:
        server.poll()
        time.sleep(interval_s)
        reading = server.poll()
    finally:
        server.close()
    info = server.server.info
    if as_json:
        typer.echo(json.dumps(reading_json(reading, info)))
    else:
        typer.echo("\n".join(lines(reading, info)))
    if reading.snapshot.error:
        raise typer.Exit(exits.FAILED)


def live(server: Watch, interval_s: float) -> None:
    """The live view, until Esc or q."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        server.close()
        exits.fail("top's live view needs a terminal; for one reading without one use `llmchat top --once`")
    from tui.top.app import TopApp

    TopApp(server, interval_s).run()
