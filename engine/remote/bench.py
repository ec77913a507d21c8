"""`llmchat bench --server`: what a real server does with long prompts, long answers and many
users at once, measured from the client beside the server's own figures.

- prefill: TTFT and prompt tok/s at several prompt lengths, each prompt fresh (a nonce at its
  start means nothing of it can come from the server's prefix cache);
- decode: tok/s and inter-token latency of one long answer;
- turns: the last turn of a conversation, its history in the server's prefix cache, against
  the very same prompt sent fresh;
- concurrency: N streams at once (N = 1, 2, 4, 8): aggregate tok/s and each stream's ITL.
  A server that batches continuously keeps per-stream ITL nearly flat while the aggregate
  grows; one that serves a single slot queues the streams instead.
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable

from engine.events import Failed, TurnFinished, TurnStats
from engine.remote.session import RemoteSession, connect
from engine.remote.target import RemoteTarget
from engine.sampling import SamplingSettings

WORDS = (
    "The history of computing is a story of abstraction layered on abstraction, from switches and "
    "vacuum tubes to transistors, integrated circuits, operating systems, compilers and networks."
).split()
QUESTIONS = (
    "What is the capital of France?",
    "Name three rivers in Europe.",
    "Why is the sky blue? Answer briefly.",
    "What is two plus two?",
)
STORY = "Write a long story about {}."
TOPICS = ("a dragon", "a lighthouse", "a clockmaker", "a comet", "a garden", "a ship", "a fox", "a city")

Report = Callable[[str], None]


class BenchError(RuntimeError):
    """A measurement the server would not complete; the message is one line."""


@dataclass(frozen=True)
class RemoteBenchConfig:
    target: RemoteTarget
    prompt_lengths: tuple[int, ...] = (64, 256, 1024)
    decode_tokens: int = 64
    repeats: int = 3
    turns: int = 3
    concurrency: tuple[int, ...] = (1, 2, 4, 8)

    def __post_init__(self) -> None:
        """Raise ValueError, starting with the field's name, for a value no measurement can use
        (as engine/bench.py's BenchConfig does)."""
        for name in ("prompt_lengths", "concurrency"):
            values = getattr(self, name)
            if not values:
                raise ValueError(f"{name} needs at least one value")
            for value in values:
                _at_least(name, value, 1)
        _at_least("decode_tokens", self.decode_tokens, 2)  # the inter-token latency needs two tokens
        _at_least("repeats", self.repeats, 1)
        _at_least("turns", self.turns, 1)


def _at_least(name: str, value: int, low: int) -> None:
    if value < low:
        raise ValueError(f"{name} must be at least {low}, got {value}")


def run(config: RemoteBenchConfig, report: Report = lambda line: None) -> dict:
    """Every measurement, as plain data (the CLI prints tables or JSON)."""
    bench = RemoteBench(config, report)
    info = bench.probe.info
    return {
        "server": dataclasses.asdict(info.server),
        "model": info.name,
        "context": info.context,
        "forces_length": bench.forces_length,
        "prefill": bench.prefill(),
        "decode": bench.decode(),
        "turns": bench.turns(),
        "concurrency": bench.concurrency(),
    }


def fresh_session(probe: RemoteSession, max_new_tokens: int, exact_length: bool) -> RemoteSession:
    """A fresh greedy conversation on the probe's connection; its nonce keeps it out of the prefix
    cache. `exact_length`: every answer as long as asked (ignore_eos; only where the server takes it)."""
    session = RemoteSession(
        probe.client,
        probe.server,
        probe.info,
        SamplingSettings(temperature=0, max_new_tokens=max_new_tokens),
        system_prompt=f"Session {uuid.uuid4().hex[:8]}.",
    )
    if exact_length and probe.server.dialect.ignore_eos:
        session.request_extra = {"ignore_eos": True}
    return session


def prompt_of(tokens: int) -> str:
    """Text of roughly `tokens` tokens (about 0.75 words per token in English BPE vocabularies)."""
    words = max(1, round(tokens * 0.75))
    return " ".join(WORDS[i % len(WORDS)] for i in range(words))


class RemoteBench:
    def __init__(self, config: RemoteBenchConfig, report: Report):
        self.config, self.report = config, report
        self.probe = connect(config.target)
        self.forces_length = self.probe.server.dialect.ignore_eos

    def session(self, max_new_tokens: int) -> RemoteSession:
        return fresh_session(self.probe, max_new_tokens, exact_length=self.forces_length)

    def ask(self, session: RemoteSession, text: str) -> TurnStats:
        finished = None
        for event in session.send(text):
            if isinstance(event, Failed):
                raise BenchError(event.message)
            if isinstance(event, TurnFinished):
                finished = event
        if finished is None or finished.error:
            raise BenchError(finished.error if finished else "the turn did not finish")
        return finished.stats

    # -- measurements -------------------------------------------------------------------
    def prefill(self) -> list[dict]:
        rows = []
        for length in self.config.prompt_lengths:
            runs = [self.ask(self.session(1), prompt_of(length)) for _ in range(self.config.repeats)]
            ttft = statistics.median(s.ttft_s for s in runs)
            tokens = runs[0].prompt_tokens
            row = {
                "asked_tokens": length,
                "prompt_tokens": tokens,
                "ttft_ms": ttft * 1000,
                "prefill_tok_s": tokens / ttft if tokens and ttft > 0 else None,
                **_server_prefill(runs),
            }
            rows.append(row)
            self.report(f"prefill {tokens} tokens: TTFT {row['ttft_ms']:.0f} ms")
        return rows

    def decode(self) -> dict:
        runs = [
            self.ask(self.session(self.config.decode_tokens), STORY.format(TOPICS[i % len(TOPICS)]))
            for i in range(self.config.repeats)
        ]
        row = {
            "tokens": statistics.median(s.generated_tokens for s in runs),
            "tok_s": statistics.median(s.decode_tok_s for s in runs),
            "itl_ms_p50": statistics.median(s.itl_p50_s for s in runs) * 1000,
            "itl_ms_p90": statistics.median(s.itl_p90_s for s in runs) * 1000,
            "server_itl_ms": _median_of(s.server.predicted_per_token_ms if s.server else None for s in runs),
        }
        self.report(f"decode: {row['tok_s']:.1f} tok/s, ITL p50 {row['itl_ms_p50']:.1f} ms")
        return row

    def turns(self) -> dict:
        """The last of `turns` turns with its history cached, against the same prompt sent fresh."""
        session = self.session(32)
        for i in range(self.config.turns):
            cached = self.ask(session, QUESTIONS[i % len(QUESTIONS)])
        fresh = self.session(32)
        fresh.system_prompt = f"Session {uuid.uuid4().hex[:8]}."  # same length, nothing cached
        fresh.messages = session.messages[:-1]  # the same conversation up to the last question
        fresh_stats = self._answer(fresh)
        row = {
            "turn": self.config.turns,
            "prompt_tokens": cached.prompt_tokens,
            "reused_tokens": cached.reused_tokens,
            "ttft_ms_reused": cached.ttft_s * 1000,
            "ttft_ms_fresh": fresh_stats.ttft_s * 1000,
            "fresh_reused_tokens": fresh_stats.reused_tokens,
            "speedup": fresh_stats.ttft_s / cached.ttft_s if cached.ttft_s > 0 else None,
        }
        cached_ms, fresh_ms = row["ttft_ms_reused"], row["ttft_ms_fresh"]
        self.report(f"turn {row['turn']}: TTFT {cached_ms:.0f} ms cached, {fresh_ms:.0f} ms fresh")
        return row

    def _answer(self, session: RemoteSession) -> TurnStats:
        for event in session.answer():
            if isinstance(event, TurnFinished):
                if event.error:
                    raise BenchError(event.error)
                return event.stats
        raise BenchError("the turn did not finish")

    def concurrency(self) -> list[dict]:
        return [self._streams(n) for n in self.config.concurrency]

    def _streams(self, n: int) -> dict:
        """N answers streamed at once, each on its own thread (and connection)."""
        results: list[TurnStats | BaseException] = [None] * n  # type: ignore[list-item]
        start = threading.Barrier(n)

        def one(i: int) -> None:
            session = self.session(self.config.decode_tokens)
            try:
                start.wait(30)
                results[i] = self.ask(session, STORY.format(TOPICS[i % len(TOPICS)]))
            except BaseException as e:  # reported below, in the caller's thread
                results[i] = e

        began = time.perf_counter()
        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - began
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            raise BenchError(f"{n} streams: {failures[0]}")
        generated = sum(r.generated_tokens for r in results)
        row = {
            "streams": n,
            "tokens": generated,
            "wall_s": wall,
            "aggregate_tok_s": generated / wall if wall > 0 else None,
            "ttft_ms_mean": statistics.mean(r.ttft_s for r in results) * 1000,
            "itl_ms_p50": statistics.median(r.itl_p50_s for r in results) * 1000,
            "itl_ms_p90": max(r.itl_p90_s for r in results) * 1000,
        }
        self.report(f"{n} streams: {row['aggregate_tok_s']:.1f} tok/s, ITL p50 {row['itl_ms_p50']:.1f} ms")
        return row


def _server_prefill(runs: list[TurnStats]) -> dict:
    """The server's own prefill figures (median), where it reports them."""
    prompt_ms = _median_of(s.server.prompt_ms if s.server else None for s in runs)
    tokens = runs[0].server.prompt_tokens if runs[0].server else None
    return {
        "server_prompt_ms": prompt_ms,
        "server_prefill_tok_s": tokens / prompt_ms * 1000 if tokens and prompt_ms else None,
    }


def _median_of(values) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None
