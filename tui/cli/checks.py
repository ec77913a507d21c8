"""The flags' checks, run before a model loads or anything connects: a wrong flag costs the user a
second, not a minute of loading, and nothing is saved for a run that cannot happen."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from tui.cli.exits import fail

if TYPE_CHECKING:
    from engine.serving_metrics import Slo


def check_engine_flags(flags: Mapping[str, Any]) -> None:
    """The flags that choose the engine and its settings, as the app and `ask` share them (by name:
    server, precision, device, context, speculative, draft_tokens, kv_cache, raw, chat_template,
    thinking)."""
    server = flags["server"]
    if server is not None and (flags["precision"] is not None or flags["device"] is not None):
        fail("--precision and --device: the server decides where and at what precision its model runs")
    check_context(flags["context"])
    check_speculative(flags["speculative"])
    if flags["draft_tokens"] is not None:
        check_draft_tokens(flags["draft_tokens"])
    check_kv_cache(flags["kv_cache"])
    if server is not None and flags["kv_cache"] is not None:
        fail("--kv-cache: a server keeps its own KV cache")
    if server is not None and (flags["raw"] or flags["chat_template"] is not None):
        fail(f"{'--raw' if flags['raw'] else '--chat-template'}: a server applies its own chat template")
    if flags["raw"] and flags["chat_template"] is not None:
        fail("--raw sends the text without a template; --chat-template gives one: choose one")
    if flags["chat_template"] is not None:
        check_chat_template(flags["chat_template"])
    if flags["thinking"] is not None:
        check_thinking(flags["thinking"], flags)


def check_thinking(choice: str, flags: Mapping[str, Any]) -> None:
    """--thinking is on or off, for a template known here: the model's own (checked once it has
    loaded), or --chat-template's, which must read the switch."""
    if choice not in ("on", "off"):
        fail(f"--thinking must be on or off, got {choice!r}")
    if flags["raw"]:
        fail("--thinking: --raw sends the text without a template, so there is no thinking to switch")
    if flags["server"] is not None:
        fail("--thinking: a server applies its own chat template")
    if flags["chat_template"] is not None:
        from engine.chat_templates import template_text
        from engine.thinking import switch_problem

        problem = switch_problem(template_text(flags["chat_template"]))
        if problem:
            fail(f"--thinking: --chat-template {flags['chat_template']}: {problem}")


def check_chat_template(choice: str) -> None:
    from engine.chat_templates import template_text

    try:
        template_text(choice)
    except ValueError as e:
        fail(str(e))


def check_kv_cache(precision: str | None) -> None:
    """--kv-cache names one of the cache precisions."""
    from tui.config import KV_CACHE_CHOICES

    if precision is not None and precision not in KV_CACHE_CHOICES:
        fail(f"--kv-cache must be one of {', '.join(KV_CACHE_CHOICES)}, got {precision!r}")


def check_draft_tokens(k: int) -> None:
    if not 1 <= k <= 8:
        fail(f"--draft-tokens must be a whole number from 1 to 8, got {k}")


def check_speculative(choice: str | None) -> None:
    """--speculative names a drafter (an empty name is no model)."""
    if choice is not None and not choice.strip():
        fail("--speculative needs 'lookup' or a draft MODEL[@PRECISION], got an empty name")


def check_remote_flags(server: str | None, read_timeout: float | None) -> None:
    """The app's --server and --read-timeout (the config file's server is checked when it is read)."""
    from engine.remote.target import read_timeout_problem, url_problem

    problem = url_problem(server) if server is not None else None
    if problem:
        fail(f"--server: {problem}")
    problem = read_timeout_problem(read_timeout) if read_timeout is not None else None
    if problem:
        fail(problem)


def check_context(context: int | None) -> None:
    if context is not None and context < 1:
        fail(f"--context must be a positive number of tokens, got {context}")


def text_problem(system: str | None, prompts: list[str] = ()) -> str | None:
    """Why the system prompt or a prompt cannot be sent (not UTF-8: bytes from argv), or None."""
    from engine.utf8 import utf8_problem

    named = [(system, "--system")] if system is not None else []
    single = len(prompts) == 1
    named += [(p, "the prompt" if single else f"prompt {i}") for i, p in enumerate(prompts, 1)]
    return next((problem for text, what in named if (problem := utf8_problem(text, what))), None)


def sampling_from(**flags):
    """SamplingSettings from the sampling flags given (the others keep the defaults); exits with
    the allowed range on a bad one. Imports torch."""
    from engine.sampling import SamplingSettings

    try:
        return SamplingSettings(**flags)
    except ValueError as e:
        fail(str(e))


def resolve_resume(ref: str) -> int:
    """The conversation id `--resume` names ('last' fixed now); exits with the reason if there is none."""
    from engine.saved.store import Store, StoreError

    try:
        with Store() as store:
            return store.resolve(ref)
    except StoreError as e:
        fail(f"--resume: {e}")


def flag_named(error: ValueError) -> str:
    """A config's "repeats must be ...": the field, named as its flag."""
    field, _, rest = str(error).partition(" ")
    return f"--{field.replace('_', '-')} {rest}"


def check_serving_figures(
    percentiles: str | None, goodput: list[str] | None
) -> tuple[tuple[float, ...], Slo | None]:
    """--percentiles and --goodput (`bench --server`'s serving run, `lab batching`) parsed, or an
    exit naming the flag."""
    from engine.serving_metrics import DEFAULT_PERCENTILES, parse_goodput, parse_percentiles

    try:
        return (parse_percentiles(percentiles) if percentiles else DEFAULT_PERCENTILES), parse_goodput(
            goodput or []
        )
    except ValueError as e:  # "percentiles must be ...", "goodput ttft:0: ...": the flag's own name
        fail(f"--{e}")
