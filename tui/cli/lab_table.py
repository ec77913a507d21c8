"""Rich tables for `llmchat lab batching` (the engine returns plain data)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from tui.cli.report import figures_table, latency_table, print_figures, report_console
from tui.fmt import plain_text
from tui.plot import batching_plot


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
    print_policies(console, result)
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
        + f", prompts {min(w['prompt_tokens'])}-{max(w['prompt_tokens'])} tokens, answers "
        f"{w['min_new_tokens']}-{w['max_new_tokens']} tokens, seed {w['seed']}; "
        f"max batch {result['max_batch']}"
    )


def _table(title: str, columns: tuple[str, ...]) -> Table:
    return figures_table(title, columns)


def _f1(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _f2(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def print_policies(console: Console, result: dict) -> None:
    """The three policies as a client of a server would measure them (`llmchat bench --server`'s
    figures, vLLM's definitions), then what each held in the pool."""
    policies = result["policies"]
    slo = result.get("goodput_slo_ms")
    print_figures(console, _throughput(policies, with_goodput=slo is not None))
    console.print(pace_line(result))
    if busy := [p["policy"] for p in policies if p["busy"]]:
        console.print(f"busy machine while {', '.join(busy)} ran: figures slowed; run again")
    if slo:
        limits = ", ".join(f"{key.upper()} ≤ {limit:g} ms" for key, limit in slo.items())
        console.print(f"goodput: the requests per second that met {limits}")
    runs = [(p["policy"], p["serving"]) for p in policies]
    print_figures(console, latency_table(LATENCY_TITLE, runs, result.get("percentiles", [50, 90, 99])))
    print_figures(console, _memory(policies))


THROUGHPUT_TITLE = "Three policies, same workload: requests served (each sent at its arrival)"


def _throughput(policies: list[dict], with_goodput: bool) -> Table:
    columns = ["policy", "done", "duration s", "req/s", "output tok/s", "total tok/s"]
    goodput_column = ["goodput req/s"] if with_goodput else []
    table = _table(THROUGHPUT_TITLE, (*columns, *goodput_column, "max in flight"))
    for p in policies:
        s = p["serving"]
        goodput = [_f2(s["request_goodput"])] if with_goodput else []
        table.add_row(
            p["policy"],
            str(s["completed"]),
            f"{s['duration']:.2f}",
            _f2(s["request_throughput"]),
            _f1(s["output_throughput"]),
            _f1(s["total_token_throughput"]),
            *goodput,
            str(s["max_concurrent_requests"] or 0),
        )
    return table


def pace_line(result: dict) -> str:
    """Whether the arrivals or the engine set the pace (engine/lab/verdict.py), and where the
    arrivals did, the flag that compares the policies; one line within 80 columns."""
    return result["pace"] + ("; try --saturate" if result["arrival_bound"] else "")


LATENCY_TITLE = (
    "Latency in ms: TTFT arrival to first token, TPOT per token after it, ITL each gap, E2EL arrival to last"
)


MEMORY_TITLE = "Peak KV: blocks, bytes paged vs a contiguous reservation per request, preemptions"
MEMORY_COLUMNS = ("policy", "blocks", "paged", "contig.", "preempt")


def _memory(policies: list[dict]) -> Table:
    table = _table(MEMORY_TITLE, MEMORY_COLUMNS)
    for p in policies:
        table.add_row(
            p["policy"],
            str(p["peak_blocks"]),
            _mib(p["peak_paged_bytes"]),
            _mib(p["peak_contiguous_bytes"]),
            str(p["preemptions"]),
        )
    return table


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
    for line in batching_plot(xs, ys, [first * x for x in xs]):
        console.print(line, markup=False, highlight=False)
