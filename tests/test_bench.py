"""`llmchat bench` in one run: ours vs generate, ratios to fp32 generate, quality against fp32."""

import pytest
import torch

from engine import bench
from engine.quant import int8


@pytest.mark.skipif(int8.available() is not None, reason="no fbgemm in this torch")
def test_bench_reports_ratios_and_quality_for_each_precision(tiny_model_dir):
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
    result = bench.run(config, report=lines.append)
    fp32, w8a8 = result["results"]
    assert (fp32["precision"], w8a8["precision"]) == ("fp32", "w8a8")  # fp32 first: the reference
    assert result["bandwidth_gb_s"] > 0 and any("bandwidth" in line for line in lines)
    for r in (fp32, w8a8):
        assert r["decode"]["tok_s"] > 0 and r["generate"]["tok_s"] > 0
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


def test_each_precision_reports_its_own_memory_peak():
    # Start from this moment's RSS: an earlier test's higher peak would otherwise hide `big`.
    bench.reset_peak_memory("cpu")
    big = torch.ones(128 * 2**20 // 4)  # 128 MiB, touched, then handed back to the OS
    with_big = bench.peak_memory_bytes("cpu")
    del big
    bench.reset_peak_memory("cpu")
    assert bench.peak_memory_bytes("cpu") < with_big - 64 * 2**20
