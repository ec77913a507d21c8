"""What a decode loop emits per token, the plain loop's and speculation's alike: the token
event (kept in the answer's trace for the inspector), the text so far, the latencies."""

from __future__ import annotations

import time
from typing import Protocol, Sized

from engine.detok import PieceNamer, StreamingDetokenizer
from engine.events import Candidate, StopReason, TokenSampled
from engine.instruments.trace import AnswerTrace
from engine.sampling import Draw
from engine.thinking import ThoughtSplitter


class Decoder(Protocol):
    """What the stream reads of the session that decodes (engine/session.py `ChatSession`)."""

    namer: PieceNamer
    cache: Sized
    trace: AnswerTrace | None
    thoughts: ThoughtSplitter
    """Which tokens of this answer are thought (set for each answer by the session)."""

    def candidates(self, draw: Draw) -> tuple[Candidate, ...]: ...


class AnswerStream:
    """What the decode loop emits per token: the text so far, the latencies, the token events
    (also kept in the answer's trace for the inspector)."""

    def __init__(self, session: Decoder, detok: StreamingDetokenizer, started: float):
        self.session, self.detok = session, detok
        self.steps = session.trace.steps if session.trace is not None else []
        self.pieces: list[str] = []
        self.latencies: list[float] = []
        self.last = started

    def waited(self, seconds: float) -> None:
        self.last += seconds  # time spent waiting for the student is not latency

    def token(
        self, index: int, draw: Draw, finished: bool, stop: StopReason | None, position: int | None = None
    ) -> TokenSampled:
        text = "" if finished else self.detok.add(draw.id)
        if stop:  # the last token carries any bytes still held back, so the stream is whole
            text += self.detok.flush()
        now = time.perf_counter()
        self.latencies.append(now - self.last)
        self.last = now
        self.pieces.append(text)
        session = self.session
        event = TokenSampled(
            index=index,
            id=draw.id,
            piece=session.namer.piece(draw.id),
            text=text,
            logprob=draw.logprob,
            top_k=session.candidates(draw),
            latency_s=self.latencies[-1],
            position=len(session.cache) if position is None else position,
            entropy=draw.entropy,
            rank=draw.rank,
            thinking=session.thoughts.is_thought(draw.id, text),
        )
        self.steps.append(event)
        return event

    def text(self) -> str:
        return "".join(self.pieces)
