"""The `llmchat` command: the app by default, plus headless `ask`, `bench`, `lab` and
`conversations`. Each command here is its flags and one call; the work is in the module named.

Textual is imported only when the app starts, so headless commands stay light.
"""

from __future__ import annotations

import inspect
import os
from functools import partial
from typing import Any, Optional

import typer

from tui.cli import options
from tui.cli.checks import check_engine_flags, check_remote_flags, resolve_resume, sampling_from, text_problem
from tui.cli.conversations import conversations_app
from tui.cli.exits import fail
from tui.cli.lab import lab_app
from tui.cli.options import with_sampling, with_serving

SHOTS = typer.Option(
    None, "--shots", help="Folder for Screenshot (palette) SVGs; default: screenshots in the data dir."
)

app = typer.Typer(add_completion=False, no_args_is_help=False, help="See LLM inference happen, live.")
app.add_typer(conversations_app, name="conversations")
app.add_typer(lab_app, name="lab")


@app.callback(invoke_without_command=True)
@with_sampling
def main(
    ctx: typer.Context,
    model: Optional[str] = options.Model,
    precision: Optional[str] = options.Precision,
    device: Optional[str] = options.Device,
    sampling: Any = None,
    system: Optional[str] = options.System,
    context: Optional[int] = options.Context,
    theme: Optional[str] = typer.Option(
        None,
        "--theme",
        help="llmchat-dark (default), llmchat-light, llmchat-high-contrast or a Textual theme; remembered.",
    ),
    resume: Optional[str] = typer.Option(
        None,
        "--resume",
        help="Continue saved conversation ID ('last' for the most recent) once the model has loaded.",
    ),
    no_compile: bool = typer.Option(
        False, "--no-compile", help="Keep the eager decode step (no torch.compile in the background)."
    ),
    speculative: Optional[str] = options.Speculative,
    draft_tokens: Optional[int] = options.DraftTokens,
    kv_cache: Optional[str] = options.KVCache,
    raw: bool = options.Raw,
    chat_template: Optional[str] = options.ChatTemplate,
    thinking: Optional[str] = options.Thinking,
    server: Optional[str] = options.Server,
    api_key_env: Optional[str] = options.ApiKeyEnv,
    read_timeout: Optional[float] = options.ReadTimeout,
    shots: Optional[str] = SHOTS,
) -> None:
    """Open the chat app (the default when no command is given).

    Defaults come from config.json in the user config dir ($LLMCHAT_CONFIG_DIR overrides it);
    flags win over the file.
    """
    if ctx.invoked_subcommand is None:
        flags = {name: value for name, value in locals().items() if name != "ctx"}  # as parsed
        open_app(**flags)


THEME = typer.Option(None, "--theme", help="The theme for the projector (default llmchat-high-contrast).")
NOT_IN_A_LECTURE = dict.fromkeys(
    (
        *("speculative", "draft_tokens", "raw", "chat_template", "thinking"),
        *("server", "api_key_env", "read_timeout"),
    )
)
"""The app's flags a lecture leaves at their defaults (a demo script sets speculation itself)."""


@app.command()
@with_sampling
def lecture(
    model: Optional[str] = options.Model,
    precision: Optional[str] = options.Precision,
    device: Optional[str] = options.Device,
    sampling: Any = None,
    system: Optional[str] = options.System,
    context: Optional[int] = options.Context,
    theme: Optional[str] = THEME,
    kv_cache: Optional[str] = options.KVCache,
    shots: Optional[str] = SHOTS,
) -> None:
    """Open the app for a projector: temperature 0, a system prompt for short answers, the
    high-contrast theme, and the first question held until the compiled decode step is ready."""
    open_app(no_compile=False, resume=None, lecture=True, **NOT_IN_A_LECTURE, **locals())


