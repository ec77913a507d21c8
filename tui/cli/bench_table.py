"""Rich tables for `llmchat bench` (the engine returns plain data)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from tui.cli.report import figures_table, print_figures, report_console
from tui.fmt import plain_text


def _mb(n: int) -> str:
    return f"{n / 2**20:,.0f}M"


def print_tables(result: dict) -> None:
    """Every table the run has figures for."""
    console = report_console()
    results = result["results"]
    console.print(*_heading(result))
    print_figures(console, _decode(results))
    _print_decode_notes(console, results)
    if any(r["fraction_of_bound"] > 1 for r in results):
        console.print(ABOVE_BOUND)
    print_figures(console, _prefill(results))
    print_figures(console, _multi_turn(results))
    _print_optional_tables(console, result)


def _print_optional_tables(console: Console, result: dict) -> None:
    """The measurements a run may skip, each shown when some precision has it."""
    results = result["results"]
    if any(r["quality"] for r in results):
        print_figures(console, _quality(results))
    if any(r["long_context"] for r in results):
        print_figures(console, _long_context(results))
    if any(r.get("speculative") for r in results):
        print_figures(console, _speculative(results))
        console.print(plain_text(speculative_identity(results)))
    if any(r.get("kv_cache") for r in results):
        print_kv_cache_table(console, result)


def _table(title: str | Text, columns: tuple[str, ...]) -> Table:
    return figures_table(title, columns)


def _heading(result: dict) -> tuple[Text, str]:
    """The model's name comes from its files or the command line: text, not markup."""
    title = f"{result['model']} on {result['device']}" + (
        " (random weights)" if result["random_weights"] else ""
    )
    return (
        plain_text(title, one_line=True, style="bold"),
        f" memory bandwidth {result['bandwidth_gb_s']} GB/s, {result['torch_threads']} threads",
    )


DECODE_COLUMNS = (
    "prec", "ours", "step alone", "eager", "generate", "ratio", "vs fp32 gen",
    "ITL p50 ms", "ITL p90 ms", "bound", "of bound", "weights", "peak RSS",
)  # fmt: skip


def _decode(results: list[dict]) -> Table:
    table = _table("Decode tok/s: our instrumented loop vs transformers generate (same run)", DECODE_COLUMNS)
    for r in results:
        table.add_row(r["precision"], *_decode_speeds(r), *_decode_bound_and_memory(r))
    return table


def _decode_speeds(r: dict) -> tuple[str, ...]:
    return (
        f"{r['decode']['tok_s']:.1f}",
        f"{r['decode_step']['tok_s']:.1f}",
        f"{r['decode_eager']['tok_s']:.1f}" if r["compiled"].get("compiled") else "-",
        f"{r['generate']['tok_s']:.1f}",
        f"{r['decode_vs_generate']:.2f}x",
        f"{r['decode_vs_fp32_generate']:.2f}x" if r["decode_vs_fp32_generate"] else "-",
        f"{r['decode']['itl_ms_p50']:.1f}",
        f"{r['decode']['itl_ms_p90']:.1f}",
    )


def _decode_bound_and_memory(r: dict) -> tuple[str, ...]:
    """The bandwidth bound and how near it came; a peak marked * covers more than this precision."""
    return (
        f"{r['bandwidth_bound_tok_s']:.0f}",
        f"{r['fraction_of_bound']:.0%}",
        _mb(r["weight_bytes"]),
        _mb(r["peak_memory_bytes"]) + ("*" if r["peak_memory_scope"] != "this precision" else ""),
    )


ABOVE_BOUND = (
    "  of bound over 100%: the step read part of its bytes from the CPU's caches, which are faster "
    "than memory, or the bandwidth read ran slow (a busy machine)"
)


def _print_decode_notes(console: Console, results: list[dict]) -> None:
    """What 'step alone' and a * mean, and how each precision's decode step was compiled."""
    console.print("  step alone: nothing sampled, no events (what llama-bench times)")
    if any(r["peak_memory_scope"] != "this precision" for r in results):
        console.print("  * peak RSS of the run so far: this system cannot reset the peak between precisions")
    for r in results:
        if r["compiled"]:
            console.print(f"  {r['precision']}: {r['compiled']['note']}")


def _prefill(results: list[dict]) -> Table:
    table = _table("Prefill (fresh cache)", ("precision", "prompt tokens", "TTFT ms", "prefill tok/s"))
    for r in results:
        for row in r["prefill"]:
            table.add_row(
                r["precision"],
                str(row["prompt_tokens"]),
                f"{row['ttft_ms']:.1f}",
                f"{row['prefill_tok_s']:.0f}",
            )
    return table


MULTI_TURN_COLUMNS = ("precision", "turn", "prompt", "reused", "TTFT reused ms", "TTFT fresh ms", "speed-up")


def _multi_turn(results: list[dict]) -> Table:
    table = _table("Multi-turn: last turn's TTFT, cache reused vs fresh prefill", MULTI_TURN_COLUMNS)
    for r in results:
        m = r["multi_turn"]
        table.add_row(
            r["precision"],
            str(m["turn"]),
            str(m["prompt_tokens"]),
            str(m["reused_tokens"]),
            f"{m['ttft_ms_reused']:.1f}",
            f"{m['ttft_ms_fresh']:.1f}",
            f"{m['speedup']:.1f}x",
        )
    return table


