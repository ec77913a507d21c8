"""The token inspector's data: every step of an answer, kept as it was emitted.

The decode loop appends each `TokenSampled` event to the answer's trace (a list append,
nothing more per token). Everything else the inspector shows is derived on demand:
the token's bytes, its probability, and the entropy in bits.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from engine.detok import PieceNamer
from engine.events import Candidate, TokenSampled


@dataclass(frozen=True)
class TokenRecord:
    """One step of an answer as the inspector shows it."""

    step: int
    id: int | None
    """None where a server sent the token's text but not its id."""
    piece: str
    """Readable text of the token; stray bytes of a split UTF-8 character show as `<0xEC>`."""
    bytes: bytes | None
    """The raw bytes the token stands for; None for a special token such as `<|im_end|>` (or,
    from a server, for one whose bytes it did not send)."""
    logprob: float | None
    """ln p of the token under the distribution it was drawn from; None where a server sent none."""
    rank: int
    """1 when it was the most probable token; 0 when unknown."""
    entropy: float | None
    """Entropy of that distribution in nats: -sum p ln p over the whole vocabulary (None from a
    server: its few alternatives do not give it)."""
    position: int | None
    """The KV cache slot the token occupies once fed back."""
    top_k: tuple[Candidate, ...]
    latency_s: float
    text: str
    """Text this step completed in the stream (empty while a UTF-8 character is incomplete)."""

    @property
    def prob(self) -> float | None:
        return None if self.logprob is None else math.exp(self.logprob)

    @property
    def entropy_bits(self) -> float | None:
        return None if self.entropy is None else self.entropy / math.log(2)

    @property
    def choices(self) -> float | None:
        """exp(entropy): as uncertain as a fair choice among this many tokens."""
        return None if self.entropy is None else math.exp(self.entropy)


@dataclass
class AnswerTrace:
    """The steps of one answer, the prompt it continued, and where it was forked from."""

    prompt_ids: tuple[int, ...]
    """The templated conversation the answer continued (what the model saw before step 0)."""
    reused: int | None
    """How many of `prompt_ids` came from the KV cache when the answer started (None: a server
    did not say)."""
    steps: list[TokenSampled] = field(default_factory=list)
    parent: AnswerTrace | None = None
    """For a forked answer: the answer it branched from (its text is the other branch)."""
    fork_step: int | None = None
    """For a forked answer: the step where it took another token than its parent."""

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def ids(self) -> list[int]:
        return [s.id for s in self.steps]

    def record(self, step: int, namer: PieceNamer) -> TokenRecord:
        """Everything the inspector shows for `step` (negative counts from the end)."""
        s = self.steps[step]
        return TokenRecord(
            step=s.index,
            id=s.id,
            piece=s.piece,
            bytes=s.sent_bytes if s.id is None else namer.token_bytes(s.id),
            logprob=s.logprob,
            rank=s.rank,
            entropy=s.entropy,
            position=s.position,
            top_k=s.top_k,
            latency_s=s.latency_s,
            text=s.text,
        )

    def forked(self, step: int, forced: TokenSampled, continuation: AnswerTrace) -> AnswerTrace:
        """The trace of a fork: this answer's steps before `step`, the forced one, then what followed."""
        steps = [*self.steps[:step], forced, *continuation.steps]
        return AnswerTrace(self.prompt_ids, self.reused, steps, parent=self, fork_step=step)


def forced_step(step: TokenSampled, token_id: int, piece: str) -> TokenSampled:
    """`step` with `token_id` taken instead: same distribution, that token's logprob and rank.

    The token must be the one sampled there or one of the step's top-k alternatives; nothing
    is computed for it (latency 0). The caller fills in `text` from its detokenizer.
    """
    if token_id == step.id:
        return dataclasses.replace(step, latency_s=0.0)
    for rank, candidate in enumerate(step.top_k, start=1):
        if candidate.id == token_id:
            return dataclasses.replace(
                step, id=token_id, piece=piece, logprob=math.log(candidate.prob), rank=rank, latency_s=0.0
            )
    raise ValueError(f"token {token_id} is not among the alternatives of step {step.index}")
