"""Three ways to serve the same users, each run for real on the batched forward pass.

* sequential: one request at a time, start to finish.
* static: wait for B requests, run them together until every one has finished, then the next B.
* continuous: every step, admit waiting requests while the pool has blocks for their prompt and
  the batch has room; a finished request leaves at once; a prompt is prefilled in chunks that
  share the step with the others' decode tokens; when the pool runs out, the newest request
  is preempted (its blocks freed) and later recomputed from its prompt and the tokens it had.

The clock is the sum of the measured step times; while nothing runs it jumps to the next
arrival (no sleeping), so TTFT = first token's clock - arrival, ITL = the gaps between a
request's tokens. Static and sequential admit a batch only if the worst case (prompt + max new
tokens of each) fits the pool, so they never preempt.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Literal

from engine.lab.batched import BatchedForward, Feed
from engine.lab.pool import PagedKVPool, PoolError, blocks_for
from engine.lab.workload import RequestSpec
from engine.serving_metrics import RequestOutcome

PolicyName = Literal["sequential", "static", "continuous"]
POLICY_NAMES: tuple[PolicyName, ...] = ("sequential", "static", "continuous")
State = Literal["queued", "prefill", "decode", "preempted", "done"]


class LabStopped(Exception):
    """The user stopped the lab (Esc)."""


@dataclass(frozen=True)
class Policy:
    name: PolicyName
    max_batch: int
    step_tokens: int = 64
    """Most tokens one step feeds: decode tokens first, prefill chunks share what is left."""

    @property
    def continuous(self) -> bool:
        return self.name == "continuous"

    @classmethod
    def named(cls, name: PolicyName, max_batch: int, step_tokens: int = 64) -> "Policy":
        return cls(name, 1 if name == "sequential" else max_batch, step_tokens)


@dataclass
class Request:
    """One simulated user's request as the scheduler moves it along."""

    spec: RequestSpec
    out: list[int] = field(default_factory=list)
    cached: int = 0
    """Positions of prompt + out held in the pool."""
    state: State = "queued"
    timeline: list[tuple[float, State]] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    preemptions: int = 0
    admitted: int = -1
    """Admission order (the newest is preempted first)."""

    @property
    def sequence(self) -> list[int]:
        return list(self.spec.prompt) + self.out

    @property
    def finished(self) -> bool:
        return self.state == "done"

    def move(self, t: float, state: State) -> None:
        if state != self.state or not self.timeline:
            self.timeline.append((t, state))
        self.state = state

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.spec.arrival_s if self.token_times else None

    @property
    def itls_s(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    def outcome(self) -> RequestOutcome:
        """As a client would have seen it: sent at its arrival, ended with its last token."""
        done = self.finished and self.token_times
        return RequestOutcome(
            start_s=self.spec.arrival_s,
            prompt_tokens=len(self.spec.prompt),
            output_tokens=len(self.out),
            ttft_s=self.ttft_s,
            itls_s=tuple(self.itls_s),
            latency_s=self.token_times[-1] - self.spec.arrival_s if done else None,
            error="" if done else "it did not finish",
        )


@dataclass(frozen=True)
class StepRecord:
    index: int
    clock_s: float
    """The clock at the step's end."""
    seconds: float
    batch: int
    """Sequences in the step."""
    tokens: int
    decode_tokens: int
    prefill_tokens: int
    generated: int
    """Tokens sampled by the step (decode tokens + prompts that finished prefill)."""
    used_blocks: int
    preempted: int
    feeds: tuple[Feed, ...]

    @property
    def tok_s(self) -> float:
        return self.generated / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class RequestView:
    """What the UI may keep of a request: a frozen copy."""

    id: int
    question: str
    prompt_tokens: int
    arrival_s: float
    state: State
    timeline: tuple[tuple[float, State], ...]
    generated: int
    max_new: int
    preemptions: int
    ttft_s: float | None
    itl_p50_s: float | None
    blocks: tuple[int, ...]
    output: tuple[int, ...]

    @classmethod
    def of(cls, r: Request, pool: PagedKVPool) -> "RequestView":
        itls = sorted(r.itls_s)
        return cls(
            r.spec.id,
            r.spec.question,
            len(r.spec.prompt),
            r.spec.arrival_s,
            r.state,
            tuple(r.timeline),
            len(r.out),
            r.spec.max_new,
            r.preemptions,
            r.ttft_s,
            itls[len(itls) // 2] if itls else None,
            tuple(pool.tables.get(r.spec.id, ())),
            tuple(r.out),
        )


OnStep = Callable[[PolicyName, StepRecord, tuple[RequestView, ...]], None]


def check_fits(specs: list[RequestSpec], pool: PagedKVPool) -> None:
    """PoolError, naming the request, if one request alone could never finish in the pool."""
    for spec in specs:
        need = blocks_for(len(spec.prompt) + spec.max_new, pool.block_size)
        if need > pool.num_blocks:
            raise PoolError(
                f"request {spec.id} needs {need} blocks ({len(spec.prompt)} prompt + {spec.max_new} new "
                f"tokens) but the budget holds {pool.num_blocks}: raise --budget-mib or lower --max-new"
            )


class Scheduler:
    """Runs one policy over a workload on the pool; `run()` returns every request, finished."""

    def __init__(
        self,
        policy: Policy,
        specs: list[RequestSpec],
        forward: BatchedForward,
        eos: set[int],
        on_step: OnStep | None = None,
        stop: threading.Event | None = None,
    ):
        if policy.max_batch < 1:
            raise ValueError(f"max batch must be at least 1, got {policy.max_batch}")
        self.policy = policy
        self.forward = forward
        self.pool: PagedKVPool = forward.pool
        check_fits(specs, self.pool)
        self.requests = [Request(s) for s in sorted(specs, key=lambda s: (s.arrival_s, s.id))]
        self.eos = eos
        self.on_step = on_step
        self.stop = stop or threading.Event()
        self.clock = 0.0
        self.steps: list[StepRecord] = []
        self.pending = list(self.requests)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._admitted = 0

    # -- the loop ----------------------------------------------------------------------
    def run(self) -> list[Request]:
        for r in self.requests:
            r.move(r.spec.arrival_s, "queued")
        while self.pending or self.waiting or self.running:
            if self.stop.is_set():
                raise LabStopped()
            self._arrive()
            self._admit()
            if not self.running:
                if not self.pending:  # check_fits makes this unreachable; never spin
                    raise PoolError("the waiting requests cannot be admitted: the pool is too small")
                self.clock = max(self.clock, self.pending[0].spec.arrival_s)
                continue
            self._step()
        return self.requests

    def _arrive(self) -> None:
        while self.pending and self.pending[0].spec.arrival_s <= self.clock:
            self.waiting.append(self.pending.pop(0))

    def _admit(self) -> None:
        if self.policy.continuous:
            while self.waiting and len(self.running) < self.policy.max_batch:
                head = self.waiting[0]
                if blocks_for(len(head.sequence) + 1, self.pool.block_size) > self.pool.free_blocks:
                    return  # first come, first served: nobody overtakes the head
                self._start(self.waiting.pop(0))
            return
        if self.running or not self.waiting:
            return
        if len(self.waiting) < self.policy.max_batch and self.pending:
            return  # static: wait for a full batch while more users are coming
        free = self.pool.free_blocks
        while self.waiting and len(self.running) < self.policy.max_batch:
            head = self.waiting[0].spec
            worst = blocks_for(len(head.prompt) + head.max_new, self.pool.block_size)
            if worst > free:
                break
            free -= worst
            self._start(self.waiting.pop(0))

    def _start(self, r: Request) -> None:
        r.admitted = self._admitted
        self._admitted += 1
        self.running.append(r)
        r.move(self.clock, "prefill" if len(r.sequence) - r.cached > 1 else "decode")

    # -- one step ------------------------------------------------------------------------
    def _plan(self) -> list[tuple[Request, Feed]]:
        """Decode tokens of every running request first, then prefill chunks in admission order."""
        decoding = [r for r in self.running if len(r.sequence) - r.cached == 1]
        prefilling = [r for r in self.running if len(r.sequence) - r.cached > 1]
        plan = [(r, Feed(r.spec.id, (r.sequence[-1],), r.cached)) for r in decoding]
        room = self.policy.step_tokens - len(plan)
        for r in sorted(prefilling, key=lambda r: r.admitted):
            if room <= 0 and plan:
                break
            sequence = r.sequence
            chunk = sequence[r.cached : r.cached + max(room, 1)]
            plan.append((r, Feed(r.spec.id, tuple(chunk), r.cached)))
            room -= len(chunk)
        return plan

    def _reserve(self, plan: list[tuple[Request, Feed]]) -> tuple[list[tuple[Request, Feed]], int]:
        """Blocks for every feed, oldest request first; when the pool runs out (continuous
        only: the others admitted the worst case), preempt the newest request and retry."""
        preempted = 0
        for r, feed in sorted(plan, key=lambda item: item[0].admitted):
            while r in self.running:
                try:
                    self.pool.reserve(r.spec.id, feed.stop)
                    break
                except PoolError:
                    if not self.policy.continuous:
                        raise
                    self._preempt(max(self.running, key=lambda x: x.admitted))
                    preempted += 1
        return [(r, f) for r, f in plan if r in self.running], preempted

    def _preempt(self, victim: Request) -> None:
        self.pool.free(victim.spec.id)
        victim.cached = 0
        victim.preemptions += 1
        self.running.remove(victim)
        victim.move(self.clock, "preempted")
        self.waiting.insert(0, victim)  # first back in: it came earliest of those waiting

    def _step(self) -> None:
        plan, preempted = self._reserve(self._plan())
        feeds = [f for _, f in plan]
        started = time.perf_counter()
        logits = self.forward.step(feeds)
        chosen = logits.argmax(dim=-1).tolist()
        seconds = time.perf_counter() - started
        self.clock += seconds
        generated = 0
        for (r, feed), token in zip(plan, chosen):
            r.cached = feed.stop
            if r.cached < len(r.sequence):  # a prefill chunk with more to come
                continue
            generated += 1
            r.out.append(int(token))
            r.token_times.append(self.clock)
            if token in self.eos or len(r.out) >= r.spec.max_new:
                self._finish(r)
            else:
                r.move(self.clock, "decode")
        record = StepRecord(
            index=len(self.steps),
            clock_s=self.clock,
            seconds=seconds,
            batch=len(feeds),
            tokens=sum(len(f.tokens) for f in feeds),
            decode_tokens=sum(1 for f in feeds if len(f.tokens) == 1),
            prefill_tokens=sum(len(f.tokens) for f in feeds if len(f.tokens) > 1),
            generated=generated,
            used_blocks=self.pool.used_blocks,
            preempted=preempted,
            feeds=tuple(feeds),
        )
        self.steps.append(record)
        if self.on_step is not None:
            self.on_step(self.policy.name, record, self.views())

    def _finish(self, r: Request) -> None:
        self.pool.free(r.spec.id)
        self.running.remove(r)
        r.move(self.clock, "done")

    def views(self) -> tuple[RequestView, ...]:
        return tuple(RequestView.of(r, self.pool) for r in self.requests)


def greedy_eos(tokenizer, model) -> set[int]:
    """The token ids that end an answer (the generation config's and the tokenizer's)."""
    ids = getattr(model.generation_config, "eos_token_id", None)
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