QUALITY_TITLE = "What each precision does to the next-token distribution, against fp32 (teacher-forced)"
QUALITY_COLUMNS = ("precision", "steps", "top-1 agreement", "mean KL nats", "max KL nats")


def _quality(results: list[dict]) -> Table:
    table = _table(QUALITY_TITLE, QUALITY_COLUMNS)
    for r in results:
        if q := r["quality"]:
            table.add_row(
                r["precision"],
                str(q["steps"]),
                f"{q['top1_agreement']:.1%}",
                f"{q['mean_kl_nats']:.4f}",
                f"{q['max_kl_nats']:.3f}",
            )
    return table


LONG_CONTEXT_TITLE = "ITL against context length: measured vs predicted by bytes read per token"
LONG_CONTEXT_COLUMNS = (
    "precision", "ITL short ms", "ITL long ms", "context", "measured ratio", "predicted ratio",
)  # fmt: skip


def _long_context(results: list[dict]) -> Table:
    table = _table(LONG_CONTEXT_TITLE, LONG_CONTEXT_COLUMNS)
    for r in results:
        if c := r["long_context"]:
            table.add_row(
                r["precision"],
                f"{c['itl_ms_short']:.1f}",
                f"{c['itl_ms_long']:.1f}",
                f"{c['context_short']}→{c['context_long']}",
                f"{c['measured_ratio']:.2f}",
                f"{c['predicted_ratio']:.2f}",
            )
    return table


SPECULATIVE_COLUMNS = (
    "precision", "prompt", "tok/s", "plain tok/s", "speed-up", "acceptance",
    "tokens/forward", "draft ms/round", "verify ms/round", "plain step ms",
)  # fmt: skip


def _speculative(results: list[dict]) -> Table:
    """Overall and per prompt; the title, which names the first drafter, is text, not markup."""
    first = next(r["speculative"] for r in results if r.get("speculative"))
    plain = f" (the {first['plain_step_path']} step)" if first.get("plain_step_path") else ""
    title = (
        f"Speculative ({first['drafter']}, K={first['draft_tokens']}) vs plain decoding{plain}: "
        "same prompts, same run, greedy"
    )
    table = _table(plain_text(title), SPECULATIVE_COLUMNS)
    for r in results:
        if s := r.get("speculative"):
            for name, row in [("all", s), *s["prompts"].items()]:
                table.add_row(r["precision"], name, *_speculative_cells(row))
    return table


def speculative_identity(results: list[dict]) -> str:
    """Whether each precision's speculative answers were the plain ones, as greedy decoding must
    give them (the table's speed-ups mean nothing otherwise)."""
    lines = []
    for r in results:
        if s := r.get("speculative"):
            said = (
                "every speculative answer equals the plain one"
                if s["identical"]
                else "speculative answers DIFFER from the plain ones: greedy decoding must not (a bug)"
            )
            lines.append(f"  {r['precision']}: {said}")
    return "\n".join(lines)


def _speculative_cells(row: dict) -> tuple[str, ...]:
    return (
        f"{row['tok_s']:.1f}",
        f"{row['plain_tok_s']:.1f}",
        f"{row['speedup']:.2f}x",
        f"{row['acceptance']:.0%}",
        f"{row['tokens_per_forward']:.2f}",
        f"{row['draft_ms_per_round']:.1f}",
        f"{row['verify_ms_per_round']:.1f}",
        f"{row['plain_step_ms']:.1f}",
    )


def print_kv_cache_table(console, result: dict) -> None:
    """Decode at long context with each KV cache precision: bytes, ITL and quality against fp32's."""
    first = next(r["kv_cache"] for r in result["results"] if r.get("kv_cache"))
    some = next(iter(first.values()))
    table = figures_table(
        f"KV cache precision at {some['context']:,} tokens of context, same run "
        f"(attention: {some['attention']})",
        (
            "precision",
            "KV cache",
            "step",
            "B/token",
            "KV read/step",
            "all read/step",
            "ITL p50 ms",
            "ITL p90 ms",
            "ITL min ms",
            "vs fp32 cache",
            "attention ms",
            "top-1 agree",
            "mean KL",
        ),
    )
    for r in result["results"]:
        caches = r.get("kv_cache") or {}
        base = caches.get("fp32", {}).get("itl_ms_long")
        for name, row in caches.items():
            quality = row.get("quality", {})
            table.add_row(
                r["precision"],
                name,
                row["step"],
                f"{row['bytes_per_token']:,}",
                f"{row['kv_bytes_read_per_step'] / 1e6:.1f} MB",
                f"{row['bytes_read_per_step'] / 1e6:.1f} MB",
                f"{row['itl_ms_long']:.1f}",
                f"{row['itl_ms_p90']:.1f}",
                f"{row['itl_ms_min']:.1f}",
                f"{row['itl_ms_long'] / base:.2f}x" if base else "–",
                f"{row['attention_ms']:.1f}",
                f"{quality['top1_agreement']:.1%}" if quality else "–",
                f"{quality['mean_kl_nats']:.5f}" if quality else "–",
            )
    print_figures(console, table)
