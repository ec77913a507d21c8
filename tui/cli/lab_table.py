"""Rich tables for `llmchat lab batching` (the engine returns plain data)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from tui.cli.report import figures_table, print_figures, report_console
from tui.fmt import plain_text
from tui.plot import text_plot


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}M"


def pool_line(result: dict) -> Text:
    """The model and its pool; the model's name comes from its files or argv: text, never markup."""
    pool = result["pool"]
    return Text.assemble(
        plain_text(result["model"], one_line=True, style="bold"),
        f" at {result['precision']}: pool of {pool['blocks']} blocks x "
        f"{pool['block_size']} tokens = {pool['tensor_bytes'] / 2**20:.1f} MiB in its tensors "
        f"(formula: {pool['formula']}; x {pool['blocks']} = {pool['formula_bytes'] / 2**20:.1f} MiB)",
    )


def print_lab(result: dict) -> None:
    """The pool, the workload, the policies compared, then the batch sweep where the budget held one."""
    console = report_console()
    console.print(pool_line(result))
    console.print(_workload_line(result))
    print_figures(console, _policies(result["policies"]))
    agree = "the same tokens" if result["outputs_agree"] else "DIFFERENT tokens (numerics at a near tie)"
    console.print(f"greedy answers: every policy produced {agree} for every request")
    if not result["sweep"]:
        console.print("sweep: the budget holds no batch (raise --budget-mib)")
        return
    print_figures(console, _sweep(result["sweep"]))
    _print_sweep_findings(console, result)
    _print_sweep_plot(console, result["sweep"])


def _workload_line(result: dict) -> str:
    """The requests, how they arrive, their prompt and answer lengths: what every policy served."""
    w = result["workload"]
    return (
        f"workload: {w['requests']} requests, arrivals {w['arrivals']}"
        + (f" at {w['rate_per_s']}/s" if w["rate_per_s"] else "")
        + f", prompts {min(w['prompt_tokens'])}-{max(w['prompt_tokens'])} tokens, up to "
        f"{w['max_new_tokens']} new each, seed {w['seed']}; max batch {result['max_batch']}"
    )


def _table(title: str, columns: tuple[str, ...]) -> Table:
    return figures_table(title, columns)


POLICIES_TITLE = "Three policies, same workload (times in ms; peak KV bytes: paged vs contiguous)"
POLICIES_COLUMNS = (
    "policy", "tok/s", "TTFT p50", "TTFT p90", "ITL p50", "ITL p90",
    "blocks", "paged", "contig.", "preempt",
)  # fmt: skip


def _policies(policies: list[dict]) -> Table:
    table = _table(POLICIES_TITLE, POLICIES_COLUMNS)
    for p in policies:
        table.add_row(p["policy"], *_policy_times(p), *_policy_memory(p))
    return table


def _policy_times(p: dict) -> tuple[str, ...]:
    return (
        f"{p['throughput_tok_s']:.1f}",
        f"{p['ttft_ms_p50']:.0f}",
        f"{p['ttft_ms_p90']:.0f}",
        f"{p['itl_ms_p50']:.1f}",
        f"{p['itl_ms_p90']:.1f}",
    )


def _policy_memory(p: dict) -> tuple[str, ...]:
    return (
        str(p["peak_blocks"]),
        _mib(p["peak_paged_bytes"]),
        _mib(p["peak_contiguous_bytes"]),
        str(p["preemptions"]),
    )


SWEEP_COLUMNS = ("B", "aggregate tok/s", "x B=1", "ITL p50 ms", "FLOP/byte", "machine")


def _sweep(sweep: list[dict]) -> Table:
    """Each B's aggregate rate, also as a multiple of B = 1's: batching for free would give B."""
    table = _table("Decode sweep: B sequences, one step each token", SWEEP_COLUMNS)
    first = sweep[0]["aggregate_tok_s"]
    for s in sweep:
        table.add_row(
            str(s["batch"]),
            f"{s['aggregate_tok_s']:.1f}",
            f"{s['aggregate_tok_s'] / first:.2f}",
            f"{s['itl_ms_p50']:.1f}",
            f"{s['intensity_flop_per_byte']:.1f}",
            "busy" if s["busy"] else "",
        )
    return table


def _print_sweep_findings(console: Console, result: dict) -> None:
    """Where the machine's balance point is, where the curve bends, and which B did not fit."""
    balance = result["balance_flop_per_byte"]
    if balance is not None:
        console.print(f"balance point: {balance:.1f} FLOP/byte (below it, a step waits on memory)")
    bends = result["sweep_bends_at"]
    console.print(
        f"the curve bends at B = {bends} (from there, doubling B gains less than 1.7x)"
        if bends
        else "the curve does not bend over these B (each doubling gains 1.7x or more)"
    )
    if result["sweep_dips"]:
        console.print(
            f"the aggregate fell at B = {result['sweep_dips']} (by the bend): the machine, not"
            " batching (busy or a slower path); run it again"
        )
    if result["sweep_skipped"]:
        console.print(f"left out (the budget cannot hold them): B = {result['sweep_skipped']}")


def _print_sweep_plot(console: Console, sweep: list[dict]) -> None:
    """The measured rates against B x the B=1 rate, the line they would follow with no cost to batching."""
    xs = [s["batch"] for s in sweep]
    ys = [s["aggregate_tok_s"] for s in sweep]
    first = sweep[0]["aggregate_tok_s"]
    console.print("aggregate tok/s (● measured, ○ B x the B=1 rate)", markup=False)
    for line in text_plot(xs, ys, reference=[first * x for x in xs], unit="tok/s"):
        console.print(line, markup=False, highlight=False)
