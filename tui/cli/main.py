"""The `llmchat` command: the app by default, plus headless `ask`, `bench` and friends.

Textual is imported only when the app starts, so headless commands stay light.
"""

from __future__ import annotations

import json
import os
import sys
from typing import NoReturn, Optional

import typer

from engine import DEFAULT_MODEL
from engine.quant.precision import precision_help
from tui.cli import remote
from tui.cli.conversations import conversations_app
from tui.cli.lab import lab_app
from tui.fmt import visible_controls

app = typer.Typer(add_completion=False, no_args_is_help=False, help="See LLM inference happen, live.")
app.add_typer(conversations_app, name="conversations")
app.add_typer(lab_app, name="lab")

ModelOpt = typer.Option(
    DEFAULT_MODEL, "--model", "-m", help="smollm2-135m, an HF model directory, a .gguf file or a hub id."
)
PrecisionOpt = typer.Option("fp32", "--precision", "-p", help=precision_help() + ".")
DeviceOpt = typer.Option("auto", "--device", help="auto, cpu or cuda.")
TemperatureOpt = typer.Option(None, "--temperature", "-t", help="0 is greedy.")
TopKOpt = typer.Option(None, "--top-k", help="Keep the k most probable tokens (0 = all).")
TopPOpt = typer.Option(None, "--top-p", help="Nucleus sampling mass in (0, 1].")
MinPOpt = typer.Option(None, "--min-p", help="Drop tokens below min_p x the top probability.")
RepetitionOpt = typer.Option(None, "--repetition-penalty", help="1 is off.")
SeedOpt = typer.Option(None, "--seed", help="Seed for reproducible sampling.")
MaxNewOpt = typer.Option(None, "--max-new-tokens", "-n", help="Stop an answer after this many tokens.")
SystemOpt = typer.Option(None, "--system", help="System prompt.")
ContextOpt = typer.Option(None, "--context", help="Limit the context window to this many tokens.")
SpeculativeOpt = typer.Option(
    None,
    "--speculative",
    help="Speculative decoding (off by default): 'lookup' (n-gram match against the conversation) "
    "or a draft MODEL[@PRECISION] with the same tokenizer (default precision: w8 on a CPU).",
)
DraftTokensOpt = typer.Option(4, "--draft-tokens", help="Tokens drafted per speculative round, 1..8.")
KVCacheOpt = typer.Option(
    None,
    "--kv-cache",
    help="KV cache precision: fp32, bf16, fp16 or int8 (one scale per token and head); "
    "default: the model precision's own (fp32 on a CPU).",
)


def sampling_from(**flags):
    """SamplingSettings from CLI flags (unset flags keep the defaults); exits with the range on error."""
    from engine.sampling import SamplingSettings

    given = {k: v for k, v in flags.items() if v is not None}
    try:
        return SamplingSettings(**given)
    except ValueError as e:
        fail(str(e))


def fail(message: str) -> NoReturn:
    typer.echo(f"llmchat: {visible_controls(message)}", err=True)  # it may name a path or a server's words
    raise typer.Exit(2)


def check_kv_cache(precision: str | None) -> None:
    """--kv-cache names one of the cache precisions (checked before anything loads)."""
    from tui.config import KV_CACHE_CHOICES

    if precision is not None and precision not in KV_CACHE_CHOICES:
        fail(f"--kv-cache must be one of {', '.join(KV_CACHE_CHOICES)}, got {precision!r}")


def check_draft_tokens(k: int) -> None:
    """--draft-tokens is 1..8 (checked before anything loads)."""
    if not 1 <= k <= 8:
        fail(f"--draft-tokens must be a whole number from 1 to 8, got {k}")


def speculation_for(choice: str, k: int, loaded, as_json: bool):
    """The Speculation for --speculative (None when off); a draft that cannot be used refuses."""
    if choice is None:
        return None
    from engine.models import ModelError
    from engine.quant.precision import PrecisionError
    from engine.speculative.loop import make_speculation

    try:
        return make_speculation(choice, k, loaded)
    except (ValueError, ModelError, PrecisionError) as e:
        refuse(f"--speculative {choice}: {e}", as_json)


def check_context(context: int | None) -> None:
    """Exit with the reason if `--context` is given and not a positive number of tokens."""
    if context is not None and context < 1:
        fail(f"--context must be a positive number of tokens, got {context}")


