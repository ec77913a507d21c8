"""`llmchat lab batching`: the serving lab, headless (engine/lab/): three scheduling policies on
one seeded workload over a paged KV pool, then a decode sweep over batch sizes."""

from __future__ import annotations

import json
from typing import NoReturn, Optional

import typer

from engine import DEFAULT_MODEL
from tui.fmt import visible_controls

lab_app = typer.Typer(
    no_args_is_help=True,
    help="The serving lab: continuous batching over a paged KV cache, on the real model, measured.",
)


def _fail(message: str) -> NoReturn:
    typer.echo(f"llmchat: {visible_controls(message)}", err=True)  # it may name a path from argv
    raise typer.Exit(2)


@lab_app.command()
def batching(
    requests: int = typer.Option(8, "--requests", help="Simulated users (one question each)."),
    max_batch: int = typer.Option(4, "--max-batch", help="Most sequences in one step (static: batch size)."),
    budget_mib: float = typer.Option(48.0, "--budget-mib", help="Memory for the paged KV pool, MiB."),
    max_new: int = typer.Option(16, "--max-new", help="Longest answer (each user wants max/4..max tokens)."),
    arrivals: str = typer.Option(
        "poisson", "--arrivals", help="'poisson' (see --rate) or 'once' (all at 0)."
    ),
    rate: float = typer.Option(4.0, "--rate", help="Poisson arrivals: mean requests per second."),
    seed: int = typer.Option(0, "--seed", help="Seeds the questions' order and the arrival times."),
    block_size: int = typer.Option(16, "--block-size", help="Tokens per KV block."),
    step_tokens: int = typer.Option(
        64, "--step-tokens", help="Most tokens one step feeds (chunked prefill)."
    ),
    model: str = typer.Option(DEFAULT_MODEL, "--model", "-m", help="A Llama-family model (the fast path)."),
    precision: str = typer.Option("fp32", "--precision", "-p", help="fp32, bf16 or fp16."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    threads: Optional[int] = typer.Option(
        None, "--threads", help="torch CPU threads (default: torch's; 1 is steadier on a busy machine)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of tables."),
) -> None:
    """Serve one workload three ways (sequential, static, continuous) and sweep decode over B."""
    from engine import models
    from engine.instruments.phases import calibrate, dtype_of
    from engine.lab.run import LabConfig, LabError, run
    from engine.quant.precision import PrecisionError

    try:
        config = LabConfig(
            requests=requests,
            max_batch=max_batch,
            budget_mib=budget_mib,
            max_new=max_new,
            arrivals=arrivals,
            rate=rate,
            seed=seed,
            block_size=block_size,
            step_tokens=step_tokens,
        )
        config.workload  # checks arrivals and rate
    except ValueError as e:
        _fail(str(e) if isinstance(e, LabError) else f"--{e}")
    if threads is not None:
        if threads < 1:
            _fail(f"--threads must be at least 1, got {threads}")
        from engine.lab.run import set_threads

        set_threads(threads)
    try:
        loaded = models.load(model, precision, device)
    except (models.ModelError, PrecisionError) as e:
        _fail(str(e))

    def say(line: str) -> None:
        typer.echo(visible_controls(line), err=True)

    say("calibrating this machine's peaks (cached after the first time) ...")
    peaks = calibrate(loaded.info.device, dtype_of(loaded.info.compute_dtype))
    try:
        result = run(loaded, config, calibration=peaks, report=say)
    except LabError as e:
        _fail(str(e))
    if as_json:
        typer.echo(json.dumps(result.to_json(), indent=2))
        return
    from tui.cli.lab_table import print_lab

    print_lab(result.to_json())
