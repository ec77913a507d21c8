"""`llmchat bench --server URL` with a workload (`--num-prompts`, `--request-rate`, `--sweep`, ...):
the serving benchmark of engine/remote/serving.py, its flags checked before anything connects."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tui.cli.exits import fail

if TYPE_CHECKING:
    from engine.remote.serving import ServingConfig
    from engine.remote.target import RemoteTarget

SWEEPS = {"rate": "request_rate", "concurrency": "max_concurrency"}


@dataclass(frozen=True)
class ServingFlags:
    """The serving flags of `bench` (options.SERVING), as typer parsed them; None where not given."""

    num_prompts: int | None = None
    request_rate: str | None = None
    burstiness: float | None = None
    max_concurrency: int | None = None
    dataset: str | None = None
    input_len: int | None = None
    output_len: int | None = None
    percentiles: str | None = None
    goodput: list[str] | None = None
    sweep: str | None = None
    seed: int | None = None


def bench_serving(flags: ServingFlags, where: RemoteTarget) -> dict:
    """One run, or a sweep, as data. A server that cannot be measured exits 2 with why."""
    import typer

    from engine.remote.client import RemoteError
    from engine.remote.serving import run, sweep
    from tui.fmt import visible_controls

    config = serving_config(flags, where)
    over, values = sweep_of(flags.sweep) if flags.sweep else (None, ())
    report = lambda line: typer.echo(line, err=True)  # noqa: E731
    try:
        result = sweep(config, over, values, report) if over else run(config, report)
    except RemoteError as e:
        fail(visible_controls(str(e), one_line=True))
    return result


def serving_config(flags: ServingFlags, where: RemoteTarget) -> ServingConfig:
    """engine/remote/serving.py's settings from the flags; exits naming the flag of a bad one."""
    from engine.remote.serving import DatasetError, ServingConfig, read_dataset
    from tui.cli.checks import check_serving_figures, flag_named

    if flags.dataset is not None and flags.input_len is not None:
        fail("--dataset gives the prompts; --input-len makes prompts of a length: choose one")
    percentiles, slo = check_serving_figures(flags.percentiles, flags.goodput)
    try:
        extra = {"prompts": read_dataset(flags.dataset)} if flags.dataset is not None else {}
    except DatasetError as e:
        fail(str(e))
    try:
        return ServingConfig(
            target=where,
            num_prompts=16 if flags.num_prompts is None else flags.num_prompts,
            request_rate=rate(flags.request_rate or "inf", "--request-rate"),
            burstiness=1.0 if flags.burstiness is None else flags.burstiness,
            max_concurrency=flags.max_concurrency,
            input_len=flags.input_len,
            output_len=flags.output_len,
            percentiles=percentiles,
            slo=slo,
            seed=0 if flags.seed is None else flags.seed,
            **extra,
        )
    except ValueError as e:
        fail(flag_named(e))


def rate(text: str, flag: str) -> float:
    """'4', '0.5' or 'inf' (all at once) -> requests a second; exits if it is none of those."""
    try:
        value = float(text)
    except ValueError:
        fail(f"{flag} must be a number of requests a second or inf, got {text!r}")
    if not (value > 0) or math.isnan(value):
        fail(f"{flag} must be above 0 (inf: all at once), got {text}")
    return value


def sweep_of(text: str) -> tuple[str, tuple[float, ...]]:
    """'rate:1,2,4,inf' or 'concurrency:1,2,4' -> (the config field, its values in order)."""
    kind, sep, values = text.partition(":")
    over = SWEEPS.get(kind.strip())
    if not sep or over is None:
        fail(f"--sweep takes rate:R1,R2,... or concurrency:C1,C2,..., got {text!r}")
    parts = [v.strip() for v in values.split(",") if v.strip()]
    if len(parts) < 2:
        fail(f"--sweep needs two values or more, got {text!r}")
    if over == "request_rate":
        return over, tuple(sorted(rate(v, "--sweep") for v in parts))
    try:
        counts = sorted(int(v) for v in parts)
    except ValueError:
        fail(f"--sweep concurrency takes whole numbers, got {values!r}")
    if counts[0] < 1:
        fail(f"--sweep concurrency must be at least 1, got {counts[0]}")
    return over, tuple(float(c) for c in counts)
