"""`llmchat bench --server URL --num-prompts N ...`: the serving benchmark against the real llama.cpp
server with one and two slots (engine/remote/serving.py, tui/cli/serving.py)."""

from __future__ import annotations

import io
import json
import math
import threading
import time

import pytest
from typer.testing import CliRunner

from engine.remote.serving import ServingBench, ServingConfig
from engine.remote.target import RemoteTarget
from engine.serving_metrics import METRICS, parse_goodput

PERCENTILES = (50.0, 90.0, 99.0)


def bench(*args: str):
    from tui.cli import app

    return CliRunner().invoke(app, ["bench", *args])


def one_result(output: str) -> dict:
    return json.loads(output[output.index("{") :])


def test_a_rate_sweep_rises_until_the_two_slots_saturate(two_slot_llama_server):
    """Arrival-bound at a third of what the server answers a second, its own limit at four times
    that and at once. The rates are set from its measured limit: a Zen 1 answered ~1 request a
    second, so a sweep at 1 and 4 a second was the limit twice."""
    limit = bench(
        "--server", two_slot_llama_server.url, "--num-prompts", "8", "--output-len", "16",
        "--request-rate", "inf", "--json",
    )  # fmt: skip
    assert limit.exit_code == 0, limit.output
    capacity = one_result(limit.stdout)["request_throughput"]
    low, high = round(capacity / 3, 2), round(capacity * 4, 2)
    result = bench(
        "--server", two_slot_llama_server.url, "--num-prompts", "8", "--output-len", "16",
        "--sweep", f"rate:{low},{high},inf", "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    swept = one_result(result.stdout)
    throughputs = [run["request_throughput"] for run in swept["sweep"]["results"]]
    assert swept["sweep"]["values"] == [low, high, "inf"]
    assert throughputs[1] > throughputs[0] * 1.2  # more load, more answers a second...
    saturation = swept["saturation"]
    assert saturation["at"] in (high, "inf")  # ...until the slots are full
    assert saturation["request_throughput"] >= max(throughputs) / 1.1
    assert all(run["completed"] == 8 and run["failed"] == 0 for run in swept["sweep"]["results"])


def test_one_run_reads_as_vllm_bench_serves_result(two_slot_llama_server):
    result = bench(
        "--server", two_slot_llama_server.url, "--num-prompts", "6", "--output-len", "12",
        "--request-rate", "inf", "--goodput", "ttft:60000,tpot:5000", "--percentiles", "50,90,99.9", "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    run = one_result(result.stdout)
    keys = (
        "duration completed failed total_input_tokens total_output_tokens request_throughput request_goodput "
        "output_throughput total_token_throughput input_lens output_lens ttfts itls errors generated_texts "
        "max_concurrent_requests max_output_tokens_per_s backend model_id num_prompts request_rate "
        "burstiness max_concurrency date"
    )
    for key in keys.split():
        assert key in run, key
    assert run["backend"] == "llama.cpp" and run["request_rate"] == "inf"
    assert run["completed"] == 6 and run["output_lens"] == [12] * 6  # ignore_eos: exactly as asked
    for key, _ in METRICS:
        p50, p90, p999 = (run[f"p{w}_{key}_ms"] for w in ("50", "90", "99.9"))
        assert 0 < p50 <= p90 <= p999, key
        assert run[f"median_{key}_ms"] == p50
    assert run["request_throughput"] == pytest.approx(6 / run["duration"])
    assert run["request_goodput"] == pytest.approx(run["request_throughput"])  # every SLO generous
    assert run["output_throughput"] == pytest.approx(72 / run["duration"])
    assert (
        run["max_concurrent_requests"] == 6
    )  # all sent at once; the server queues what its slots cannot take


def test_our_figures_agree_with_the_servers_own(two_slot_llama_server):
    """One request at a time (nothing waits for a slot): the server's count of generated tokens is
    ours exactly, and its own time per token is ours within a quarter."""
    where = RemoteTarget(two_slot_llama_server.url, None, None)
    run = ServingBench(where).run(ServingConfig(where, num_prompts=4, output_len=16, max_concurrency=1))
    server = run["server_reported"]
    assert server["generation_tokens"] == run["total_output_tokens"] == 64
    assert 0 < server["prompt_tokens"] <= run["total_input_tokens"]  # the template's head may be cached
    assert 0.75 < server["tpot_ours_over_server"] < 1.33
    assert server["ttft_ours_over_server"] >= 0.9  # ours adds the network to the server's prompt time
    assert 0.75 < run["mean_tpot_ms"] / server["metrics_mean_tpot_ms"] < 1.33  # its /metrics' totals
    assert run["max_concurrent_requests"] == 1


def test_an_impossible_slo_leaves_no_goodput_and_a_dataset_gives_the_prompts(two_slot_llama_server, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Name a colour."}\n\n{"prompt": "Name a fruit."}\n', encoding="utf-8")
    where = RemoteTarget(two_slot_llama_server.url, None, None)
    from engine.remote.serving import read_dataset, workload

    config = ServingConfig(
        where,
        num_prompts=3,
        output_len=4,
        prompts=read_dataset(str(prompts)),
        slo=parse_goodput(["ttft:0.001"]),
    )
    run = ServingBench(where).run(config)
    assert run["completed"] == 3 and run["good_completed"] == 0 and run["request_goodput"] == 0
    assert workload(config) == ["Name a colour.", "Name a fruit.", "Name a colour."]  # the file's two, cycled


def test_a_server_that_dies_mid_run_counts_its_failures_with_the_reason(own_llama_server):
    where = RemoteTarget(own_llama_server.url, None, None)
    bench_ = ServingBench(where)
    config = ServingConfig(where, num_prompts=4, output_len=400, request_rate=math.inf)
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(bench_.run(config)), daemon=True)
    worker.start()
    assert own_llama_server.wait_busy()
    own_llama_server.kill()
    worker.join(120)
    assert not worker.is_alive()
    assert result["failed"] >= 3 and result["completed"] + result["failed"] == 4
    assert sum(result["failed_reasons"].values()) == result["failed"]
    assert all(reason and "\n" not in reason for reason in result["failed_reasons"])
    assert result["server_reported"]["generation_tokens"] is None  # its /metrics died with it


def test_the_tables_fit_80_columns_and_draw_the_sweep(two_slot_llama_server, monkeypatch):
    from rich.console import Console

    terminal = io.StringIO()
    monkeypatch.setattr("tui.cli.serving_table.report_console", lambda: Console(file=terminal, width=80))
    result = bench(
        "--server", two_slot_llama_server.url, "--num-prompts", "4", "--output-len", "8",
        "--sweep", "concurrency:1,2", "--goodput", "ttft:60000",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    out = terminal.getvalue()
    assert "…" not in out and max(len(line) for line in out.splitlines()) <= 80
    assert "Sweep over concurrency" in out and "against request throughput" in out
    assert "●" in out and "saturated" in out


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--num-prompts", "4"), "--num-prompts: a serving benchmark measures a server"),
        (
            ("--server", "URL", "--sweep", "rates:1,2"),
            "--sweep takes rate:R1,R2,... or concurrency:C1,C2,...",
        ),
        (("--server", "URL", "--sweep", "rate:2"), "--sweep needs two values or more"),
        (("--server", "URL", "--sweep", "concurrency:0,2"), "--sweep concurrency must be at least 1"),
        (("--server", "URL", "--request-rate", "0"), "--request-rate must be above 0"),
        (("--server", "URL", "--request-rate", "fast"), "--request-rate must be a number of requests"),
        (("--server", "URL", "--goodput", "latency:5"), "--goodput takes ttft:MS, tpot:MS or e2el:MS"),
        (("--server", "URL", "--goodput", "ttft:-1"), "--goodput ttft:-1: must be above 0 ms"),
        (("--server", "URL", "--percentiles", "0,50"), "--percentiles must be above 0 and at most 100"),
        (("--server", "URL", "--num-prompts", "0"), "--num-prompts must be at least 1"),
        (("--server", "URL", "--max-concurrency", "0"), "--max-concurrency must be at least 1"),
        (("--server", "URL", "--burstiness", "0"), "--burstiness must be above 0"),
        (("--server", "URL", "--dataset", "MISSING"), "cannot be read"),
        (("--server", "URL", "--dataset", "BAD"), "line 2 is not JSON"),
        (("--server", "URL", "--dataset", "BAD", "--input-len", "8"), "choose one"),
    ],
)
def test_bad_serving_flags_exit_2_in_one_line_before_connecting(args, says, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\nnot json\n', encoding="utf-8")
    swap = {"URL": "http://127.0.0.1:9/v1", "MISSING": str(tmp_path / "none.txt"), "BAD": str(bad)}
    result = bench(*(swap.get(a, a) for a in args))
    assert result.exit_code == 2, result.output
    assert says in result.stderr and len(result.stderr.strip().splitlines()) == 1


VLLM_PAGE = """# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{{engine="0"}} {gen}
vllm:prompt_tokens_total{{engine="0"}} {prompt}
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf"}} {n}
vllm:time_to_first_token_seconds_sum{{engine="0"}} {ttft}
vllm:time_to_first_token_seconds_count{{engine="0"}} {n}
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{{engine="0",le="+Inf"}} {gaps}
vllm:inter_token_latency_seconds_sum{{engine="0"}} {itl}
vllm:inter_token_latency_seconds_count{{engine="0"}} {gaps}
"""


def test_a_vllm_metrics_page_gives_the_runs_own_means_and_a_restart_gives_none():
    """vLLM's histograms (llama.cpp sends none): the run's means are the growth of sum over count."""
    from engine.remote.metrics import counters
    from engine.remote.server_counts import run_figures, wanted

    def page(**values) -> dict[str, float]:
        return counters(VLLM_PAGE.format(**values), wanted("vllm"))

    before = page(gen=100, prompt=50, n=2, ttft=0.5, gaps=98, itl=2.0)
    after = page(gen=164, prompt=90, n=6, ttft=1.3, gaps=158, itl=3.2)
    figures = run_figures("vllm", before, after)
    assert figures["generation_tokens"] == 64 and figures["prompt_tokens"] == 40
    assert figures["metrics_mean_ttft_ms"] == pytest.approx(200.0)  # 0.8 s over 4 requests
    assert figures["metrics_mean_itl_ms"] == pytest.approx(20.0)  # 1.2 s over 60 gaps
    assert figures["metrics_mean_e2el_ms"] is None and figures["metrics_mean_queue_ms"] is None  # not sent
    restarted = run_figures("vllm", after, page(gen=10, prompt=5, n=1, ttft=0.1, gaps=9, itl=0.2))
    assert restarted["generation_tokens"] is None and restarted["metrics_mean_ttft_ms"] is None
    assert run_figures("openai-compatible", None, None)["metrics_mean_ttft_ms"] is None


def test_top_shows_both_slots_filling_while_a_serving_run_goes_on_beside_it(two_slot_llama_server):
    """The issue's pairing: `llmchat top` watching the server while `bench --server` loads it."""
    from engine.remote.server_stats import watch

    where = RemoteTarget(two_slot_llama_server.url, None, None)
    bench_ = ServingBench(where)
    result: dict = {}
    config = ServingConfig(where, num_prompts=2, output_len=120)
    run = threading.Thread(target=lambda: result.update(bench_.run(config)), daemon=True)
    seen = watch(where)
    try:
        run.start()
        readings = []
        while run.is_alive():
            readings.append(seen.poll())
            time.sleep(0.2)
        readings.append(seen.poll())
    finally:
        seen.close()
        run.join(120)
    busy = [r.snapshot for r in readings if r.snapshot.running == 2]
    assert busy and all(slot.processing and slot.held > 0 for slot in busy[-1].slots)
    assert max(r.rates.generation_tps for r in readings if r.rates is not None) > 0
    assert readings[-1].snapshot.running == 0 and result["completed"] == 2
