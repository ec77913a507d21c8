"""Simulated users: real questions of different lengths, arriving all at once or as a Poisson
stream, each wanting its own number of new tokens, from `min_new` (a quarter of `max_new`
unless set) up to `max_new` (answers differ in length, which is what lets continuous batching
refill a finished seat; a wider spread, as real answers have, gives it more seats to refill).
Seeded, so a run can be repeated exactly."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

QUESTIONS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "Why is the sky blue?",
    "How do I reverse a list in Python?",
    "Write a haiku about autumn rain.",
    "What does a CPU cache do?",
    "추론은 어떻게 작동하나요? 짧게 설명해 주세요.",
    "Explain the difference between a process and a thread, with an example of when you would "
    "choose each one in a web server.",
    "I am planning a three-day trip to Kyoto in November. I like temples, quiet gardens and "
    "vegetarian food, and I do not want to spend more than two hours a day on trains or buses. "
    "Suggest a plan for each day, with one place to eat near each stop.",
    "Here is a paragraph from my essay: 'Large language models generate text one token at a "
    "time. Each new token requires a full pass through the network, but the keys and values of "
    "the earlier tokens are cached, so only the newest token has to be computed.' Rewrite it "
    "for a reader who has never heard of neural networks, keeping it under eighty words, and "
    "then list the two ideas a student should remember from it.",
)
"""Short and long ones, and a Korean one: prompt lengths from about 20 to about 150 tokens."""

Arrivals = Literal["once", "poisson"]


@dataclass(frozen=True)
class RequestSpec:
    id: int
    question: str
    prompt: tuple[int, ...]
    """The chat-templated prompt's token ids."""
    arrival_s: float
    max_new: int
    """This user's answer length (it stops earlier at the end token)."""


@dataclass(frozen=True)
class WorkloadConfig:
    requests: int = 8
    max_new: int = 24
    arrivals: Arrivals = "once"
    rate: float = 4.0
    """Poisson arrivals: mean requests per second."""
    seed: int = 0
    min_new: int | None = None
    """The shortest answer a user wants; None: a quarter of max_new."""

    def __post_init__(self) -> None:
        if self.requests < 1:
            raise ValueError(f"requests must be at least 1, got {self.requests}")
        if self.max_new < 1:
            raise ValueError(f"max_new must be at least 1 token, got {self.max_new}")
        if self.min_new is not None and not 1 <= self.min_new <= self.max_new:
            raise ValueError(f"min-new must be 1 .. max-new ({self.max_new}) tokens, got {self.min_new}")
        if self.arrivals not in ("once", "poisson"):
            raise ValueError(f"arrivals must be 'once' or 'poisson', got {self.arrivals!r}")
        if self.arrivals == "poisson" and not self.rate > 0:
            raise ValueError(f"rate must be above 0 requests per second, got {self.rate}")

    @property
    def shortest(self) -> int:
        """The shortest answer drawn."""
        return max(1, self.max_new // 4) if self.min_new is None else self.min_new


def prompt_ids(tokenizer, question: str) -> tuple[int, ...]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
    )
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return tuple(int(i) for i in ids)


def build(config: WorkloadConfig, tokenizer) -> list[RequestSpec]:
    """The requests, in arrival order: questions drawn in a seeded shuffle (every question once
    before any repeats), answer lengths drawn from `shortest` .. max_new, arrivals at 0 or at
    Poisson times."""
    rng = random.Random(config.seed)
    order: list[str] = []
    while len(order) < config.requests:
        batch = list(QUESTIONS)
        rng.shuffle(batch)
        order += batch
    t = 0.0
    specs = []
    for i, question in enumerate(order[: config.requests]):
        if config.arrivals == "poisson" and i > 0:
            t += rng.expovariate(config.rate)
        wanted = rng.randint(config.shortest, config.max_new)
        specs.append(RequestSpec(i, question, prompt_ids(tokenizer, question), t, wanted))
    return specs
