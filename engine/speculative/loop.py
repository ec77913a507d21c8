"""The speculative decode loop: the plain loop of engine/session.py, a round at a time.

    x = the last token emitted (not yet fed)
    round: drafts = drafter(context, K)               -> draft time
           logits = forward([x, *drafts])             -> one pass over the cache: verify time
           kept, draws = verify(logits, drafts)       (engine/speculative/verify.py)
           cache.crop(to x and the kept drafts)       the rejected drafts' K/V go
           emit the kept drafts and the correction, one `token` event each, as plain would

A round feeds K+1 tokens but reads the weights once, as one decode step does: on a
memory-bound device it costs about one step, and emits 1 to K+1 tokens. K shrinks while drafts
are rejected (`DraftLength`), and a round with nothing drafted is a plain decode step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generator, Protocol

import torch

from engine.answer_stream import AnswerStream
from engine.detok import StreamingDetokenizer
from engine.events import DraftRound, Event, PhaseChanged, StopReason
from engine.sampling import Draw, Sampler
from engine.speculative.drafters import Drafts, check_draft_tokens
from engine.speculative.verify import verify

if TYPE_CHECKING:
    from engine.session import ChatSession


class Drafter(Protocol):
    name: str

    def propose(self, context: list[int], k: int, sampler: Sampler) -> Drafts: ...


@dataclass
class SpecStats:
    """Counts over the answers decoded speculatively (reset per turn by the loop)."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0

    @property
    def acceptance(self) -> float:
        """Drafted tokens the model kept, as a fraction."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Tokens emitted per target forward (plain decoding: 1)."""
        return self.emitted / self.rounds if self.rounds else 0.0


REST_ROUNDS = 4
"""Plain steps a drafter sits out the first time its guesses stop being kept; each retry that
fails again doubles the rest, up to MAX_REST."""
MAX_REST = 64


