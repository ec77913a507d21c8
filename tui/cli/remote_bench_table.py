"""Rich tables for `llmchat bench --server` (engine/remote/bench.py returns plain data)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from tui.fmt import plain_text


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def print_remote_tables(result: dict) -> None:
    console = Console()
    console.print(server_line(result))
    if not result["forces_length"]:
        console.print("  (this server takes no ignore_eos: answers may end before the asked length)")
    console.print(_prefill(result["prefill"]))
    console.print(_decode(result["decode"]))
    console.print(_turns(result["turns"]))
    console.print(_streams(result["concurrency"]))
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
    table = Table(title="Prefill, fresh prompts: client TTFT beside the server's own prompt time")
    for column in ("prompt tokens", "TTFT ms", "prefill tok/s", "server prompt ms", "server tok/s"):
        table.add_column(column, justify="right")
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
    table = Table(title="Decode, one long answer")
    for column in ("tokens", "tok/s", "ITL p50 ms", "ITL p90 ms", "server ITL ms"):
        table.add_column(column, justify="right")
    table.add_row(
        str(row["tokens"]),
        _rate(row["tok_s"]),
        _ms(row["itl_ms_p50"]),
        _ms(row["itl_ms_p90"]),
        _ms(row["server_itl_ms"]),
    )
    return table


def _turns(row: dict) -> Table:
    table = Table(title="Last turn: its history in the server's prefix cache vs the same prompt fresh")
    for column in ("turn", "prompt", "reused", "TTFT cached ms", "TTFT fresh ms", "speed-up"):
        table.add_column(column, justify="right")
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
    table = Table(title="Concurrent streams: batching keeps each stream's ITL while the total grows")
    for column in ("streams", "tokens", "wall s", "total tok/s", "TTFT mean ms", "ITL p50 ms", "ITL p90 ms"):
        table.add_column(column, justify="right")
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