@app.command()
@with_sampling
def demo(
    script: str = typer.Argument(..., help="A demo script (TOML), or the name of a shipped one: inference."),
    model: Optional[str] = options.Model,
    precision: Optional[str] = options.Precision,
    device: Optional[str] = options.Device,
    sampling: Any = None,
    system: Optional[str] = options.System,
    context: Optional[int] = options.Context,
    theme: Optional[str] = THEME,
    kv_cache: Optional[str] = options.KVCache,
    shots: Optional[str] = SHOTS,
) -> None:
    """Step through a scripted demo, as `lecture` opens the app: each step asks, sets or opens an
    instrument and says what to look at. → Space PgDn next, ← PgUp back, q ends the demo."""
    flags = dict(locals())
    from tui.demo_script import ScriptError, load

    try:
        flags["script"] = load(script, instrument_names())
    except ScriptError as e:
        fail(str(e))
    for step in flags["script"].steps:
        sampling_from(**step.sampling)  # a bad value fails now, naming the range
    open_app(no_compile=False, resume=None, lecture=True, **NOT_IN_A_LECTURE, **flags)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def web(
    ctx: typer.Context,
    host: str = typer.Option("127.0.0.1", "--host", help="Where to listen; beyond this machine, warned."),
    port: int = typer.Option(8000, "--port", help="The port browsers connect to."),
    lecture: bool = typer.Option(False, "--lecture", help="Serve `llmchat lecture` (its preset)."),
) -> None:
    """Serve the app to browsers (textual-serve): each tab runs its own llmchat, with its own model
    and a data and config directory of its own. The app's flags follow, e.g. `llmchat web --port
    8000 --precision bf16`."""
    from tui.cli.web import serve

    serve(host, port, lecture, ctx.args, app)


def instrument_names() -> set[str]:
    from tui.instruments import SCREENS  # step mode is a switch, not a screen to open

    return set(SCREENS)


def open_app(no_compile: bool, resume: str | None, **flags: Any) -> None:
    """Check the app's flags before anything loads, then hand them to the app."""
    if flags["sampling"]:
        sampling_from(**flags["sampling"])  # a bad flag fails now (this imports torch: only when given)
    check_engine_flags(flags)
    check_remote_flags(flags["server"], flags["read_timeout"])
    problem = text_problem(flags["system"])
    if problem:
        fail(problem)
    resume_id = resolve_resume(resume) if resume is not None else None
    if no_compile:
        os.environ["LLMCHAT_COMPILE"] = "0"
    from tui.app import make_app, run_app

    script = flags.pop("script", None)
    if script is not None:
        from tui.demo import DemoApp

        run_app(make=partial(DemoApp, script), resume=resume_id, **flags)
    else:
        run_app(make=make_app, resume=resume_id, **flags)


@app.command()
@with_sampling
def ask(
    prompts: list[str] = typer.Argument(..., help="The question; each extra prompt is a follow-up turn."),
    model: Optional[str] = options.Model,
    precision: Optional[str] = options.Precision,
    device: Optional[str] = options.Device,
    sampling: Any = None,
    system: Optional[str] = options.System,
    context: Optional[int] = options.Context,
    as_json: bool = typer.Option(False, "--json", help="Print JSON Lines events instead of text."),
    conversation: Optional[str] = typer.Option(
        None, "--conversation", "-c", help="Continue saved conversation ID ('last' for the most recent)."
    ),
    no_save: bool = typer.Option(False, "--no-save", help="Do not save the turns of this run."),
    speculative: Optional[str] = options.Speculative,
    draft_tokens: Optional[int] = options.DraftTokens,
    kv_cache: Optional[str] = options.KVCache,
    raw: bool = options.Raw,
    chat_template: Optional[str] = options.ChatTemplate,
    thinking: Optional[str] = options.Thinking,
    server: Optional[str] = options.Server,
    api_key_env: Optional[str] = options.ApiKeyEnv,
    read_timeout: Optional[float] = options.ReadTimeout,
) -> None:
    """Answer PROMPTS headless: the answer on stdout, a stats line per turn on stderr; every turn is saved.

    Ctrl+C, SIGTERM or a closed terminal stop the answer and save its part so far (exit 130, 143,
    129); so does a closed stdout, e.g. `| head` (exit 141).
    """
    flags = dict(locals())  # the parameters, as parsed: nothing else is defined yet
    from tui.cli.ask import AskFlags, answer_prompts

    answer_prompts(AskFlags(**flags))