@dataclass
class DraftLength:
    """How many tokens the next round drafts, so that a drafter whose guesses miss (lookup on an
    open question) costs plain decode steps rather than failed verifies (an eager verify of K+1
    rows costs 2-3 steps here): K while drafts are kept, halved after a round that kept fewer than
    half; a round that kept none starts a rest of plain steps, after which one token is tried
    (a miss doubles the next rest, a kept draft resets it)."""

    k: int
    now: int = 0
    resting: int = 0
    rest: int = REST_ROUNDS

    def __post_init__(self) -> None:
        self.now = self.now or self.k

    def next(self) -> int:
        return 0 if self.resting else self.now

    def after(self, drafted: int, accepted: int) -> None:
        """Learn from a round that drafted `drafted` tokens and kept `accepted` of them."""
        if self.resting:
            self.resting -= 1
            self.now = 0 if self.resting else 1
        elif drafted and accepted == drafted:
            self.now, self.rest = min(self.k, self.now * 2), REST_ROUNDS
        elif drafted and not accepted:
            self.now, self.resting, self.rest = 0, self.rest, min(self.rest * 2, MAX_REST)
        elif accepted * 2 < drafted:
            self.now = max(1, self.now // 2)


@dataclass
class Speculation:
    """The setting: who drafts and how many tokens a round; the session decodes with it when set."""

    drafter: Drafter
    k: int = 4
    stats: SpecStats = field(default_factory=SpecStats)
    length: DraftLength = field(init=False)
    """This answer's draft length (reset per answer, as the stats are)."""

    def __post_init__(self) -> None:
        check_draft_tokens(self.k)
        self.length = DraftLength(self.k)

    @property
    def label(self) -> str:
        return f"{self.drafter.name}, K {self.k}"

    def decode(
        self, session: ChatSession, *args
    ) -> Generator[Event, None, tuple[str, list[float], StopReason]]:
        """The session's decode strategy while this setting is on (ChatSession._decode chooses)."""
        return speculative_decode(self, session, *args)


def speculative_decode(
    spec: Speculation,
    session: ChatSession,
    logits: torch.Tensor,
    prompt_ids: list[int],
    started: float,
    stop_at_eos: bool,
    first: int,
    detok: StreamingDetokenizer | None,
) -> Generator[Event, None, tuple[str, list[float], StopReason]]:
    """Speculative `ChatSession.decode_plain`: the same tokens (temperature 0) or distribution, in rounds."""
    spec.stats, spec.length = SpecStats(), DraftLength(spec.k)
    session.want_compiled_verify()
    sampler = Sampler(session.sampling, session.show_top_k)
    context = list(prompt_ids)
    detok = detok if detok is not None else StreamingDetokenizer(session.tokenizer)
    out = AnswerStream(session, detok, started)
    index = first
    draws = [sampler.sample(logits, session.repetition_ids(context, session.sampling))]
    while True:
        for draw in draws:
            position = len(context)  # where plain decoding would have this token
            finished = stop_at_eos and draw.id in session.stop_ids
            stop = session.stop_reason(finished, index + 1, position)
            yield out.token(index, draw, finished, stop, position)
            if index == first:
                yield PhaseChanged("decode")
            index += 1
            if stop is None and session.cancel.is_set():
                stop = "cancelled"
            if stop:
                session.cache.crop(position)  # what plain decoding holds: every token but the last
                return out.text(), out.latencies, stop
            context.append(draw.id)
        draws = yield from _round(session, sampler, spec, context, index - first)


def _round(
    session: ChatSession, sampler: Sampler, spec: Speculation, context: list[int], generated: int
) -> Generator[Event, None, list[Draw]]:
    """Draft, verify in one forward, crop the cache to what was kept; the Draws to emit."""
    sampler.settings = settings = session.sampling
    k = min(spec.length.next(), settings.max_new_tokens - generated - 1, session.context - len(context) - 2)
    t0 = time.perf_counter()
    drafts = spec.drafter.propose(context, k, sampler) if k > 0 else Drafts([], None)
    t1 = time.perf_counter()
    base = len(context) - 1  # the cache holds all but the last emitted token
    fed = [context[-1], *drafts.ids]
    # Nothing drafted: a plain decode step (the compiled one where it serves), not a verify pass.
    scores = forward_all(session, fed) if drafts.ids else session.forward(fed)[None].float()
    accepted, draws = verify(
        sampler, scores, drafts, lambda kept: session.repetition_ids(context + kept, settings)
    )
    session.cache.crop(base + 1 + accepted)
    spec.length.after(len(drafts.ids), accepted)
    t2 = time.perf_counter()
    s = spec.stats
    s.rounds += 1
    s.drafted += len(drafts.ids)
    s.accepted += accepted
    s.emitted += len(draws)
    s.draft_s += t1 - t0
    s.verify_s += t2 - t1
    if drafts.ids:
        pieces = tuple(session.namer.piece(i) for i in drafts.ids)
        yield DraftRound(
            generated, spec.drafter.name, tuple(drafts.ids), pieces, accepted, draws[-1].id, t1 - t0, t2 - t1
        )
    yield session.cache_event()
    return draws


def forward_all(session: ChatSession, ids: list[int]) -> torch.Tensor:
    """One forward pass over `ids` with the session's cache; logits [len(ids), vocab] of each."""
    return session.forward(ids, every=True).float()


def parse_choice(choice: str) -> tuple[str, str | None]:
    """`lookup`, or a draft model `MODEL[@PRECISION]`: (model spec, precision or None)."""
    spec, at, precision = choice.rpartition("@")
    return (spec, precision) if at and spec else (choice, None)


def make_speculation(choice: str, k: int, target, progress=None, compile: bool = False) -> Speculation:
    """The setting for `--speculative lookup|MODEL[@PRECISION]`; a draft model loads on the
    target's device, at w8 on a CPU (the cheap copy) or the target's precision on a GPU, and
    with `compile` (as the target's session) builds its own compiled step.
    Raises ValueError (bad K, another tokenizer) or the loader's one-line errors."""
    from engine import models
    from engine.speculative.drafters import DraftModel, PromptLookup

    check_draft_tokens(k)
    if choice == "lookup":
        return Speculation(PromptLookup(), k)
    spec, precision = parse_choice(choice)
    device = target.info.device
    precision = precision or ("w8" if device == "cpu" else target.info.precision)
    draft = models.load(spec, precision, device, progress=progress)
    return Speculation(DraftModel(draft, target.info.vocab_size, target.tokenizer, compile), k)
