"""One run of the serving lab: the pool, the workload, the three policies and the sweep.

`run(loaded, config)` returns a `LabResult`; `to_json()` is what `llmchat lab batching --json`
prints. `on_step` and `on_sweep` let the app show each step as it happens; `stop` (a
threading.Event) ends the run at the next step, and the pool is dropped either way.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from engine.contention import ContentionMeter
from engine.fast import fused, kernels
from engine.instruments.phases import Calibration, ModelShape
from engine.lab import costs, sweep, verdict
from engine.lab.batched import BatchedForward, Feed
from engine.lab.pool import BLOCK_SIZE, KVShape, PagedKVPool, PoolError
from engine.lab.scheduler import POLICY_NAMES, OnStep, Policy, Request, Scheduler, StepRecord, greedy_eos
from engine.lab.workload import Arrivals, RequestSpec, WorkloadConfig, build
from engine.models import LoadedModel
from engine.serving_metrics import DEFAULT_PERCENTILES, Slo, summarize
from engine.threads import configure, configured, restore


class LabError(ValueError):
    """The lab cannot run as asked (one line for the user)."""


@dataclass(frozen=True)
class LabConfig:
    requests: int = 8
    max_batch: int = 4
    budget_mib: float = 48.0
    max_new: int = 16
    min_new: int | None = None
    """The shortest answer a user wants (`--min-new`); None: a quarter of max_new."""
    arrivals: Arrivals = "poisson"
    rate: float = 4.0
    seed: int = 0
    block_size: int = BLOCK_SIZE
    step_tokens: int = 64
    sweep_batches: tuple[int, ...] = sweep.SWEEP_BATCHES
    sweep_steps: int = 4
    sweep_passes: int = 3
    """Rounds over every B (engine/lab/sweep.py): a passing load falls on every B alike."""
    policies: tuple[str, ...] = POLICY_NAMES
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    """The latency percentiles of the serving figures (`--percentiles`)."""
    slo: Slo | None = None
    """What a request must meet to count toward goodput (`--goodput`); None: no goodput."""

    def __post_init__(self) -> None:
        for flag, value in (("max-batch", self.max_batch), ("requests", self.requests)):
            if value < 1:
                raise LabError(f"--{flag} must be at least 1, got {value}")
        if not self.budget_mib > 0:
            raise LabError(f"--budget-mib must be above 0, got {self.budget_mib}")
        if self.max_new < 1:
            raise LabError(f"--max-new must be at least 1 token, got {self.max_new}")
        if self.step_tokens < self.max_batch:
            raise LabError(
                f"--step-tokens ({self.step_tokens}) must be at least --max-batch ({self.max_batch})"
            )
        if self.sweep_steps < 1 or self.sweep_passes < 1:
            raise LabError(
                f"sweep steps and passes must be at least 1, got {self.sweep_steps}, {self.sweep_passes}"
            )
        if unknown := set(self.policies) - set(POLICY_NAMES):
            raise LabError(f"unknown policy {sorted(unknown)[0]!r} (sequential, static, continuous)")
        if not self.percentiles or not all(0 < p <= 100 for p in self.percentiles):
            raise LabError(f"--percentiles must be above 0 and at most 100, got {self.percentiles}")

    def saturating(self) -> "LabConfig":
        """The same lab on a workload the engine, not the arrivals, limits (`--saturate`)."""
        return dataclasses.replace(
            self,
            arrivals="once",
            requests=verdict.SATURATING_BATCHES * self.max_batch,
            max_new=max(verdict.SATURATING_MAX_NEW, self.max_new),
            min_new=1,
        )

    @property
    def workload(self) -> WorkloadConfig:
        return WorkloadConfig(self.requests, self.max_new, self.arrivals, self.rate, self.seed, self.min_new)


def _percentile(values: list[float], q: float) -> float:
    """numpy's (linear between ranks), as the serving figures beside it count (serving_metrics.py)."""
    return float(np.percentile(values, q * 100)) if values else 0.0


PER_REQUEST_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "errors", "generated_texts")
"""summarize()'s per-request lists, left out of the lab's JSON (the figures are what it compares)."""


