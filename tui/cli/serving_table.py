"""The serving benchmark's report (engine/remote/serving.py returns plain data): the figures
`vllm bench serve` prints, in its words, a latency table, the server's own figures beside ours,
and for a sweep a table of its points and the throughput-latency curve."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from engine.serving_metrics import percentile_word
from tui.cli.report import figures_table, latency_table, print_figures, report_console
from tui.fmt import plain_text
from tui.plot import Series, text_plot

SERVER_MEANS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL"), ("queue", "queue"))
"""The latencies a server's /metrics may give means of, beside ours."""
PLOT_WIDTH = 76
PLOT_HEIGHT = 16


def print_serving(result: dict) -> None:
    console = report_console()
    console.print(_header(result))
    if "sweep" in result:
        _print_sweep(console, result)
    else:
        _print_run(console, result)


def _header(result: dict) -> Text:
    """Which server and model: the server's own words, as text, never markup."""
    parts = [f"{result['backend']} {result['server_version'] or ''}", f"model {result['model_id']}"]
    if result.get("server_parallelism"):
        parts.append(result["server_parallelism"])
    return plain_text(" · ".join(parts), one_line=True, style="bold")


def _print_run(console: Console, result: dict) -> None:
    print_figures(console, _totals(result))
    print_figures(console, latency_table("Latency", [("", result)], result["percentiles"]))
    for line in _server_lines(result):
        console.print(line)
    for reason, count in result["failed_reasons"].items():
        console.print(plain_text(f"  failed {count}x: {reason}", one_line=True))


def _load(result: dict) -> str:
    concurrency = result["max_concurrency"]
    return (
        f"rate {result['request_rate']} req/s, burstiness {result['burstiness']:g}, "
        f"concurrency {'no cap' if concurrency is None else concurrency}"
    )


def _totals(result: dict) -> Table:
    table = figures_table(
        f"Serving benchmark: {result['num_prompts']} requests, {_load(result)}", ("", "value")
    )
    table.columns[0].justify = "left"
    rows = [
        ("Successful requests", str(result["completed"])),
        ("Failed requests", str(result["failed"])),
        ("Benchmark duration (s)", _f(result["duration"], 2)),
        ("Total input tokens", str(result["total_input_tokens"])),
        ("Total generated tokens", str(result["total_output_tokens"])),
        ("Request throughput (req/s)", _f(result["request_throughput"], 2)),
        ("Output token throughput (tok/s)", _f(result["output_throughput"], 2)),
        ("Total token throughput (tok/s)", _f(result["total_token_throughput"], 2)),
        ("Peak output throughput (tok/s)", _f(result["max_output_tokens_per_s"], 0)),
        ("Peak concurrent requests", str(result["max_concurrent_requests"] or "-")),
    ]
    if result["goodput_slo_ms"]:
        slo = ", ".join(f"{k.upper()} ≤ {v:g} ms" for k, v in result["goodput_slo_ms"].items())
        rows.insert(6, (f"Request goodput (req/s), {slo}", _f(result["request_goodput"], 2)))
        rows.insert(7, ("Good requests", str(result["good_completed"])))
    for row in rows:
        table.add_row(*row)
    return table


def _server_lines(result: dict) -> list[str]:
    """The server's own figures beside ours: they differ by the network and the queue."""
    server = result["server_reported"]
    lines = []
    if server["mean_tpot_ms"] is not None and result["mean_tpot_ms"] is not None:
        lines.append(
            f"  server's own timings: TPOT {server['mean_tpot_ms']:.1f} ms mean "
            f"(ours {result['mean_tpot_ms']:.1f}: {server['tpot_ours_over_server']:.2f}x)"
        )
    if server["mean_prompt_ms"] is not None and result["mean_ttft_ms"] is not None:
        lines.append(
            f"  server's own prompt time {server['mean_prompt_ms']:.0f} ms mean "
            f"(our TTFT {result['mean_ttft_ms']:.0f}: {server['ttft_ours_over_server']:.2f}x; "
            "ours adds the network and the wait for a slot)"
        )
    if server["generation_tokens"] is not None:
        lines.append(
            f"  server's /metrics: {server['generation_tokens']:.0f} tokens generated "
            f"(ours {result['total_output_tokens']}), {server['prompt_tokens']:.0f} prompt tokens computed "
            f"(ours {result['total_input_tokens']}, some from its prefix cache)"
        )
    means = [
        f"{name} {server[f'metrics_mean_{key}_ms']:.1f} ms"
        + (f" (ours {result[f'mean_{key}_ms']:.1f})" if result.get(f"mean_{key}_ms") is not None else "")
        for key, name in SERVER_MEANS
        if server[f"metrics_mean_{key}_ms"] is not None
    ]
    if means:
        lines.append(f"  server's /metrics, means over the run: {', '.join(means)}")
    return lines or ["  the server reports no timings or counters of its own"]


def _print_sweep(console: Console, result: dict) -> None:
    over = result["sweep"]["over"]
    runs = result["sweep"]["results"]
    words = [percentile_word(p) for p in runs[0]["percentiles"]]
    top = words[-1]
    table = figures_table(
        f"Sweep over {_over_name(over)}: {runs[0]['num_prompts']} requests a point",
        (
            _over_name(over),
            "req/s",
            "out tok/s",
            "TTFT median ms",
            f"TTFT p{top} ms",
            "TPOT median ms",
            "E2EL median ms",
            "failed",
        ),
    )
    for value, run in zip(result["sweep"]["values"], runs):
        table.add_row(
            str(value),
            _f(run["request_throughput"], 2),
            _f(run["output_throughput"], 1),
            _f(run["median_ttft_ms"], 0),
            _f(run[f"p{top}_ttft_ms"], 0),
            _f(run["median_tpot_ms"], 1),
            _f(run["median_e2el_ms"], 0),
            str(run["failed"]),
        )
    print_figures(console, table)
    console.print(_saturation_line(result["saturation"]))
    for line in throughput_latency_plot(runs, f"p{top}_ttft_ms", f"TTFT p{top} (ms)"):
        console.print(line, markup=False, highlight=False)


def _over_name(over: str) -> str:
    return "request rate" if over == "request_rate" else "concurrency"


def _saturation_line(saturation: dict) -> str:
    best = saturation["best_request_throughput"]
    if saturation["at"] is None:
        return f"  not saturated: request throughput still rose at the last point ({best:.2f} req/s)"
    return (
        f"  saturated from {_over_name(saturation['over'])} {saturation['at']}: "
        f"{saturation['request_throughput']:.2f} req/s, within 10% of the best ({best:.2f}); "
        "more load adds queueing, not answers"
    )


def throughput_latency_plot(runs: list[dict], latency_key: str, latency_name: str) -> list[str]:
    """A latency (y) against request throughput (x), one point a sweep run."""
    xs = [run["request_throughput"] or 0.0 for run in runs]
    ys = [run[latency_key] or 0.0 for run in runs]
    return text_plot(
        xs,
        [Series(latency_name, ys)],
        PLOT_WIDTH,
        PLOT_HEIGHT,
        x_label="request throughput (req/s)",
        title=f"{latency_name} against request throughput",
    )


def _f(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"
