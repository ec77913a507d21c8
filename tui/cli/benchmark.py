"""`llmchat bench`: the engine's measurements here (engine/bench.py), or a server's
(engine/remote/bench.py); tables on stdout, or one JSON object."""

from __future__ import annotations

import json
from dataclasses import dataclass

import typer

from engine import DEFAULT_MODEL
from tui.cli import remote
from tui.cli.checks import (
    check_chat_template,
    check_draft_tokens,
    check_kv_cache,
    check_speculative,
    flag_named,
)
from tui.cli.exits import fail
from tui.cli.serving import ServingFlags, bench_serving
from tui.fmt import visible_controls


@dataclass(frozen=True)
class BenchFlags:
    """`bench`'s command line, as typer parsed it."""

    model: str | None
    precision: list[str]
    device: str | None
    prompt_lengths: str | None
    decode_tokens: int
    repeats: int
    turns: int
    long_context: int
    random_weights: bool
    raw: bool
    chat_template: str | None
    no_compile: bool
    speculative: str | None
    draft_tokens: int | None
    kv_cache: list[str] | None
    kv_cache_context: int
    as_json: bool
    server: str | None
    api_key_env: str | None
    read_timeout: float | None
    concurrency: str
    serving: dict
    """The serving flags given (options.SERVING): any of them asks for the serving benchmark."""


def measure(flags: BenchFlags) -> None:
    check_speculative(flags.speculative)
    if flags.serving and flags.server is None:
        flag = next(iter(flags.serving)).replace("_", "-")
        fail(f"--{flag}: a serving benchmark measures a server: give --server URL")
    if flags.server is not None:
        bench_server(flags)
    else:
        bench_here(flags)


def bench_server(flags: BenchFlags) -> None:
    if flags.raw or flags.chat_template is not None:
        fail(f"{'--raw' if flags.raw else '--chat-template'}: a server applies its own chat template")
    if flags.kv_cache:
        fail("--kv-cache: a server keeps its own KV cache")
    where = remote.target(flags.server, flags.model, flags.api_key_env, flags.read_timeout, fail)
    if flags.serving:
        result = bench_serving(ServingFlags(**flags.serving), where)
        emit_result(result, flags.as_json, "tui.cli.serving_table", "print_serving")
        return
    lengths = numbers(flags.prompt_lengths or "64,256,1024", "--prompt-lengths")
    streams = numbers(flags.concurrency, "--concurrency")
    try:
        config = remote.bench_config(where, lengths, flags.decode_tokens, flags.repeats, flags.turns, streams)
    except ValueError as e:
        fail(flag_named(e))
    emit_result(remote.bench(config), flags.as_json, "tui.cli.remote_bench_table", "print_remote_tables")


def bench_here(flags: BenchFlags) -> None:
    from engine import bench as bench_engine
    from engine.models import ModelError
    from engine.quant.precision import PrecisionError

    config = local_config(flags)
    try:
        result = bench_engine.run(config, report=lambda line: typer.echo(visible_controls(line), err=True))
    except (ModelError, PrecisionError) as e:
        fail(str(e))
    emit_result(result, flags.as_json, "tui.cli.bench_table", "print_tables")


def local_config(flags: BenchFlags):
    """engine/bench.py's settings from the flags; exits naming the flag of a bad one."""
    from engine.bench import BenchConfig
    from engine.chat_templates import template_text

    draft_tokens = 4 if flags.draft_tokens is None else flags.draft_tokens
    check_draft_tokens(draft_tokens)
    if flags.raw and flags.chat_template is not None:
        fail("--raw sends the text without a template; --chat-template gives one: choose one")
    if flags.chat_template is not None:
        check_chat_template(flags.chat_template)
    try:
        return BenchConfig(
            model=flags.model or DEFAULT_MODEL,
            precisions=tuple(flags.precision),
            device=flags.device or "auto",
            prompt_lengths=numbers(flags.prompt_lengths or "16,128,512", "--prompt-lengths"),
            decode_tokens=flags.decode_tokens,
            repeats=flags.repeats,
            turns=flags.turns,
            long_context=flags.long_context,
            random_weights=flags.random_weights,
            raw=flags.raw,
            chat_template=None if flags.chat_template is None else template_text(flags.chat_template),
            compile=not flags.no_compile,
            speculative=flags.speculative,
            draft_tokens=draft_tokens,
            kv_caches=kv_cache_list(flags.kv_cache or []),
            kv_cache_context=flags.kv_cache_context,
        )
    except ValueError as e:
        fail(flag_named(e))


def kv_cache_list(values: list[str]) -> tuple[str, ...]:
    """`--kv-cache int8 --kv-cache fp32`, `--kv-cache fp32,int8` or `all`: the cache precisions, in
    the order fp32 first (the reference the others are compared with)."""
    from tui.config import KV_CACHE_CHOICES

    names = [n.strip() for v in values for n in v.split(",") if n.strip()]
    if "all" in names:
        return KV_CACHE_CHOICES
    for name in names:
        check_kv_cache(name)
    return tuple(p for p in KV_CACHE_CHOICES if p in names)


def numbers(text: str, flag: str) -> tuple[int, ...]:
    """'1,2,4' -> (1, 2, 4); exits with the reason if a part is not a whole number (the bench
    config checks the values)."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        fail(f"{flag} must be comma-separated whole numbers, got {text!r}")


def emit_result(result: dict, as_json: bool, module: str, printer: str) -> None:
    """One JSON object, or the tables (Rich is imported only for those)."""
    if as_json:
        typer.echo(json.dumps(result, indent=2))
        return
    import importlib

    getattr(importlib.import_module(module), printer)(result)