@dataclass(frozen=True)
class PolicyResult:
    policy: str
    requests: tuple[Request, ...]
    steps: tuple[StepRecord, ...]
    peak_blocks: int
    block_bytes: int
    contiguous_tokens: int
    """What a contiguous reservation sets aside per request: the longest prompt + max new tokens."""
    token_bytes: int
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    slo: Slo | None = None
    busy: bool = False
    """Other work slowed this process while the policy ran (engine/contention.py)."""

    @property
    def makespan_s(self) -> float:
        return self.steps[-1].clock_s if self.steps else 0.0

    @property
    def generated(self) -> int:
        return sum(len(r.out) for r in self.requests)

    @property
    def throughput_tok_s(self) -> float:
        return self.generated / self.makespan_s if self.makespan_s else 0.0

    @property
    def ttfts_s(self) -> list[float]:
        return [r.ttft_s for r in self.requests if r.ttft_s is not None]

    @property
    def itls_s(self) -> list[float]:
        return [gap for r in self.requests for gap in r.itls_s]

    @property
    def preemptions(self) -> int:
        return sum(r.preemptions for r in self.requests)

    @property
    def peak_running(self) -> int:
        return max((s.batch for s in self.steps), default=0)

    @property
    def peak_paged_bytes(self) -> int:
        return self.peak_blocks * self.block_bytes

    @property
    def peak_contiguous_bytes(self) -> int:
        """Bytes a max-length reservation per running request would have held at the busiest step."""
        return self.peak_running * self.contiguous_tokens * self.token_bytes

    def serving(self) -> dict:
        """The field's serving figures (engine/serving_metrics.py) over the run: each request sent
        at its arrival, the run as long as the makespan; without the per-request lists."""
        figures = summarize([r.outcome() for r in self.requests], self.makespan_s, self.percentiles, self.slo)
        return {key: value for key, value in figures.items() if key not in PER_REQUEST_KEYS}

    def to_json(self) -> dict:
        ms = 1000.0
        return {
            "policy": self.policy,
            "throughput_tok_s": round(self.throughput_tok_s, 2),
            "ttft_ms_p50": round(_percentile(self.ttfts_s, 0.5) * ms, 1),
            "ttft_ms_p90": round(_percentile(self.ttfts_s, 0.9) * ms, 1),
            "itl_ms_p50": round(_percentile(self.itls_s, 0.5) * ms, 2),
            "itl_ms_p90": round(_percentile(self.itls_s, 0.9) * ms, 2),
            "peak_blocks": self.peak_blocks,
            "preemptions": self.preemptions,
            "peak_paged_bytes": self.peak_paged_bytes,
            "peak_contiguous_bytes": self.peak_contiguous_bytes,
            "generated_tokens": self.generated,
            "steps": len(self.steps),
            "makespan_s": round(self.makespan_s, 3),
            "busy": self.busy,
            "serving": self.serving(),
        }