def text_problem(system: str | None, prompts: list[str] = ()) -> str | None:
    """Why the system prompt or a prompt cannot be sent (not UTF-8: bytes from argv), or None."""
    from engine.utf8 import utf8_problem

    named = [(system, "--system")] if system is not None else []
    single = len(prompts) == 1
    named += [(p, "the prompt" if single else f"prompt {i}") for i, p in enumerate(prompts, 1)]
    return next((problem for text, what in named if (problem := utf8_problem(text, what))), None)


@app.callback(invoke_without_command=True)
def main(
    ctx: typer.Context,
    model: Optional[str] = typer.Option(
        None, "--model", "-m", help="smollm2-135m (default), an HF model directory, a .gguf file or a hub id."
    ),
    precision: Optional[str] = typer.Option(
        None, "--precision", "-p", help=precision_help() + " (default fp32)."
    ),
    device: Optional[str] = typer.Option(None, "--device", help="auto (default), cpu or cuda."),
    temperature: Optional[float] = TemperatureOpt,
    top_k: Optional[int] = TopKOpt,
    top_p: Optional[float] = TopPOpt,
    min_p: Optional[float] = MinPOpt,
    repetition_penalty: Optional[float] = RepetitionOpt,
    seed: Optional[int] = SeedOpt,
    max_new_tokens: Optional[int] = MaxNewOpt,
    system: Optional[str] = SystemOpt,
    context: Optional[int] = ContextOpt,
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
    speculative: Optional[str] = SpeculativeOpt,
    draft_tokens: Optional[int] = typer.Option(
        None, "--draft-tokens", help="Tokens drafted per speculative round, 1..8 (default 4)."
    ),
    kv_cache: Optional[str] = KVCacheOpt,
    server: Optional[str] = remote.ServerOpt,
    api_key_env: Optional[str] = remote.ApiKeyEnvOpt,
    read_timeout: Optional[float] = typer.Option(
        None, "--read-timeout", help="With --server: seconds the server may stay silent mid-answer (120)."
    ),
) -> None:
    """Open the chat app (the default when no command is given).

    Defaults come from config.json in the user config dir ($LLMCHAT_CONFIG_DIR overrides it);
    flags win over the file.
    """
    if ctx.invoked_subcommand is not None:
        return
    flags = dict(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        seed=seed,
        max_new_tokens=max_new_tokens,
    )
    given = {k: v for k, v in flags.items() if v is not None}
    if given:
        sampling_from(**given)  # fail fast on a bad flag (this imports torch, so only when flags are given)
    if server is not None and (precision is not None or device is not None):
        fail("--precision and --device: the server decides where and at what precision its model runs")
    check_context(context)
    if draft_tokens is not None:
        check_draft_tokens(draft_tokens)
    check_kv_cache(kv_cache)
    if server is not None and kv_cache is not None:
        fail("--kv-cache: a server keeps its own KV cache")
    problem = text_problem(system)
    if problem:
        fail(problem)
    resume_id = resolve_resume(resume) if resume is not None else None
    if no_compile:
        os.environ["LLMCHAT_COMPILE"] = "0"
    from tui.app import run_app

    run_app(
        model=model,
        precision=precision,
        device=device,
        sampling=given,
        system=system,
        context=context,
        theme=theme,
        resume=resume_id,
        speculative=speculative,
        draft_tokens=draft_tokens,
        kv_cache=kv_cache,
        server=server,
        api_key_env=api_key_env,
        read_timeout=read_timeout,
    )


def refuse(message: str, as_json: bool) -> NoReturn:
    """`fail`, after an `error` event when the output is JSON Lines (so a reader sees why it ended)."""
    if as_json:
        from engine.events import Failed, to_json

        sys.stdout.write(json.dumps(to_json(Failed(message))) + "\n")
        sys.stdout.flush()
    fail(message)


def resolve_resume(ref: str) -> int:
    """The conversation id `--resume` names ('last' fixed now); exits with the reason if there is none."""
    from engine.saved.store import Store, StoreError

    try:
        with Store() as store:
            return store.resolve(ref)
    except StoreError as e:
        fail(f"--resume: {e}")


