"""`llmchat bench --server URL --num-prompts N`: a serving benchmark, measured as `vllm bench
serve` measures one, and reported under its result file's keys (engine/serving_metrics.py).

A workload of N prompts (the lab's real questions, a `--dataset` file, or prompts of a fixed
`--input-len`) arrives at `--request-rate` R a second (gamma-distributed gaps: Poisson at
burstiness 1, burstier below it; all at once for R = inf), at most `--max-concurrency` C in
flight. Each request streams its answer on a thread of its own; TTFT counts from the moment
its request leaves (a request held back by the concurrency cap is not yet sent, as in vLLM).
Beside the client's figures go the server's own: each request's timings where it reports them
(llama.cpp), and the token counters of its /metrics page before and after the run.

A `--sweep` repeats the run over several rates or concurrencies and finds where the server
saturates: the first point whose request throughput is within 10% of every later point's.
"""

from __future__ import annotations

import datetime
import json
import math
import statistics
import threading
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Literal

import numpy as np

from engine.events import Failed, TokenSampled, TurnFinished, TurnStats
from engine.lab.workload import QUESTIONS
from engine.remote import server_counts
from engine.remote.bench import fresh_session, prompt_of
from engine.remote.client import RemoteError
from engine.remote.session import connect
from engine.remote.target import RemoteTarget
from engine.serving_metrics import DEFAULT_PERCENTILES, RequestOutcome, Slo, summarize

Report = Callable[[str], None]
SweepOver = Literal["request_rate", "max_concurrency"]

DEFAULT_OUTPUT_LEN = 128
"""Tokens asked of a question's answer when `--output-len` is not given (it may end sooner)."""

SATURATED_WITHIN = 0.10
"""A sweep point is saturated when no later point's request throughput beats it by more than this."""


class DatasetError(ValueError):
    """A --dataset file that gives no prompts (one line, naming the file)."""