@dataclass
class LabResult:
    config: LabConfig
    model: str
    precision: str
    pool: dict
    specs: list[RequestSpec]
    balance: float | None
    policies: list[PolicyResult] = field(default_factory=list)
    sweep: list[sweep.SweepPoint] = field(default_factory=list)
    sweep_skipped: list[int] = field(default_factory=list)
    """Batch sizes the budget left out of the sweep."""

    @property
    def outputs_agree(self) -> bool:
        """Every policy produced the same greedy tokens for every request."""
        outs = [[tuple(r.out) for r in sorted(p.requests, key=lambda r: r.spec.id)] for p in self.policies]
        return all(o == outs[0] for o in outs)

    @property
    def verdict(self) -> verdict.Verdict:
        """Whether the arrivals, not the engine, set every policy's pace (engine/lab/verdict.py)."""
        return verdict.judge(self.specs, self.policies, self.config.max_batch)

    def verdict_json(self) -> dict:
        v = self.verdict
        return {
            "arrival_bound": v.arrival_bound,
            "offered_load_req_s": None if v.offered_req_s is None else round(v.offered_req_s, 2),
            "arrival_floor_s": {policy: round(at, 3) for policy, at in v.floors_s.items()},
            "longest_answer_s": None if v.slack_s is None else round(v.slack_s, 3),
            "behind": list(v.behind),
            "pace": v.summary(),
        }

    def to_json(self) -> dict:
        c = self.config
        return {
            "model": self.model,
            "precision": self.precision,
            "torch_threads": configured(),
            "pool": self.pool,
            "workload": {
                "requests": c.requests,
                "arrivals": c.arrivals,
                "rate_per_s": c.rate if c.arrivals == "poisson" else None,
                "max_new_tokens": c.max_new,
                "min_new_tokens": c.workload.shortest,
                "seed": c.seed,
                "prompt_tokens": [len(s.prompt) for s in self.specs],
            },
            "max_batch": c.max_batch,
            "step_tokens": c.step_tokens,
            "balance_flop_per_byte": None if self.balance is None else round(self.balance, 2),
            "sweep": [
                {
                    "batch": p.batch,
                    "aggregate_tok_s": round(p.aggregate_tok_s, 2),
                    "itl_ms_p50": round(p.itl_ms_p50, 2),
                    "intensity_flop_per_byte": round(p.intensity, 2),
                    "busy": p.busy,
                }
                for p in self.sweep
            ],
            "sweep_skipped": self.sweep_skipped,
            "sweep_bends_at": bend(self.sweep),
            "sweep_dips": sweep.dips(self.sweep, bend(self.sweep)),
            "percentiles": list(c.percentiles),
            "goodput_slo_ms": None if c.slo is None else dict(c.slo.limits_ms),
            "policies": [p.to_json() for p in self.policies],
            "outputs_agree": self.outputs_agree,
            **self.verdict_json(),
        }


class Lab:
    """The pool and the batched forward pass over a loaded model; `release()` frees the pool."""

    def __init__(self, loaded: LoadedModel, config: LabConfig):
        why = fused.supports(loaded.model)
        if why is not None:
            raise LabError(f"the lab runs on the fast path, which does not cover this model: {why}")
        self.loaded, self.config = loaded, config
        self.fast = fused.for_model(loaded.model)
        if self.fast.windows:
            raise LabError(
                f"the lab's batched forward attends over the whole context, and this model's layers "
                f"attend over sliding windows ({', '.join(map(str, self.fast.windows))} positions)"
            )
        if self.fast.embed.device.type == "cpu":  # the matvec kernel the app built: every B, one read of W
            kernels.load_built("step")
        info = loaded.info
        self.kv = KVShape(info.layers, info.kv_heads, info.head_dim, self.fast.act_dtype)
        try:
            self.pool = PagedKVPool(
                self.kv, int(config.budget_mib * 2**20), config.block_size, self.fast.embed.device
            )
        except PoolError as e:
            raise LabError(str(e)) from None
        self.forward = BatchedForward(self.fast, self.pool)
        self.shape = ModelShape.of(loaded)
        self.specs = build(config.workload, loaded.tokenizer)
        self.eos = greedy_eos(loaded.tokenizer, loaded.model)

    def pool_json(self) -> dict:
        p, k = self.pool, self.kv
        return {
            "blocks": p.num_blocks,
            "block_size": p.block_size,
            "tensor_bytes": p.tensor_bytes,
            "formula_bytes": p.formula_bytes,
            "block_bytes": p.block_bytes,
            "formula": f"2 (K,V) × {k.layers} layers × {k.kv_heads} kv heads × {k.head_dim} dims "
            f"× {k.element_bytes} B × {p.block_size} tokens = {p.block_bytes:,} B per block",
        }

    def intensity(self, feeds: list[Feed]) -> float:
        flops = costs.step_flops(self.shape, feeds)
        return flops / costs.step_bytes(self.shape, feeds, self.kv.token_bytes())

    def run_policy(self, name: str, on_step: OnStep | None, stop: threading.Event | None) -> PolicyResult:
        self.pool.free_all()
        self.pool.peak_used = 0
        policy = Policy.named(name, self.config.max_batch, self.config.step_tokens)
        try:
            scheduler = Scheduler(policy, self.specs, self.forward, self.eos, on_step, stop)
        except PoolError as e:
            raise LabError(str(e)) from None
        meter = ContentionMeter()
        requests = scheduler.run()
        busy = meter.stop().busy
        longest = max(len(s.prompt) for s in self.specs) + self.config.max_new
        return PolicyResult(
            name,
            tuple(requests),
            tuple(scheduler.steps),
            self.pool.peak_used,
            self.pool.block_bytes,
            longest,
            self.kv.token_bytes(),
            self.config.percentiles,
            self.config.slo,
            busy,
        )

    def warm_up(self) -> None:
        """One untimed prefill and decode, so the first policy does not pay for first-call setup."""
        prompt = self.specs[0].prompt[: self.pool.capacity_tokens - 1]
        self.pool.reserve(-1, len(prompt) + 1)
        token = int(self.forward.step([Feed(-1, prompt, 0)]).argmax())
        self.forward.step([Feed(-1, (token,), len(prompt))])
        self.pool.free(-1)

    def release(self) -> None:
        self.pool.release()