@app.command()
def ask(  # noqa: C901 (issue 32: to split into named steps)
    prompts: list[str] = typer.Argument(..., help="The question; each extra prompt is a follow-up turn."),
    model: Optional[str] = typer.Option(
        None,
        "--model",
        "-m",
        help="smollm2-135m (default), an HF model directory, a .gguf file or a hub id; "
        "with --server, one of the server's models (default: the first it lists).",
    ),
    precision: str = PrecisionOpt,
    device: str = DeviceOpt,
    temperature: Optional[float] = TemperatureOpt,
    top_k: Optional[int] = TopKOpt,
    top_p: Optional[float] = TopPOpt,
    min_p: Optional[float] = MinPOpt,
    repetition_penalty: Optional[float] = RepetitionOpt,
    seed: Optional[int] = SeedOpt,
    max_new_tokens: Optional[int] = MaxNewOpt,
    system: Optional[str] = SystemOpt,
    context: Optional[int] = ContextOpt,
    as_json: bool = typer.Option(False, "--json", help="Print JSON Lines events instead of text."),
    conversation: Optional[str] = typer.Option(
        None, "--conversation", "-c", help="Continue saved conversation ID ('last' for the most recent)."
    ),
    no_save: bool = typer.Option(False, "--no-save", help="Do not save the turns of this run."),
    speculative: Optional[str] = SpeculativeOpt,
    draft_tokens: int = DraftTokensOpt,
    kv_cache: Optional[str] = KVCacheOpt,
    server: Optional[str] = remote.ServerOpt,
    api_key_env: Optional[str] = remote.ApiKeyEnvOpt,
    read_timeout: float = remote.ReadTimeoutOpt,
) -> None:
    """Answer PROMPTS headless: the answer on stdout, a stats line per turn on stderr; every turn is saved.

    Ctrl+C, SIGTERM or a closed terminal stop the answer and save its part so far (exit 130, 143,
    129); so does a closed stdout, e.g. `| head` (exit 141).
    """
    if conversation is not None and system is not None:
        fail("--system cannot change a saved conversation; it keeps the system prompt it was started with")
    if server is not None and (precision != "fp32" or device != "auto"):
        fail("--precision and --device: the server decides where and at what precision its model runs")
    check_context(context)
    check_draft_tokens(draft_tokens)
    check_kv_cache(kv_cache)
    if server is not None and kv_cache is not None:
        fail("--kv-cache: a server keeps its own KV cache")
    problem = text_problem(system, prompts)
    if problem:  # before a model loads or anything is saved
        refuse(problem, as_json)

    from engine.events import Failed, ModelReady, Notice, TokenSampled, TurnFinished, to_json
    from engine.saved.chat import SavedChat
    from engine.saved.store import Store, StoreError
    from tui.cli.stops import Stops

    sampling = sampling_from(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        seed=seed,
        max_new_tokens=max_new_tokens,
    )
    stops = Stops()
    write = stops.write  # a closed output stops the answer instead of failing it

    on_terminal = sys.stdout.isatty()

    def out(text: str) -> None:
        """Byte-exact into a file or a pipe; on a terminal the model's control characters are shown."""
        write(sys.stdout, visible_controls(text) if on_terminal else text)

    def emit(event) -> None:
        if as_json:
            out(json.dumps(to_json(event), ensure_ascii=False) + "\n")
        elif isinstance(event, TokenSampled) and event.text:
            out(event.text)
        elif isinstance(event, TurnFinished):
            out("\n")
            write(sys.stderr, stats_line(event.stats) + "\n")
            if session.speculation is not None:
                write(sys.stderr, speculation_line(session.speculation) + "\n")
            if event.error:
                write(sys.stderr, f"llmchat: {visible_controls(event.error, one_line=True)}\n")
        elif isinstance(event, Notice):
            write(sys.stderr, f"llmchat: {event.message}\n")
        elif isinstance(event, ModelReady) and event.info.server is not None:
            write(sys.stderr, f"llmchat: {remote.server_line(event.info)}\n")

    if server is not None:
        where = remote.target(server, model, api_key_env, read_timeout)
        session = remote.connect_or_fail(where, sampling, system, context, lambda e: refuse(e, as_json))
        stops.on_stop = session.cancel.set  # a silent server would hold the stop until it spoke
    else:
        session = local_session(
            model or DEFAULT_MODEL,
            precision,
            device,
            sampling,
            system,
            context,
            emit,
            as_json,
            kv_cache,
            fast_only=speculative is None,  # a draft model and the verify pass may need the HF forward
        )
    emit(ModelReady(session.info))
    if server is None and as_json:
        from engine.fast.step_path import decode_step

        emit(decode_step(session, off=ASK_DECODES))
    if speculative is not None:
        if server is not None:
            refuse("--speculative needs the local engine: a server decides how it decodes", as_json)
        session.speculation = speculation_for(speculative, draft_tokens, session.loaded, as_json)
    store = None
    if conversation is not None or not no_save:
        try:
            store = Store()
        except StoreError as e:
            if conversation is not None:
                fail(str(e))
            emit(Notice(f"not saving this conversation: {e}"))
    read_only = store is not None and store.damaged is not None
    if read_only:  # a damaged store is only read (to resume from), never written
        emit(Notice(f"not saving this conversation: {store.damaged}"))
        if conversation is None:
            store.close()
            store = None
    chat = SavedChat(session, store)
    if conversation is not None:
        for event in chat.resume(conversation):
            emit(event)
            if isinstance(event, Failed):
                fail(event.message)
        if no_save or read_only:
            chat.store = None

    failed = False
    # Held to the end: a signal while the cache is saved is answered, not fatal.
    with stops:
        try:
            for prompt in prompts:
                if stops.code is not None:
                    break
                for event in chat.send(prompt):
                    emit(event)
                    if isinstance(event, Failed):
                        failed = True
                        if not as_json:
                            write(sys.stderr, f"llmchat: {event.message}\n")
                    elif isinstance(event, TurnFinished) and event.error:
                        failed = True  # the partial answer is saved; the exit status says it is cut
                    if stops.code is not None:
                        session.cancel.set()  # the answer stops after this token; its part so far is saved
                if chat.refused:  # another llmchat is writing to the conversation: follow-ups make no sense
                    break
        except KeyboardInterrupt:
            write(sys.stderr, "\nllmchat: interrupted\n")
            raise typer.Exit(130)
        if chat.store is not None and chat.conversation_id is not None and not chat.refused:
            saved = chat.save_cache()
            if saved is not None:
                emit(saved)
            emit(
                Notice(
                    f"saved as conversation {chat.conversation_id}; "
                    f"continue it with --conversation {chat.conversation_id}"
                )
            )
        if stops.code is not None:
            write(sys.stderr, f"llmchat: {stops.reason}\n")
            raise typer.Exit(stops.code)
    if failed:
        raise typer.Exit(1)


