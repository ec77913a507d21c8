"""Did the arrivals or the engine set the pace? A workload whose users arrive slower than the
slowest policy serves them is arrival-bound: every policy keeps up, every one's throughput is
the offered load, and the table reads as if batching did nothing. The lab says so, and names a
saturating workload (all at once, more users, answers of widely mixed lengths) that compares them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from engine.lab.scheduler import Request
from engine.lab.workload import RequestSpec

SATURATING_BATCHES = 4
"""A saturating workload's users: this many full batches at once, so static batching waits for
the longest answer of each, where continuous batching refills a finished seat."""
SATURATING_MAX_NEW = 64
"""Its longest answer (at least): decode, where the policies differ, then outweighs the prefill
they all pay alike (SmolLM2 on 2 cores, 2026-12-04: continuous 0.95-1.29x static at 32, 1.36x
at 64; BENCHMARKS.md), and more answers end at the model's own end token, as real ones do."""


class Served(Protocol):
    """A policy's run as the verdict reads it (engine/lab/run.py's PolicyResult)."""

    @property
    def policy(self) -> str: ...

    @property
    def requests(self) -> Sequence[Request]: ...

    @property
    def makespan_s(self) -> float: ...


@dataclass(frozen=True)
class Verdict:
    arrival_bound: bool
    offered_req_s: float | None
    """The arrivals' own rate: (requests - 1) over the span of arrival times; None if all at once."""
    floors_s: dict[str, float]
    """Each policy's earliest finish the arrivals allow (`floor`)."""
    slack_s: float | None
    """How far past its floor a policy may finish and still have kept up: the longest answer alone."""
    behind: tuple[str, ...] = ()
    """The policies that fell behind the arrivals."""

    def summary(self) -> str:
        """One short line: who set the pace."""
        if self.offered_req_s is None:
            return "engine-bound: every request arrived at once"
        offered = f"the {self.offered_req_s:.1f} req/s offered"
        if self.arrival_bound:
            return f"arrival-bound: every policy kept up with {offered}"
        return f"engine-bound: {', '.join(self.behind)} fell behind {offered}"


def offered_load(specs: Sequence[RequestSpec]) -> float | None:
    """Requests per second the arrivals offered (the n - 1 gaps over their span)."""
    times = [s.arrival_s for s in specs]
    span = max(times) - min(times)
    return (len(times) - 1) / span if span > 0 else None


def answer_alone_s(policies: Sequence[Served]) -> dict[int, float]:
    """Each request's time from admission to its last token, the least over the policies
    (sequential serves each alone: there it is the answer's own time)."""
    alone: dict[int, float] = {}
    for policy in policies:
        for r in policy.requests:
            started = next((t for t, state in r.timeline if state not in ("queued", "preempted")), None)
            if started is not None and r.token_times:
                took = r.token_times[-1] - started
                alone[r.spec.id] = min(took, alone.get(r.spec.id, took))
    return alone


def earliest_starts(policy: str, specs: Sequence[RequestSpec], max_batch: int) -> dict[int, float]:
    """When each request could start on an engine that took no time: at its arrival, but under
    static batching when the last of its batch (arrival order, max_batch at a time) arrives."""
    ordered = sorted(specs, key=lambda s: (s.arrival_s, s.id))
    if policy != "static":
        return {s.id: s.arrival_s for s in ordered}
    batches = [ordered[i : i + max_batch] for i in range(0, len(ordered), max_batch)]
    return {s.id: batch[-1].arrival_s for batch in batches for s in batch}


def floor(policy: str, specs: Sequence[RequestSpec], max_batch: int, alone: dict[int, float]) -> float:
    """The earliest this policy could finish: the latest (earliest start + that answer alone)."""
    starts = earliest_starts(policy, specs, max_batch)
    return max(starts[s.id] + alone[s.id] for s in specs)


def judge(specs: Sequence[RequestSpec], policies: Sequence[Served], max_batch: int) -> Verdict:
    """Arrival-bound when the arrivals are spread out and every policy finished less than one
    answer (the longest, alone) past its floor: it ended at most one answer behind the arrivals
    (two users arriving close together queue one behind the other even on a policy that keeps
    up), so it kept up. A standing queue puts a policy many answers behind, however long the
    run; a margin in answers, not in percent of the run, says the same on a fast machine and a
    slow one, for 8 users or 800."""
    offered = offered_load(specs)
    alone = answer_alone_s(policies)
    if not policies or len(alone) < len(specs):  # stopped, or a request never answered
        return Verdict(False, offered, {}, None)
    floors = {p.policy: floor(p.policy, specs, max_batch, alone) for p in policies}
    slack = max(alone.values())
    behind = tuple(p.policy for p in policies if p.makespan_s > floors[p.policy] + slack)
    return Verdict(offered is not None and not behind, offered, floors, slack, behind)
