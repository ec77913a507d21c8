"""`llmchat lab batching`: the serving lab, headless (engine/lab/): three scheduling policies on
one seeded workload over a paged KV pool, then a decode sweep over batch sizes."""

from __future__ import annotations

import json
import math
import os
from typing import Optional

import typer

from engine import DEFAULT_MODEL
from tui.cli import options
from tui.cli.checks import check_serving_figures
from tui.cli.exits import fail
from tui.fmt import visible_controls

lab_app = typer.Typer(
    no_args_is_help=True,
    help="The serving lab: continuous batching over a paged KV cache, on the real model, measured.",
)


def machine_memory_mib() -> float | None:
    """This machine's physical memory in MiB (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20
    except (ValueError, OSError, AttributeError):
        return None


def check_budget(budget_mib: float, memory_mib: float | None, where: str) -> None:
    """--budget-mib is a pool this memory can hold (inf or 1e9 MiB failed only once allocated)."""
    if not math.isfinite(budget_mib) or (memory_mib is not None and budget_mib > memory_mib):
        limit = f"{memory_mib:,.0f} MiB" if memory_mib is not None else "a finite number of MiB"
        fail(f"--budget-mib must fit in {where}'s memory ({limit}), got {budget_mib:g}")


def check_threads(threads: int) -> None:
    """--threads is 1 .. this machine's cores (more only queue behind each other, many times slower)."""
    cores = os.cpu_count() or 1
    if not 1 <= threads <= cores:
        fail(f"--threads must be at least 1 and at most {cores} (this machine's CPU cores), got {threads}")


def check_fits_context(config, loaded) -> None:
    """The longest question and its longest answer fit the model's context: past it positions
    mean nothing to the model, and a long enough --max-new runs for hours."""
    from engine.lab.workload import build

    context = loaded.info.context
    longest = max(len(spec.prompt) for spec in build(config.workload, loaded.tokenizer))
    if longest + config.max_new > context:
        fail(
            f"--max-new {config.max_new}: the longest question ({longest} tokens) and its answer must fit "
            f"the model's context of {context} tokens; use --max-new {max(1, context - longest)} or less"
        )


def check_device_budget(budget_mib: float, device: str) -> None:
    """On a GPU, --budget-mib fits in its memory too (the machine's memory was checked before loading)."""
    from engine.lab.run import device_memory_mib

    memory = device_memory_mib(device)
    if memory is not None:
        check_budget(budget_mib, memory, device)


@lab_app.command()
def batching(
    requests: int = typer.Option(8, "--requests", help="Simulated users (one question each)."),
    max_batch: int = typer.Option(4, "--max-batch", help="Most sequences in one step (static: batch size)."),
    budget_mib: float = typer.Option(48.0, "--budget-mib", help="Memory for the paged KV pool, MiB."),
    max_new: int = typer.Option(16, "--max-new", help="Longest answer (each user wants max/4..max tokens)."),
    min_new: Optional[int] = typer.Option(
        None, "--min-new", help="Shortest answer (default: a quarter of --max-new); lower spreads them wider."
    ),
    arrivals: str = typer.Option(
        "poisson", "--arrivals", help="'poisson' (see --rate) or 'once' (all at 0)."
    ),
    rate: float = typer.Option(4.0, "--rate", help="Poisson arrivals: mean requests per second."),
    seed: int = typer.Option(0, "--seed", help="Seeds the questions' order and the arrival times."),
    saturate: bool = typer.Option(
        False,
        "--saturate",
        help="A workload the engine, not the arrivals, limits: 4 x --max-batch requests at once, answers "
        "1 to max(64, --max-new) tokens (replaces --requests, --arrivals, --min-new).",
    ),
    block_size: int = typer.Option(16, "--block-size", help="Tokens per KV block."),
    step_tokens: int = typer.Option(
        64, "--step-tokens", help="Most tokens one step feeds (chunked prefill)."
    ),
    model: str = typer.Option(
        DEFAULT_MODEL, "--model", "-m", help="A model of a fast-path family (Llama, Mistral, Qwen2, Qwen3)."
    ),
    precision: str = typer.Option("fp32", "--precision", "-p", help="fp32, bf16 or fp16."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    threads: Optional[int] = typer.Option(
        None, "--threads", help="torch CPU threads (default: torch's; 1 is steadier on a busy machine)."
    ),
    percentiles: Optional[str] = options.Percentiles,
    goodput: Optional[list[str]] = options.Goodput,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of tables."),
) -> None:
    """Serve one workload three ways (sequential, static, continuous) and sweep decode over B."""
    percentiles_, slo = check_serving_figures(percentiles, goodput)
    config = lab_config(dict(locals()) | {"percentiles": percentiles_, "slo": slo})
    if saturate:
        config = config.saturating()
    check_budget(budget_mib, machine_memory_mib(), "this machine")
    if threads is not None:
        use_threads(threads)
    loaded = load(model, precision, device)
    check_device_budget(budget_mib, loaded.info.device)
    check_fits_context(config, loaded)
    show(measure(loaded, config), as_json)


def lab_config(flags: dict):
    """The lab's settings from the flags of the same names; exits naming the flag of a bad one."""
    import dataclasses

    from engine.lab.run import LabConfig, LabError

    given = {f.name: flags[f.name] for f in dataclasses.fields(LabConfig) if f.name in flags}
    try:
        config = LabConfig(**given)
        config.workload  # checks arrivals and rate
    except ValueError as e:
        fail(str(e) if isinstance(e, LabError) else f"--{e}")
    return config


def use_threads(threads: int) -> None:
    check_threads(threads)
    from engine.lab.run import set_threads

    set_threads(threads)


def load(model: str, precision: str, device: str):
    from engine import models
    from engine.quant.precision import PrecisionError

    try:
        return models.load(model, precision, device)
    except (models.ModelError, PrecisionError) as e:
        fail(str(e))


def measure(loaded, config):
    """Calibrate this machine's peaks, then run the lab (progress on stderr)."""
    from engine.instruments.phases import calibrate, dtype_of
    from engine.lab.run import LabError, run

    def say(line: str) -> None:
        typer.echo(visible_controls(line), err=True)

    say("calibrating this machine's peaks (cached after the first time) ...")
    peaks = calibrate(loaded.info.device, dtype_of(loaded.info.compute_dtype))
    try:
        return run(loaded, config, calibration=peaks, report=say)
    except LabError as e:
        fail(str(e))


def show(result, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(result.to_json(), indent=2))
        return
    from tui.cli.lab_table import print_lab

    print_lab(result.to_json())