@app.command()
def bench(
    model: Optional[str] = typer.Option(
        None,
        "--model",
        "-m",
        help="smollm2-135m (default), an HF model directory, a .gguf file or a hub id; "
        "with --server, one of the server's models (default: the first it lists).",
    ),
    precision: list[str] = typer.Option(["fp32"], "--precision", "-p", help="Repeat for several precisions."),
    device: str = DeviceOpt,
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
    no_compile: bool = typer.Option(False, "--no-compile", help="Measure the eager decode step only."),
    speculative: Optional[str] = SpeculativeOpt,
    draft_tokens: int = DraftTokensOpt,
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
    server: Optional[str] = remote.ServerOpt,
    api_key_env: Optional[str] = remote.ApiKeyEnvOpt,
    read_timeout: float = remote.ReadTimeoutOpt,
    concurrency: str = typer.Option(
        "1,2,4,8", "--concurrency", help="With --server: comma-separated numbers of simultaneous streams."
    ),
) -> None:
    """Measure prefill, decode, multi-turn reuse and memory against transformers' generate;
    with --server, the server's prefill, decode, prefix cache and concurrent streams."""
    if server is not None:
        if kv_cache:
            fail("--kv-cache: a server keeps its own KV cache")
        where = remote.target(server, model, api_key_env, read_timeout)
        lengths = numbers(prompt_lengths or "64,256,1024", "--prompt-lengths")
        streams = numbers(concurrency, "--concurrency")
        try:
            config = remote.bench_config(where, lengths, decode_tokens, repeats, turns, streams)
        except ValueError as e:
            fail(flag_named(e))
        emit_result(remote.bench(config), as_json, "tui.cli.remote_bench_table", "print_remote_tables")
        return
    from engine import bench as bench_engine
    from engine.models import ModelError
    from engine.quant.precision import PrecisionError

    check_draft_tokens(draft_tokens)
    kv_caches = kv_cache_list(kv_cache or [])
    try:
        config = bench_engine.BenchConfig(
            model=model or DEFAULT_MODEL,
            precisions=tuple(precision),
            device=device,
            prompt_lengths=numbers(prompt_lengths or "16,128,512", "--prompt-lengths"),
            decode_tokens=decode_tokens,
            repeats=repeats,
            turns=turns,
            long_context=long_context,
            random_weights=random_weights,
            compile=not no_compile,
            speculative=speculative,
            draft_tokens=draft_tokens,
            kv_caches=kv_caches,
            kv_cache_context=kv_cache_context,
        )
    except ValueError as e:
        fail(flag_named(e))
    try:
        result = bench_engine.run(config, report=lambda line: typer.echo(visible_controls(line), err=True))
    except (ModelError, PrecisionError) as e:
        fail(str(e))
    emit_result(result, as_json, "tui.cli.bench_table", "print_tables")


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


