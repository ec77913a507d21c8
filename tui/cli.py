"""The `llmchat` command: the app by default, plus headless `ask`, `bench` and friends.

Textual is imported only when the app starts, so headless commands stay light.
"""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer

from engine.models import DEFAULT_MODEL

app = typer.Typer(add_completion=False, no_args_is_help=False, help="See LLM inference happen, live.")

ModelOpt = typer.Option(DEFAULT_MODEL, "--model", "-m", help="smollm2-135m, an HF model directory, a .gguf file or a hub id.")
PrecisionOpt = typer.Option("fp32", "--precision", "-p", help="fp32, bf16, fp16, int8 or nf4.")
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


def sampling_from(**flags):
    """SamplingSettings from CLI flags (unset flags keep the defaults); exits with the range on error."""
    from engine.sampling import SamplingSettings

    given = {k: v for k, v in flags.items() if v is not None}
    try:
        return SamplingSettings(**given)
    except ValueError as e:
        fail(str(e))


def fail(message: str) -> None:
    typer.echo(f"llmchat: {message}", err=True)
    raise typer.Exit(2)


@app.callback(invoke_without_command=True)
def main(
    ctx: typer.Context,
    model: str = ModelOpt,
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
    theme: Optional[str] = typer.Option(None, "--theme", help="Theme name (see the settings screen)."),
) -> None:
    """Open the chat app (the default when no command is given)."""
    if ctx.invoked_subcommand is not None:
        return
    sampling = sampling_from(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        repetition_penalty=repetition_penalty, seed=seed, max_new_tokens=max_new_tokens,
    )
    from tui.app import run_app

    run_app(model=model, precision=precision, device=device, sampling=sampling, system=system, context=context, theme=theme)


@app.command()
def ask(
    prompts: list[str] = typer.Argument(..., help="The question; each extra prompt is a follow-up turn."),
    model: str = ModelOpt,
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
) -> None:
    """Answer PROMPTS headless: the answer on stdout, a stats line per turn on stderr."""
    from engine import models
    from engine.events import Failed, ModelLoading, ModelReady, Notice, TokenSampled, TurnFinished, to_json
    from engine.precision import PrecisionError
    from engine.session import ChatSession

    sampling = sampling_from(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        repetition_penalty=repetition_penalty, seed=seed, max_new_tokens=max_new_tokens,
    )

    def emit(event) -> None:
        if as_json:
            sys.stdout.write(json.dumps(to_json(event), ensure_ascii=False) + "\n")
            sys.stdout.flush()
        elif isinstance(event, TokenSampled) and event.text:
            sys.stdout.write(event.text)
            sys.stdout.flush()
        elif isinstance(event, TurnFinished):
            sys.stdout.write("\n")
            sys.stdout.flush()
            typer.echo(stats_line(event.stats), err=True)
        elif isinstance(event, (Notice, ModelLoading)) and not isinstance(event, ModelLoading):
            typer.echo(f"llmchat: {event.message}", err=True)

    try:
        loaded = models.load(model, precision, device, progress=lambda s, f: emit(ModelLoading(s, f)) if as_json else None)
    except (models.ModelError, PrecisionError) as e:
        fail(str(e))
    emit(ModelReady(loaded.info))
    session = ChatSession(loaded, sampling, system, context)
    failed = False
    try:
        for prompt in prompts:
            for event in session.send(prompt):
                emit(event)
                if isinstance(event, Failed):
                    failed = True
                    if not as_json:
                        typer.echo(f"llmchat: {event.message}", err=True)
    except KeyboardInterrupt:
        session.cancel.set()
        typer.echo("\nllmchat: interrupted", err=True)
        raise typer.Exit(130)
    if failed:
        raise typer.Exit(1)


@app.command()
def bench(
    model: str = ModelOpt,
    precision: list[str] = typer.Option(["fp32"], "--precision", "-p", help="Repeat for several precisions."),
    device: str = DeviceOpt,
    prompt_lengths: str = typer.Option("16,128,512", "--prompt-lengths", help="Comma-separated prefill lengths."),
    decode_tokens: int = typer.Option(64, "--decode-tokens", help="Tokens decoded per timed run."),
    repeats: int = typer.Option(3, "--repeats", help="Timed runs per measurement (median reported)."),
    turns: int = typer.Option(3, "--turns", help="Turns in the multi-turn reuse measurement."),
    long_context: int = typer.Option(0, "--long-context", help="Also compare ITL at this context length with ~100."),
    random_weights: bool = typer.Option(False, "--random-weights", help="The model's architecture with random weights."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of tables."),
) -> None:
    """Measure prefill, decode, multi-turn reuse and memory against transformers' generate."""
    from engine import bench as bench_engine
    from engine.models import ModelError
    from engine.precision import PrecisionError

    config = bench_engine.BenchConfig(
        model=model,
        precisions=tuple(precision),
        device=device,
        prompt_lengths=tuple(int(x) for x in prompt_lengths.split(",") if x.strip()),
        decode_tokens=decode_tokens,
        repeats=repeats,
        turns=turns,
        long_context=long_context,
        random_weights=random_weights,
    )
    try:
        result = bench_engine.run(config, report=lambda line: typer.echo(line, err=True))
    except (ModelError, PrecisionError) as e:
        fail(str(e))
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        from tui.bench_table import print_tables

        print_tables(result)


def stats_line(stats) -> str:
    return (
        f"[{stats.prompt_tokens} prompt tokens, {stats.reused_tokens} reused, {stats.prefilled_tokens} prefilled | "
        f"TTFT {stats.ttft_s * 1000:.0f} ms | ITL p50 {stats.itl_p50_s * 1000:.1f} ms p90 {stats.itl_p90_s * 1000:.1f} ms | "
        f"prefill {stats.prefill_tok_s:.0f} tok/s | decode {stats.decode_tok_s:.1f} tok/s | "
        f"{stats.generated_tokens} tokens | stop: {stats.stop}]"
    )


if __name__ == "__main__":
    app()