@dataclass(frozen=True)
class ServingConfig:
    target: RemoteTarget
    num_prompts: int = 16
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    prompts: tuple[str, ...] = QUESTIONS
    input_len: int | None = None
    """Prompts of about this many tokens instead of `prompts` (each with a nonce, nothing cached)."""
    output_len: int | None = None
    """Exactly this many tokens per answer (the end token ignored where the server allows);
    None: up to DEFAULT_OUTPUT_LEN, ending where the model ends."""
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    slo: Slo | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        """ValueError, starting with the field's name, for a value no run can use."""
        _check(self.num_prompts >= 1, f"num_prompts must be at least 1, got {self.num_prompts}")
        _check(
            self.request_rate > 0, f"request_rate must be above 0 (inf: all at once), got {self.request_rate}"
        )
        _check(0 < self.burstiness < math.inf, f"burstiness must be above 0, got {self.burstiness}")
        if self.max_concurrency is not None:
            _check(
                self.max_concurrency >= 1, f"max_concurrency must be at least 1, got {self.max_concurrency}"
            )
        for name in ("input_len", "output_len"):
            value = getattr(self, name)
            _check(value is None or value >= 1, f"{name} must be at least 1, got {value}")
        _check(bool(self.prompts), "prompts: the workload has none")

    @property
    def max_tokens(self) -> int:
        return self.output_len or DEFAULT_OUTPUT_LEN


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def read_dataset(path: str) -> tuple[str, ...]:
    """Prompts from a file: JSON Lines with a "prompt" string each (vLLM's custom dataset), or
    plain text, one prompt a line. DatasetError says what is wrong, naming the file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DatasetError(
            f"--dataset {path}: cannot be read ({e.__class__.__name__}: {e.args[-1]})"
        ) from None
    lines = [line for line in text.splitlines() if line.strip()]
    if path.endswith((".jsonl", ".json")):
        prompts = tuple(_json_prompt(path, n, line) for n, line in enumerate(lines, 1))
    else:
        prompts = tuple(line.strip() for line in lines)
    if not prompts:
        raise DatasetError(f"--dataset {path}: holds no prompts")
    return prompts


def _json_prompt(path: str, number: int, line: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        raise DatasetError(f"--dataset {path}: line {number} is not JSON") from None
    prompt = record.get("prompt") if isinstance(record, dict) else None
    if not isinstance(prompt, str) or not prompt.strip():
        raise DatasetError(f'--dataset {path}: line {number} has no "prompt" string')
    return prompt


def arrival_offsets(config: ServingConfig) -> list[float]:
    """When each request is due, seconds from the start: gamma gaps with shape = burstiness and
    mean 1/rate (vLLM's arrivals), seeded; all zero at an infinite rate."""
    if math.isinf(config.request_rate):
        return [0.0] * config.num_prompts
    rng = np.random.default_rng(config.seed)
    theta = 1.0 / (config.request_rate * config.burstiness)
    gaps = rng.gamma(shape=config.burstiness, scale=theta, size=config.num_prompts)
    gaps[0] = 0.0  # the first request starts the run
    return np.cumsum(gaps).tolist()


def workload(config: ServingConfig) -> list[str]:
    """The N prompts, in order."""
    if config.input_len is not None:
        return [
            f"Request {uuid.uuid4().hex[:8]}. {prompt_of(config.input_len)}"
            for _ in range(config.num_prompts)
        ]
    return [config.prompts[i % len(config.prompts)] for i in range(config.num_prompts)]


class ServingBench:
    """One connection to the server; `run` measures one configuration."""

    def __init__(self, target: RemoteTarget, report: Report = lambda line: None):
        self.probe = connect(target)
        self.report = report
        self.kind = self.probe.server.dialect.kind

    def header(self) -> dict:
        info = self.probe.info
        return {
            "backend": self.kind,
            "model_id": info.name,
            "server_version": info.server.version,
            "server_parallelism": info.server.parallelism,
        }

    def run(self, config: ServingConfig) -> dict:
        """One run's result, under `vllm bench serve`'s keys, with the server's own figures."""
        before = server_counts.read(self.probe.client, self.kind)
        started = time.perf_counter()
        outcomes, timings = self._requests(config, started)
        duration = time.perf_counter() - started
        result = {
            "date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
            **self.header(),
            "num_prompts": config.num_prompts,
            "request_rate": config.request_rate if math.isfinite(config.request_rate) else "inf",
            "burstiness": config.burstiness,
            "max_concurrency": config.max_concurrency,
            "percentiles": list(config.percentiles),
            "goodput_slo_ms": config.slo.limits_ms if config.slo else None,
            **summarize(outcomes, duration, config.percentiles, config.slo),
        }
        result["server_reported"] = self._server_figures(timings, before, result)
        self.report(_progress_line(result))
        return result

    # -- the requests -----------------------------------------------------------------------
    def _requests(
        self, config: ServingConfig, started: float
    ) -> tuple[list[RequestOutcome], list[TurnStats]]:
        prompts, due = workload(config), arrival_offsets(config)
        outcomes: list[RequestOutcome | None] = [None] * len(prompts)
        stats: list[TurnStats | None] = [None] * len(prompts)
        seats = threading.Semaphore(config.max_concurrency or len(prompts))

        def one(i: int) -> None:
            with seats:
                outcomes[i], stats[i] = self._request(config, prompts[i], started)

        threads = []
        for i, offset in enumerate(due):
            time.sleep(max(0.0, started + offset - time.perf_counter()))
            threads.append(threading.Thread(target=one, args=(i,), daemon=True, name=f"serving-{i}"))
            threads[-1].start()
        for thread in threads:
            thread.join()
        return [o for o in outcomes if o is not None], [s for s in stats if s is not None]

    def _request(
        self, config: ServingConfig, prompt: str, started: float
    ) -> tuple[RequestOutcome, TurnStats | None]:
        """One request, streamed: when it left, each token's gap, when the stream ended."""
        session = fresh_session(self.probe, config.max_tokens, exact_length=config.output_len is not None)
        asked = time.perf_counter()
        latencies: list[float] = []
        first_at = None
        try:
            for event in session.send(prompt):
                if isinstance(event, TokenSampled):
                    first_at = first_at or time.perf_counter()
                    latencies.append(event.latency_s)
                elif isinstance(event, Failed):
                    return RequestOutcome(asked - started, None, error=event.message), None
                elif isinstance(event, TurnFinished):
                    return self._outcome(event, latencies, first_at, asked, started), event.stats
        except RemoteError as e:
            return RequestOutcome(asked - started, None, error=str(e)), None
        return RequestOutcome(asked - started, None, error="the stream ended without an answer"), None

    def _outcome(
        self,
        finished: TurnFinished,
        latencies: list[float],
        first_at: float | None,
        asked: float,
        started: float,
    ) -> RequestOutcome:
        ended = time.perf_counter()
        stats = finished.stats
        # The request left when the first token's latency (the TTFT) began; before that the
        # session tokenized the prompt, which is the client's work, not the server's.
        sent = first_at - latencies[0] if first_at is not None else asked
        error = finished.error or ("" if latencies else "the server sent no token")
        return RequestOutcome(
            start_s=sent - started,
            prompt_tokens=stats.prompt_tokens,
            output_tokens=stats.generated_tokens,
            ttft_s=latencies[0] if latencies else None,
            itls_s=tuple(latencies[1:]),
            latency_s=None if error else ended - sent,
            error=error,
            text=finished.text,
        )

    # -- the server's side --------------------------------------------------------------------
    def _server_figures(self, timings: list[TurnStats], before: dict | None, result: dict) -> dict:
        """What the server measured itself, beside ours; None where it does not report it."""
        server = [s.server for s in timings if s.server is not None]
        prompt_ms = [t.prompt_ms for t in server if t.prompt_ms is not None]
        per_token_ms = [t.predicted_per_token_ms for t in server if t.predicted_per_token_ms is not None]
        figures = {
            "mean_prompt_ms": statistics.mean(prompt_ms) if prompt_ms else None,
            "mean_tpot_ms": statistics.mean(per_token_ms) if per_token_ms else None,
            **server_counts.run_figures(self.kind, before, server_counts.read(self.probe.client, self.kind)),
        }
        # Ours over theirs: TPOT should agree; TTFT only where nothing queued (a low rate), since
        # the server's prompt time starts when a slot takes the request.
        for ours, theirs in (("tpot", "mean_tpot_ms"), ("ttft", "mean_prompt_ms")):
            mine = result[f"mean_{ours}_ms"]
            figures[f"{ours}_ours_over_server"] = mine / figures[theirs] if mine and figures[theirs] else None
        return figures


def _progress_line(result: dict) -> str:
    rate = result["request_rate"]
    load = f"rate {rate}" if result["max_concurrency"] is None else f"concurrency {result['max_concurrency']}"
    return (
        f"{load}: {result['completed']}/{result['num_prompts']} done, "
        f"{result['request_throughput'] or 0:.2f} req/s, {result['output_throughput'] or 0:.1f} tok/s"
    )


def run(config: ServingConfig, report: Report = lambda line: None) -> dict:
    """One serving run against the server."""
    return ServingBench(config.target, report).run(config)


def sweep(
    config: ServingConfig, over: SweepOver, values: tuple[float, ...], report: Report = lambda line: None
) -> dict:
    """The run repeated at each rate or concurrency, and where the server saturates."""
    bench = ServingBench(config.target, report)
    results = []
    for value in values:
        point = replace(config, **{over: int(value) if over == "max_concurrency" else value})
        results.append(bench.run(point))
    return {
        **bench.header(),
        "sweep": {"over": over, "values": [_shown(v, over) for v in values], "results": results},
        "saturation": saturation(over, values, results),
    }


def _shown(value: float, over: SweepOver) -> float | int | str:
    """A sweep point as JSON has it: a whole concurrency, a rate, or "inf" (vLLM's spelling)."""
    if math.isinf(value):
        return "inf"
    return int(value) if over == "max_concurrency" else value


def saturation(over: SweepOver, values: tuple[float, ...], results: list[dict]) -> dict:
    """The first point whose request throughput is within 10% of the sweep's best: from there more
    load brings no more answers a second. A sweep whose best is its last finite point was still
    rising: not saturated ("at" None). All at once (rate inf) is the server's own limit."""
    throughputs = [r["request_throughput"] or 0.0 for r in results]
    best = max(throughputs)
    first = next(i for i, x in enumerate(throughputs) if x >= best / (1 + SATURATED_WITHIN))
    rising = first == len(values) - 1 and len(values) > 1 and math.isfinite(values[-1])
    return {
        "over": over,
        "at": None if rising else _shown(values[first], over),
        "request_throughput": None if rising else throughputs[first],
        "best_request_throughput": best,
    }
