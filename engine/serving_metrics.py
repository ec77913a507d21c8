"""The serving metric set, as the field reports it: what `llmchat bench --server` and the local
lab (`llmchat lab batching`) both print, under the key names of `vllm bench serve`'s result file
so the two can be read side by side.

Per request the client knows when it was sent, when each token arrived and when the stream
ended. From those, as vLLM defines them:
- TTFT: sent -> first token;
- TPOT: (end-to-end - TTFT) / (output tokens - 1), for requests with two tokens or more;
- ITL: every gap between two tokens, all requests pooled;
- E2EL: sent -> last byte.
Percentiles are numpy's (linear interpolation), standard deviations the population's (ddof 0),
as vLLM computes them. A request is "good" when every SLO given holds for it (goodput).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

METRICS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL"))
"""(key, name): the latency metrics, in vLLM's order."""

DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)


@dataclass(frozen=True)
class RequestOutcome:
    """One request of a serving run, seconds from the run's start."""

    start_s: float
    prompt_tokens: int | None
    output_tokens: int = 0
    ttft_s: float | None = None
    itls_s: tuple[float, ...] = ()
    """The gaps between consecutive tokens (a chunk's gap shared by the tokens it carried)."""
    latency_s: float | None = None
    """Sent -> the end of the stream."""
    error: str = ""
    """Why it failed (one line); '' for a completed request."""
    text: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.latency_s is not None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)

    def token_times_s(self) -> list[float]:
        """When each token arrived, from the run's start."""
        if self.ttft_s is None:
            return []
        times = [self.start_s + self.ttft_s]
        for gap in self.itls_s:
            times.append(times[-1] + gap)
        return times


@dataclass(frozen=True)
class Slo:
    """Service-level objectives in ms (`--goodput ttft:500 tpot:50`); None: not set."""

    limits_ms: dict[str, float] = field(default_factory=dict)

    def met_by(self, outcome: RequestOutcome) -> bool:
        values = {"ttft": outcome.ttft_s, "tpot": outcome.tpot_s, "e2el": outcome.latency_s}
        for key, limit in self.limits_ms.items():
            value = values[key]
            if key == "tpot" and value is None:
                continue  # a one-token answer has no TPOT to miss (as vLLM counts it)
            if value is None or value * 1000 > limit:
                return False
        return True

    def describe(self) -> str:
        """'TTFT ≤ 500 ms, TPOT ≤ 50 ms'."""
        return ", ".join(f"{key.upper()} ≤ {limit:g} ms" for key, limit in self.limits_ms.items())


def parse_goodput(parts: Iterable[str]) -> Slo | None:
    """`ttft:500 tpot:50` (also comma-separated) -> Slo; ValueError with one line for a bad part."""
    limits: dict[str, float] = {}
    for part in (p for item in parts for p in re.split(r"[,\s]+", item) if p):
        key, sep, value = part.partition(":")
        key = key.strip().lower()
        if not sep or key not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"goodput takes ttft:MS, tpot:MS or e2el:MS, got {part!r}")
        try:
            limit = float(value)
        except ValueError:
            raise ValueError(f"goodput {part}: not a number of ms") from None
        if not (math.isfinite(limit) and limit > 0):
            raise ValueError(f"goodput {part}: must be above 0 ms")
        limits[key] = limit
    return Slo(limits) if limits else None


def parse_percentiles(text: str) -> tuple[float, ...]:
    """'50,90,99' -> (50.0, 90.0, 99.0); ValueError with one line for a bad value."""
    values = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"percentiles must be numbers, got {part!r}") from None
        if not 0 < value <= 100:
            raise ValueError(f"percentiles must be above 0 and at most 100, got {part}")
        values.append(value)
    if not values:
        raise ValueError("percentiles needs at least one value")
    return tuple(sorted(set(values)))