def flag_named(error: ValueError) -> str:
    """A bench config's "repeats must be ...": the field, named as its flag."""
    field, _, rest = str(error).partition(" ")
    return f"--{field.replace('_', '-')} {rest}"


def emit_result(result: dict, as_json: bool, module: str, printer: str) -> None:
    """One JSON object, or the tables (Rich is imported only for those)."""
    if as_json:
        typer.echo(json.dumps(result, indent=2))
        return
    import importlib

    getattr(importlib.import_module(module), printer)(result)


ASK_DECODES = "ask runs the eager step: a one-shot command does not wait for a compile"


def local_session(
    model, precision, device, sampling, system, context, emit, as_json, kv_cache=None, fast_only=False
):
    """Load the model here (loading progress as events with --json); exits with the reason if it cannot.
    `fast_only`: nothing but the fast path will run, so transformers may be skipped (engine/models.py)."""
    from engine import models
    from engine.events import ModelLoading
    from engine.quant.precision import PrecisionError
    from engine.session import ChatSession

    try:
        loaded = models.load(
            model,
            precision,
            device,
            progress=lambda s, f: emit(ModelLoading(s, f)) if as_json else None,
            fast_only=fast_only,
        )
    except (models.ModelError, PrecisionError) as e:
        refuse(str(e), as_json)
    if kv_cache is not None:
        from engine.kvcache import cache_precision_problem

        problem = cache_precision_problem(kv_cache, loaded.info.device)
        if problem:
            refuse(f"--kv-cache {kv_cache}: {problem}", as_json)
    try:
        session = ChatSession(loaded, sampling, system, context, kv_cache=kv_cache)
    except models.ModelError as e:  # its fast path did not fit in memory
        refuse(str(e), as_json)
    if session.device.type == "cpu" and os.environ.get("LLMCHAT_COMPILE", "1") != "0":
        from engine.fast import kernels

        for name in kernels.KERNELS:  # built by an earlier run of the app: loaded in a millisecond
            kernels.load_built(name)
    return session


def counted(value: int | None, what: str) -> str:
    """'12 reused', or 'reused: not reported' where a server did not say."""
    return f"{value} {what}" if value is not None else f"{what}: not reported"


def speculation_line(speculation) -> str:
    """The turn's speculative rounds, on one line."""
    s = speculation.stats
    return (
        f"[speculative {speculation.drafter.name}, K={speculation.k} | {s.accepted}/{s.drafted} drafts kept "
        f"({s.acceptance:.0%}) | {s.tokens_per_forward:.2f} tokens per forward | {s.rounds} rounds]"
    )


def stats_line(stats) -> str:
    """The client's figures for a turn, then a server's own where it reports them."""
    return (
        f"[{counted(stats.prompt_tokens, 'prompt tokens')}, {counted(stats.reused_tokens, 'reused')}, "
        f"{counted(stats.prefilled_tokens, 'prefilled')} | "
        f"TTFT {stats.ttft_s * 1000:.0f} ms | ITL p50 {stats.itl_p50_s * 1000:.1f} ms "
        f"p90 {stats.itl_p90_s * 1000:.1f} ms | "
        f"prefill {stats.prefill_tok_s:.0f} tok/s | decode {stats.decode_tok_s:.1f} tok/s | "
        f"{stats.generated_tokens} tokens | stop: {stats.stop}{remote.server_figures(stats.server)}"
        f"{contention_part(stats.contention)}]"
    )


def contention_part(contention) -> str:
    """' | CPU share 97%, load 0.9 on 2 cores', or the busy-machine warning; '' where not measured."""
    return "" if contention is None else f" | {contention.describe()}"


if __name__ == "__main__":
    app()
