"""The command line's side of a model on a server: the flags, connecting, and the lines that
describe the server and its own timings. (The app reaches the same through the worker.)"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Callable, NoReturn, Optional

import typer

from tui.cli import exits
from tui.fmt import visible_controls

if TYPE_CHECKING:
    from engine.events import ModelInfo, ServerTimings
    from engine.remote.bench import RemoteBenchConfig
    from engine.remote.session import RemoteSession
    from engine.remote.target import RemoteTarget
    from engine.sampling import SamplingSettings


def target(
    url: str,
    model: Optional[str],
    api_key_env: Optional[str],
    read_timeout: float | None,
    fail: Callable[[str], NoReturn],
) -> RemoteTarget:
    """Where to connect (`read_timeout` None: the default), or `fail` (it exits) naming the flag no
    client can use: checked before anything connects, and never repeating a URL's query (it may
    hold a key)."""
    from engine.remote.target import RemoteTarget, target_problem

    where = RemoteTarget(url, model, api_key_env)
    if read_timeout is not None:
        where = replace(where, read_timeout_s=read_timeout)
    problem = target_problem(where)
    if problem:
        fail(problem)
    return where


def connect_or_fail(
    where: RemoteTarget,
    sampling: SamplingSettings,
    system: str | None,
    context: int | None,
    fail: Callable[[str], NoReturn],
) -> RemoteSession:
    """A session on the server, or `fail` with the one-line reason (it exits)."""
    from engine.remote.client import RemoteError
    from engine.remote.session import connect

    try:
        return connect(where, sampling, system, context)
    except RemoteError as e:  # it may quote the server (its model names): shown, never obeyed
        fail(visible_controls(str(e), one_line=True))


def server_line(info: ModelInfo) -> str:
    """Which server, its version and parallelism, and the model: the header of a remote chat (the
    server's own words with their control characters shown)."""
    server = info.server
    parts = [
        f"{server.kind} {server.version or '(version not reported)'} at {server.url}",
        f"model {info.name}",
    ]
    if server.parallelism:
        parts.append(server.parallelism)
    if server.quantization:
        parts.append(server.quantization)
    if info.context:
        parts.append(f"context {info.context:,}")
    return visible_controls(" · ".join(parts), one_line=True)


def server_figures(timings: ServerTimings | None) -> str:
    """The server's own figures for a turn, for the stats line; '' when it reported none."""
    if timings is None:
        return ""
    parts = []
    if timings.prompt_ms is not None:
        parts.append(f"prefill {timings.prompt_ms:.0f} ms for {timings.prompt_tokens} tokens")
    if timings.cached_tokens is not None:
        parts.append(f"{timings.cached_tokens} cached")
    if timings.predicted_per_token_ms is not None:
        parts.append(f"{timings.predicted_per_token_ms:.1f} ms/token")
    return f" | server: {', '.join(parts)}" if parts else ""


def bench_config(
    where: RemoteTarget,
    prompt_lengths: tuple[int, ...],
    decode_tokens: int,
    repeats: int,
    turns: int,
    concurrency: tuple[int, ...],
) -> RemoteBenchConfig:
    """`bench --server`'s settings; ValueError, starting with the field's name, for a bad one."""
    from engine.remote.bench import RemoteBenchConfig

    return RemoteBenchConfig(where, prompt_lengths, decode_tokens, repeats, turns, concurrency)


def bench(config: RemoteBenchConfig) -> dict:
    """`bench --server`: the measurements as data; a server that fails one exits 2 with why."""
    from engine.remote.bench import BenchError, run
    from engine.remote.client import RemoteError

    try:
        return run(config, report=lambda line: typer.echo(line, err=True))
    except (RemoteError, BenchError) as e:
        exits.fail(visible_controls(str(e), one_line=True))