def percentile_word(p: float) -> str:
    """99.0 -> '99', 99.9 -> '99.9': the `p99_ttft_ms` part of a key, as vLLM writes it."""
    return str(int(p)) if float(p).is_integer() else str(p)


def summarize(
    outcomes: list[RequestOutcome],
    duration_s: float,
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES,
    slo: Slo | None = None,
) -> dict:
    """The run's figures under `vllm bench serve`'s result keys (plus `failed_reasons`)."""
    done = [o for o in outcomes if o.ok]
    total_input = sum(o.prompt_tokens or 0 for o in done)
    total_output = sum(o.output_tokens for o in done)
    rate = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: None)
    good = sum(1 for o in done if slo.met_by(o)) if slo else None
    result = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(outcomes) - len(done),
        "failed_reasons": failed_reasons(outcomes),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": rate(len(done)),
        "request_goodput": rate(good) if slo else None,
        "good_completed": good,
        "output_throughput": rate(total_output),
        "total_token_throughput": rate(total_input + total_output),
        "max_output_tokens_per_s": peak_tokens_per_s(done),
        "max_concurrent_requests": peak_concurrency(done),
    }
    samples = {
        "ttft": [o.ttft_s for o in done if o.ttft_s is not None],
        "tpot": [t for o in done if (t := o.tpot_s) is not None],
        "itl": [gap for o in done for gap in o.itls_s],
        "e2el": [o.latency_s for o in done],
    }
    for key, _ in METRICS:
        result.update(_spread(key, samples[key], percentiles))
    result.update(
        input_lens=[o.prompt_tokens for o in outcomes],
        output_lens=[o.output_tokens for o in outcomes],
        ttfts=[o.ttft_s for o in outcomes],
        itls=[list(o.itls_s) for o in outcomes],
        errors=[o.error for o in outcomes],
        generated_texts=[o.text for o in outcomes],
    )
    return result


def _spread(key: str, values_s: list[float], percentiles: tuple[float, ...]) -> dict:
    """mean/median/std and each percentile of one metric, in ms (None where nothing was measured)."""
    if not values_s:
        blank = {f"{stat}_{key}_ms": None for stat in ("mean", "median", "std")}
        return blank | {f"p{percentile_word(p)}_{key}_ms": None for p in percentiles}
    ms = np.asarray(values_s, dtype=np.float64) * 1000
    out = {
        f"mean_{key}_ms": float(np.mean(ms)),
        f"median_{key}_ms": float(np.median(ms)),
        f"std_{key}_ms": float(np.std(ms)),
    }
    for p in percentiles:
        out[f"p{percentile_word(p)}_{key}_ms"] = float(np.percentile(ms, p))
    return out


def failed_reasons(outcomes: list[RequestOutcome]) -> dict[str, int]:
    """Each reason a request failed, with how many failed for it."""
    reasons: dict[str, int] = {}
    for o in outcomes:
        if not o.ok:
            reason = o.error or "the stream ended without an answer"
            reasons[reason] = reasons.get(reason, 0) + 1
    return reasons


def peak_tokens_per_s(done: list[RequestOutcome]) -> float | None:
    """The most output tokens that arrived within one whole second of the run (vLLM's
    `max_output_tokens_per_s`)."""
    seconds: dict[int, int] = {}
    for o in done:
        for t in o.token_times_s():
            seconds[int(t)] = seconds.get(int(t), 0) + 1
    return float(max(seconds.values())) if seconds else None


def peak_concurrency(done: list[RequestOutcome]) -> int | None:
    """The most requests in flight at one moment (`max_concurrent_requests`; vLLM counts the
    requests active at any time within each whole second, which can only be as many or more)."""
    edges = sorted(
        [(o.start_s, 1) for o in done] + [(o.start_s + o.latency_s, -1) for o in done],
        key=lambda edge: (edge[0], edge[1]),  # an end before a start at the same instant
    )
    running = peak = 0
    for _, change in edges:
        running += change
        peak = max(peak, running)
    return peak if done else None
