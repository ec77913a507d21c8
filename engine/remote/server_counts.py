"""What a server's own /metrics says about one benchmark run: the page read before and after it,
the difference is the run's (a server's counters and histograms only grow; one that went down
means the server restarted, and that figure is None).

- tokens: its counters of prompt tokens computed and tokens generated (server_stats.METRICS);
- latencies: vLLM's and SGLang's histograms of TTFT, inter-token latency, end-to-end latency and
  queue time (mean = Δsum / Δcount), and llama.cpp's totals of seconds spent generating and the
  tokens they made (its mean time per output token).
"""

from __future__ import annotations

from engine.remote.client import RemoteClient, RemoteError
from engine.remote.metrics import counters
from engine.remote.server_stats import METRICS

HISTOGRAMS: dict[str, dict[str, tuple[str, ...]]] = {
    "vllm": {
        "ttft": ("vllm:time_to_first_token_seconds",),
        "itl": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),  # new name first
        "e2el": ("vllm:e2e_request_latency_seconds",),
        "queue": ("vllm:request_queue_time_seconds",),
    },
    "sglang": {
        "ttft": ("sglang:time_to_first_token_seconds",),
        "itl": ("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"),
        "e2el": ("sglang:e2e_request_latency_seconds",),
        "queue": ("sglang:queue_time_seconds",),
    },
}
"""Per server kind: each latency's Prometheus histograms (seconds), the first one sent is used."""

TOTALS: dict[str, dict[str, tuple[str, str]]] = {
    "llama.cpp": {"tpot": ("llamacpp:tokens_predicted_seconds_total", "llamacpp:tokens_predicted_total")},
}
"""Per server kind: a latency as (seconds spent, on how many) counters."""

LATENCIES = ("ttft", "itl", "tpot", "e2el", "queue")


def wanted(kind: str) -> tuple[str, ...]:
    """Every sample name a run's figures need from this kind of server."""
    names = METRICS.get(kind)
    tokens = (names.prompt_tokens, names.generated_tokens) if names else ()
    sent = [h for hs in HISTOGRAMS.get(kind, {}).values() for h in hs]
    histograms = [f"{h}_{part}" for h in sent for part in ("sum", "count")]
    totals = [name for pair in TOTALS.get(kind, {}).values() for name in pair]
    return tuple(n for n in (*tokens, *histograms, *totals) if n)


def read(client: RemoteClient, kind: str) -> dict[str, float] | None:
    """The samples now; None where the server has no /metrics (or nothing of ours on it)."""
    names = wanted(kind)
    if not names:
        return None
    try:
        return counters(client.get_text("/metrics"), names) or None
    except RemoteError:
        return None


def run_figures(kind: str, before: dict[str, float] | None, after: dict[str, float] | None) -> dict:
    """The run's tokens and mean latencies (ms) by the server's own count; None where not sent."""
    figures: dict[str, float | None] = {"prompt_tokens": None, "generation_tokens": None}
    figures |= {f"metrics_mean_{key}_ms": None for key in LATENCIES}
    if before is None or after is None:
        return figures
    names = METRICS.get(kind)
    if names:
        figures["prompt_tokens"] = _grown(before, after, names.prompt_tokens)
        figures["generation_tokens"] = _grown(before, after, names.generated_tokens)
    for key, histograms in HISTOGRAMS.get(kind, {}).items():
        sent = next((h for h in histograms if f"{h}_count" in after), None)
        if sent:
            figures[f"metrics_mean_{key}_ms"] = _mean_ms(before, after, f"{sent}_sum", f"{sent}_count")
    for key, (seconds, count) in TOTALS.get(kind, {}).items():
        figures[f"metrics_mean_{key}_ms"] = _mean_ms(before, after, seconds, count)
    return figures


def _grown(before: dict[str, float], after: dict[str, float], name: str | None) -> float | None:
    if name is None or name not in before or name not in after or after[name] < before[name]:
        return None  # not sent, or the server restarted during the run
    return after[name] - before[name]


def _mean_ms(before: dict[str, float], after: dict[str, float], total: str, count: str) -> float | None:
    seconds, n = _grown(before, after, total), _grown(before, after, count)
    return seconds / n * 1000 if seconds is not None and n else None
