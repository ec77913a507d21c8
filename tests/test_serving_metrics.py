"""The serving metric set (engine/serving_metrics.py) that `bench --server` and the lab share:
vLLM's definitions and key names, checked on small hand-made runs."""

from __future__ import annotations

import numpy as np
import pytest

from engine.serving_metrics import (
    RequestOutcome,
    Slo,
    parse_goodput,
    parse_percentiles,
    percentile_word,
    summarize,
)


def done(start: float, ttft: float, itls: tuple[float, ...], prompt: int = 10) -> RequestOutcome:
    """A completed request whose stream ended with its last token."""
    return RequestOutcome(
        start_s=start,
        prompt_tokens=prompt,
        output_tokens=len(itls) + 1,
        ttft_s=ttft,
        itls_s=itls,
        latency_s=ttft + sum(itls),
    )


def test_tpot_is_the_time_after_the_first_token_per_later_token():
    outcome = RequestOutcome(0.0, 5, output_tokens=5, ttft_s=0.2, itls_s=(0.1,) * 4, latency_s=0.7)
    assert outcome.tpot_s == pytest.approx((0.7 - 0.2) / 4)
    figures = summarize([outcome], 1.0)
    assert figures["mean_tpot_ms"] == pytest.approx(125.0)
    assert figures["mean_e2el_ms"] == pytest.approx(700.0) and figures["mean_ttft_ms"] == pytest.approx(200.0)


def test_a_one_token_answer_has_no_tpot_and_cannot_miss_a_tpot_slo():
    one = RequestOutcome(0.0, 5, output_tokens=1, ttft_s=0.3, latency_s=0.3)
    assert one.tpot_s is None
    figures = summarize([one], 1.0, slo=Slo({"tpot": 1.0}))
    assert figures["mean_tpot_ms"] is None and figures["p99_tpot_ms"] is None
    assert figures["mean_ttft_ms"] == pytest.approx(300.0)
    assert figures["good_completed"] == 1


def test_percentiles_mean_median_and_std_are_numpys():
    ttfts = [0.012, 0.5, 0.031, 0.2, 0.077, 0.9, 0.15]
    outcomes = [done(float(i), ttft, (0.01,)) for i, ttft in enumerate(ttfts)]
    figures = summarize(outcomes, 10.0, percentiles=(25.0, 50.0, 90.0, 99.0, 99.9))
    ms = np.asarray(ttfts) * 1000
    for p in (25, 50, 90, 99, 99.9):
        assert figures[f"p{percentile_word(p)}_ttft_ms"] == pytest.approx(np.percentile(ms, p))
    assert figures["mean_ttft_ms"] == pytest.approx(ms.mean())
    assert figures["median_ttft_ms"] == pytest.approx(np.median(ms))
    assert figures["std_ttft_ms"] == pytest.approx(ms.std())  # the population's (ddof 0), as vLLM's
    assert figures["p90_ttft_ms"] == pytest.approx(660.0)  # linear interpolation between 500 and 900


def test_itl_pools_every_gap_of_every_request():
    outcomes = [done(0.0, 0.1, (0.01, 0.03)), done(0.0, 0.1, (0.02,))]
    figures = summarize(outcomes, 1.0)
    assert figures["mean_itl_ms"] == pytest.approx(20.0) and figures["median_itl_ms"] == pytest.approx(20.0)


def test_failed_requests_are_counted_by_reason_and_left_out_of_every_figure():
    good = done(0.0, 0.1, (0.05,), prompt=7)
    outcomes = [
        good,
        RequestOutcome(0.1, 9, error="HTTP 503: overloaded"),
        RequestOutcome(0.2, 9, error="HTTP 503: overloaded"),
        RequestOutcome(0.3, 9, output_tokens=3, ttft_s=5.0, itls_s=(1.0, 1.0)),  # no end: not ok
    ]
    figures = summarize(outcomes, 2.0)
    assert figures["completed"] == 1 and figures["failed"] == 3
    assert figures["failed_reasons"] == {"HTTP 503: overloaded": 2, "the stream ended without an answer": 1}
    assert figures["total_input_tokens"] == 7 and figures["total_output_tokens"] == 2
    assert figures["mean_ttft_ms"] == pytest.approx(100.0) and figures["p99_ttft_ms"] == pytest.approx(100.0)
    assert figures["mean_itl_ms"] == pytest.approx(50.0)
    assert figures["request_throughput"] == pytest.approx(0.5)
    assert figures["errors"] == ["", "HTTP 503: overloaded", "HTTP 503: overloaded", ""]


def test_throughputs_are_totals_over_the_duration():
    outcomes = [done(0.0, 0.1, (0.1, 0.1), prompt=10), done(0.5, 0.2, (0.1,), prompt=20)]
    figures = summarize(outcomes, 4.0)
    assert figures["request_throughput"] == pytest.approx(2 / 4)
    assert figures["output_throughput"] == pytest.approx(5 / 4)
    assert figures["total_token_throughput"] == pytest.approx(35 / 4)
    assert figures["request_goodput"] is None and figures["good_completed"] is None
    assert summarize(outcomes, 0.0)["request_throughput"] is None