@app.command()
@with_serving
def bench(
    model: Optional[str] = options.Model,
    precision: list[str] = typer.Option(["fp32"], "--precision", "-p", help="Repeat for several precisions."),
    device: Optional[str] = options.Device,
    prompt_lengths: Optional[str] = typer.Option(
        None, "--prompt-lengths", help="Comma-separated prefill lengths (16,128,512; --server: 64,256,1024)."
    ),
    decode_tokens: int = typer.Option(64, "--decode-tokens", help="Tokens decoded per timed run."),
    repeats: int = typer.Option(3, "--repeats", help="Timed runs per measurement (median reported)."),
    turns: int = typer.Option(3, "--turns", help="Turns in the multi-turn reuse measurement."),
    long_context: int = typer.Option(
        0, "--long-context", help="Also compare ITL at this context length with ~100."
    ),
    random_weights: bool = typer.Option(
        False, "--random-weights", help="The model's architecture with random weights."
    ),
    raw: bool = options.Raw,
    chat_template: Optional[str] = options.ChatTemplate,
    no_compile: bool = typer.Option(False, "--no-compile", help="Measure the eager decode step only."),
    speculative: Optional[str] = options.Speculative,
    draft_tokens: Optional[int] = options.DraftTokens,
    kv_cache: Optional[list[str]] = typer.Option(
        None,
        "--kv-cache",
        help="Time decode at --kv-cache-context tokens with each of these KV cache precisions "
        "(repeat the flag, or 'all': fp32, bf16, fp16, int8), in one run.",
    ),
    kv_cache_context: int = typer.Option(
        4000, "--kv-cache-context", help="Context length for the --kv-cache measurement."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of tables."),
    server: Optional[str] = options.Server,
    api_key_env: Optional[str] = options.ApiKeyEnv,
    read_timeout: Optional[float] = options.ReadTimeout,
    concurrency: str = typer.Option(
        "1,2,4,8", "--concurrency", help="With --server: comma-separated numbers of simultaneous streams."
    ),
    serving: Any = None,
) -> None:
    """Measure prefill, decode, multi-turn reuse and memory against transformers' generate;
    with --server, the server's prefill, decode, prefix cache and concurrent streams; with --server
    and any serving flag (--num-prompts, --request-rate, --sweep, ...), a serving benchmark whose
    --json reads as `vllm bench serve`'s result file."""
    flags = dict(locals())  # the parameters, as parsed: nothing else is defined yet
    from tui.cli.benchmark import BenchFlags, measure

    measure(BenchFlags(**flags))


@app.command()
def top(
    server: Optional[str] = typer.Option(
        None,
        "--server",
        help="The OpenAI-compatible server to watch (vLLM, SGLang, llama-server), e.g. http://host:8000/v1.",
    ),
    api_key_env: Optional[str] = options.ApiKeyEnv,
    interval: str = typer.Option(
        "1", "--interval", metavar="SECONDS", help="Seconds between polls, 0.1 to 60."
    ),
    once: bool = typer.Option(False, "--once", help="Print one reading (rates over one interval) and exit."),
    as_json: bool = typer.Option(False, "--json", help="With --once: one JSON object instead of text."),
) -> None:
    """Watch a server's load live: requests running and waiting, KV cache use, prompt and
    generation tokens/s, prefix-cache hits, speculative acceptance (and llama.cpp's slots),
    from its /metrics. Esc or q quits."""
    flags = dict(locals())  # the parameters, as parsed: nothing else is defined yet
    from tui.cli.top import TopFlags, watch

    watch(TopFlags(**flags))


def _summaries_on_one_line(*typers: typer.Typer) -> None:
    """The list of commands shows each one's first paragraph with the docstring's line breaks
    (rich help keeps them there, not on the command's own page): give it that paragraph as one line."""
    for commands in typers:
        for info in commands.registered_commands:
            first = (inspect.getdoc(info.callback) or "").split("\n\n")[0]
            info.short_help = info.short_help or " ".join(first.split())


_summaries_on_one_line(app, conversations_app, lab_app)

if __name__ == "__main__":
    app()
