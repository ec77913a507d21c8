"""Rich tables for `llmchat bench --server` (engine/remote/bench.py returns plain data)."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from tui.cli.report import figures_table, print_figures, report_console
from tui.fmt import plain_text


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def print_remote_tables(result: dict) -> None:
    console = report_console()
    console.print(server_line(result))
    if not result["forces_length"]:
        console.print("  (this server takes no ignore_eos: answers may end before the asked length)")
    print_figures(console, _prefill(result["prefill"]))
    print_figures(console, _decode(result["decode"]))
    print_figures(console, _turns(result["turns"]))
    print_figures(console, _streams(result["concurrency"]))
    console.print("  '-': the server does not report it. Ours minus the server's = network and queueing.")


def server_line(result: dict) -> Text:
    """Which server and model: the server's own words (build, model name) as text, never markup."""
    server = result["server"]
    rest = f" at {server['url']} · model {result['model']}" + (
        f" · {server['parallelism']}" if server["parallelism"] else ""
    )
    return Text.assemble(
        plain_text(f"{server['kind']} {server['version'] or ''}", one_line=True, style="bold"),
        plain_text(rest, one_line=True),
        f" · context {result['context']:,}" if result["context"] else "",
    )


def _prefill(rows: list[dict]) -> Table:
    table = figures_table(
        "Prefill, fresh prompts: client TTFT beside the server's own prompt time",
        ("prompt tokens", "TTFT ms", "prefill tok/s", "server prompt ms", "server tok/s"),
    )
    for row in rows:
        table.add_row(
            str(row["prompt_tokens"]),
            _ms(row["ttft_ms"]),
            _rate(row["prefill_tok_s"]),
            _ms(row["server_prompt_ms"]),
            _rate(row["server_prefill_tok_s"]),
        )
    return table


def _decode(row: dict) -> Table:
    table = figures_table(
        "Decode, one long answer", ("tokens", "tok/s", "ITL p50 ms", "ITL p90 ms", "server ITL ms")
    )
    table.add_row(
        str(row["tokens"]),
        _rate(row["tok_s"]),
        _ms(row["itl_ms_p50"]),
        _ms(row["itl_ms_p90"]),
        _ms(row["server_itl_ms"]),
    )
    return table


def _turns(row: dict) -> Table:
    table = figures_table(
        "Last turn: its history in the server's prefix cache vs the same prompt fresh",
        ("turn", "prompt", "reused", "TTFT cached ms", "TTFT fresh ms", "speed-up"),
    )
    table.add_row(
        str(row["turn"]),
        str(row["prompt_tokens"]),
        "-" if row["reused_tokens"] is None else str(row["reused_tokens"]),
        _ms(row["ttft_ms_reused"]),
        _ms(row["ttft_ms_fresh"]),
        "-" if row["speedup"] is None else f"{row['speedup']:.1f}x",
    )
    return table


def _streams(rows: list[dict]) -> Table:
    table = figures_table(
        "Concurrent streams: batching keeps each stream's ITL while the total grows",
        ("streams", "tokens", "wall s", "total tok/s", "TTFT mean ms", "ITL p50 ms", "ITL p90 ms"),
    )
    for row in rows:
        table.add_row(
            str(row["streams"]),
            str(row["tokens"]),
            f"{row['wall_s']:.2f}",
            _rate(row["aggregate_tok_s"]),
            _ms(row["ttft_ms_mean"]),
            _ms(row["itl_ms_p50"]),
            _ms(row["itl_ms_p90"]),
        )
    return table