def run(
    loaded: LoadedModel,
    config: LabConfig,
    calibration: Calibration | None = None,
    on_start: Callable[[Lab], None] | None = None,
    on_step: OnStep | None = None,
    on_policy: Callable[[PolicyResult], None] | None = None,
    on_sweep: Callable[[sweep.SweepPoint], None] | None = None,
    stop: threading.Event | None = None,
    report: Callable[[str], None] = lambda line: None,
) -> LabResult:
    """The whole lab: policies first (same workload each), then the sweep; the pool is freed at the end.
    It runs on the configured threads, whatever a chat's governor left (engine/threads.py): a
    sweep compares its points on one footing, and says which were measured busy."""
    restore()
    lab = Lab(loaded, config)
    result = LabResult(
        config,
        loaded.info.name,
        loaded.info.precision,
        lab.pool_json(),
        lab.specs,
        calibration.balance if calibration is not None else None,
    )
    try:
        if on_start is not None:
            on_start(lab)
        lab.warm_up()
        for name in config.policies:
            report(f"policy {name}: {config.requests} requests ...")
            policy = lab.run_policy(name, on_step, stop)
            result.policies.append(policy)
            if on_policy is not None:
                on_policy(policy)
        _sweep(lab, result, on_sweep, stop, report)
    finally:
        lab.release()
    return result


def _sweep(
    lab: Lab,
    result: LabResult,
    on_sweep: Callable[[sweep.SweepPoint], None] | None,
    stop: threading.Event | None,
    report: Callable[[str], None],
) -> None:
    """Decode at each batch size of the sweep that fits the pool, on the shortest prompt."""
    config = lab.config
    prompt = min((s.prompt for s in lab.specs), key=len)
    batches = [b for b in config.sweep_batches if sweep.fits(b, prompt, config.sweep_steps, lab.forward)]
    result.sweep_skipped = [b for b in config.sweep_batches if b not in batches]
    report(f"sweep: decode at B = {batches}, {config.sweep_passes} passes ...")
    result.sweep = sweep.run_sweep(
        batches, prompt, config.sweep_steps, config.sweep_passes, lab.forward, lab.intensity, stop, on_sweep
    )


def device_memory_mib(device: str) -> float | None:
    """A GPU's memory in MiB (None for the CPU: the machine's memory is the lab's own check)."""
    if not device.startswith("cuda"):
        return None
    return torch.cuda.get_device_properties(device).total_memory / 2**20


def set_threads(threads: int) -> None:
    """torch's CPU threads for this process (`llmchat lab batching --threads`)."""
    configure(threads)


def bend(points: list[sweep.SweepPoint], threshold: float = 0.7) -> int | None:
    """Where the sweep's curve bends: the first B whose step from the previous B gained less than
    `threshold` of perfect scaling (doubling B: aggregate tok/s x (1 + threshold) or less). None
    if it never does over the B measured."""
    for a, b in zip(points, points[1:]):
        growth = b.aggregate_tok_s / a.aggregate_tok_s if a.aggregate_tok_s else 0.0
        ideal = b.batch / a.batch
        if growth < 1 + threshold * (ideal - 1):
            return b.batch
    return None