def test_goodput_counts_the_requests_that_meet_every_slo():
    fast = done(0.0, 0.1, (0.01, 0.01))
    slow_start = done(0.0, 0.8, (0.01, 0.01))
    slow_tokens = done(0.0, 0.1, (0.2, 0.2))
    outcomes = [fast, slow_start, slow_tokens]
    assert summarize(outcomes, 2.0, slo=Slo({"ttft": 500}))["request_goodput"] == pytest.approx(1.0)
    both = summarize(outcomes, 2.0, slo=Slo({"ttft": 500, "tpot": 50}))
    assert both["good_completed"] == 1 and both["request_goodput"] == pytest.approx(0.5)
    assert summarize(outcomes, 2.0, slo=Slo({"e2el": 1e6}))["good_completed"] == 3
    at_the_limit = summarize([fast], 1.0, slo=Slo({"ttft": 100}))  # ≤ the limit is good, as vLLM's
    assert at_the_limit["good_completed"] == 1


def test_peak_concurrency_counts_overlapping_requests():
    outcomes = [
        done(0.0, 0.5, (0.5,)),  # 0.0 .. 1.0
        done(0.2, 0.3, (0.3,)),  # 0.2 .. 0.8
        done(0.5, 0.1, (0.1,)),  # 0.5 .. 0.7: three at once
        done(1.0, 0.1, (0.1,)),  # 1.0 .. 1.2: starts as the first ends
        done(3.0, 0.1, ()),
    ]
    assert summarize(outcomes, 4.0)["max_concurrent_requests"] == 3
    assert summarize(outcomes[3:], 4.0)["max_concurrent_requests"] == 1
    assert summarize([], 1.0)["max_concurrent_requests"] is None


def test_peak_tokens_per_second_buckets_each_token_by_its_arrival():
    outcomes = [done(0.0, 0.1, (0.1,) * 5), done(1.5, 0.1, (0.1, 0.1))]  # 6 tokens in [0, 1), 3 in [1, 2)
    assert summarize(outcomes, 2.0)["max_output_tokens_per_s"] == 6.0
    assert RequestOutcome(2.0, 1, 2, 0.5, (0.25,), 0.75).token_times_s() == [2.5, 2.75]


def test_keys_follow_vllms_result_file():
    figures = summarize([done(0.0, 0.1, (0.1,))], 1.0, percentiles=(50.0, 99.0, 99.9))
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p99", "p99.9"):
            assert f"{stat}_{metric}_ms" in figures
    assert "p99.0_ttft_ms" not in figures and "p90_ttft_ms" not in figures
    assert {"request_throughput", "request_goodput", "output_throughput", "total_token_throughput"} <= set(
        figures
    )
    assert {"completed", "failed", "duration", "input_lens", "output_lens", "ttfts", "itls"} <= set(figures)
    assert percentile_word(99.0) == "99" and percentile_word(99.9) == "99.9" and percentile_word(50) == "50"


def test_nothing_measured_is_none_not_zero():
    figures = summarize([RequestOutcome(0.0, 5, error="refused")], 1.0)
    assert figures["mean_ttft_ms"] is None and figures["p99_e2el_ms"] is None
    assert figures["max_output_tokens_per_s"] is None and figures["completed"] == 0


@pytest.mark.parametrize(
    ("text", "expected"),
    [("50,90,99", (50.0, 90.0, 99.0)), ("99, 50,99.9", (50.0, 99.0, 99.9)), ("100", (100.0,))],
)
def test_parse_percentiles(text, expected):
    assert parse_percentiles(text) == expected


@pytest.mark.parametrize("text", ["0", "101", "-5", "fifty", "", ",", "nan", "inf"])
def test_parse_percentiles_refuses_in_one_line(text):
    with pytest.raises(ValueError, match="percentiles") as error:
        parse_percentiles(text)
    assert "\n" not in str(error.value)


def test_parse_goodput_takes_vllms_forms():
    assert parse_goodput([]) is None
    assert parse_goodput(["ttft:500", "tpot:50"]).limits_ms == {"ttft": 500.0, "tpot": 50.0}
    assert parse_goodput(["TTFT:500,e2el:2000 tpot:1.5"]).limits_ms == {
        "ttft": 500.0,
        "e2el": 2000.0,
        "tpot": 1.5,
    }
    assert Slo({"ttft": 500.0, "tpot": 50.0}).describe() == "TTFT ≤ 500 ms, TPOT ≤ 50 ms"


@pytest.mark.parametrize(
    "part", ["foo:1", "ttft", "itl:5", "ttft:abc", "ttft:0", "ttft:-1", "ttft:inf", ":5"]
)
def test_parse_goodput_refuses_in_one_line(part):
    with pytest.raises(ValueError, match="goodput") as error:
        parse_goodput([part])
    assert "\n" not in str(error.value)
