"""`llmchat bench` in one run: ours vs generate, ratios to fp32 generate, quality against fp32."""

import mmap

import pytest

from engine import bench, models
from engine.quant import int8
from tui.cli.bench_table import print_tables


@pytest.mark.skipif(int8.available() is not None, reason="no fbgemm in this torch")
def test_bench_reports_ratios_and_quality_for_each_precision(tiny_model_dir, capsys):
    config = bench.BenchConfig(
        model=str(tiny_model_dir),
        precisions=("w8a8", "fp32"),
        device="cpu",
        prompt_lengths=(8, 16),
        decode_tokens=6,
        repeats=1,
        turns=2,
        compile=True,
    )
    lines: list[str] = []
    peak_is_own = bench.reset_peak_memory("cpu")  # whether this system can start a new peak
    result = bench.run(config, report=lines.append)
    fp32, w8a8 = result["results"]
    assert (fp32["precision"], w8a8["precision"]) == ("fp32", "w8a8")  # fp32 first: the reference
    assert result["bandwidth_gb_s"] > 0 and any("bandwidth" in line for line in lines)
    for r in (fp32, w8a8):
        assert r["decode"]["tok_s"] > 0 and r["generate"]["tok_s"] > 0
        assert r["decode_step"]["tok_s"] > 0 and r["decode_step"]["tokens"] == 6  # the step alone
        assert r["decode_vs_generate"] == pytest.approx(
            r["decode"]["tok_s"] / r["generate"]["tok_s"], rel=0.01, abs=5e-4
        )  # the ratios are rounded to 3 decimals
        assert r["decode_vs_fp32_generate"] == pytest.approx(
            r["decode"]["tok_s"] / fp32["generate"]["tok_s"], rel=0.01, abs=5e-4
        )
        assert [row["prompt_tokens"] for row in r["prefill"]] == [8, 16]
        # The CPU share the decode runs got, said beside them (busy or not: the machine decides).
        assert 0 < r["contention"]["cpu_share"] <= 1 and isinstance(r["contention"]["busy"], bool)
        assert any(line.startswith(f"[{r['precision']}] decode measured at") for line in lines)
        assert r["multi_turn"]["reused_tokens"] > 0
    assert fp32["quality"] == {}  # the reference is not compared with itself
    assert (
        fp32["compiled"]["compiled"] and fp32["decode_eager"]["tok_s"] > 0
    )  # the compiled step was measured too
    assert w8a8["compiled"] == {"compiled": False, "note": "w8a8's fbgemm weights are opaque to the compiler"}
    quality = w8a8["quality"]
    assert quality["steps"] > 0 and 0.0 <= quality["top1_agreement"] <= 1.0 and quality["mean_kl_nats"] >= 0.0
    assert w8a8["weight_bytes"] < fp32["weight_bytes"]
    # A step reads the whole LM head but one row of the embedding table. The tiny model's table
    # is not its head (untied), at fp32 as at w8a8 (fp32 table, int8 head): both leave it out
    # of the bytes the bound and the long-context prediction are made of.
    unread = [r["weight_bytes"] - r["read_bytes_per_token"] for r in (fp32, w8a8)]
    assert unread[0] == unread[1] > 0

    # Each peak is the precision's own where the system can reset it, and says so where it cannot.
    scope = "this precision" if peak_is_own else "the run so far"
    assert [r["peak_memory_scope"] for r in (fp32, w8a8)] == [scope, scope]
    print_tables(result)
    out = capsys.readouterr().out
    assert "step alone: nothing sampled, no events (what llama-bench times)" in out
    footnote = "peak RSS of the run so far: this system cannot reset the peak"
    assert (footnote in out) == (not peak_is_own)


def test_the_step_alone_feeds_one_token_per_step_after_the_prompt(tiny_model_dir):
    loaded = models.load(str(tiny_model_dir), "fp32", "cpu")
    prefill_s, steps = bench.measure_step(loaded, [5, 6, 7, 8], 5)
    assert prefill_s > 0 and len(steps) == 4 and all(s > 0 for s in steps)  # the first step is warm-up


def test_a_reset_peak_is_reported_only_where_it_took():
    size = 128 * 2**20
    bench.reset_peak_memory("cpu")
    region = mmap.mmap(-1, size)  # unmapped on close: no allocator can keep it
    for offset in range(0, size, mmap.PAGESIZE):
        region[offset] = 1
    with_big = bench.peak_memory_bytes("cpu")
    region.close()
    if bench.reset_peak_memory("cpu"):
        assert bench.peak_memory_bytes("cpu") < with_big - 64 * 2**20
    else:  # the system kept its peak (CI's sandbox does): the bench must not claim a fresh one
        assert bench.peak_memory_bytes("cpu") >= with_big


def test_each_kv_cache_precision_is_timed_on_a_compiled_step_of_its_own(tiny_model_dir):
    loaded = models.load(str(tiny_model_dir), "fp32", "cpu")
    result = bench.bench_kv_cache(loaded, ("fp32", "bf16", "int8"), 40, 1000, 4, 1, compile=True)
    steps = {precision: row["step"] for precision, row in result.items()}
    assert steps == {"fp32": "compiled step", "bf16": "compiled step", "int8": "compiled step"}
    assert result["bf16"]["bytes_per_token"] * 2 == result["fp32"]["bytes_per_token"]
    assert all(row["itl_ms_long"] > 0 for row in result.values())
