"""One answer from a server, as it streams: the events the panels see and the figures kept.

The client measures what it can see: TTFT from sending the request to the first token, and
inter-token latency between chunks. Tokens are counted by logprob entries (or by the server's
own count, where llama.cpp's timings give it), and a chunk's gap is shared by the tokens it
carried, since vLLM may send several at once. The server's own figures travel beside these,
never instead of them: the difference is network and queueing.
"""

from __future__ import annotations

import codecs
import math
import statistics
import time
from dataclasses import dataclass
from typing import Iterator

from engine.events import (
    Event,
    PhaseChanged,
    PrefillProgress,
    PromptTokens,
    ServerTimings,
    StopReason,
    TokenSampled,
    TurnStats,
)
from engine.remote.chunks import Chunk, Entry, Progress, Usage, whole
from engine.remote.token_bytes import SeenTokens
from engine.thinking import ThoughtSplitter, kept, thinking_figures


@dataclass(frozen=True)
class Prompt:
    """The templated conversation as the server will see it, where it could be tokenized."""

    ids: tuple[int, ...]
    pieces: tuple[str, ...]

    @property
    def known(self) -> bool:
        return bool(self.ids)


class RemoteTurn:
    """Turns chunks into events; keeps the text, latencies and what the server reported."""

    def __init__(
        self, prompt: Prompt, started: float, wait_for_progress: bool, seen: SeenTokens | None = None
    ):
        self.prompt = prompt
        self.steps: list[TokenSampled] = []
        """The token events, as the inspector reads them (the answer's trace holds this list)."""
        self.seen = seen if seen is not None else SeenTokens()
        self.started = self.last = started
        self.announced = False
        self.wait_for_progress = wait_for_progress
        """llama.cpp says how much of the prompt it had cached in its first chunk: wait for it."""
        self.texts: list[tuple[bool, str]] = []
        """Each token's (thought?, text)."""
        self.thoughts = ThoughtSplitter()
        """`<think>` in the content, from a server that does not part thought from answer itself."""
        self.parted = False
        """The server sends thought in a field of its own (it parses the block out): trust it alone."""
        self.unsaid: list[tuple[int, Entry, str, float]] = []
        """Tokens sent without any text (llama.cpp holds back what its parser has not placed yet,
        and sends the `<think>` it strips as logprobs alone): whether they are thought comes with
        the next text, and they go out with it."""
        self.itl: list[float] = []
        self.ttft_s: float | None = None
        self.entries = 0
        self.server_tokens = 0
        """llama.cpp's predicted_n so far: tokens, where a split character's entry counts several."""
        self.progress: Progress | None = None
        self.timings: dict | None = None
        self.usage: Usage | None = None
        self.finish: str | None = None
        self.fingerprint: str | None = None
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    # -- events ---------------------------------------------------------------------------
    def sent(self) -> None:
        """The request leaves now: TTFT counts from here."""
        self.started = self.last = time.perf_counter()

    def opened(self) -> Iterator[Event]:
        """The request is on its way: the prefill phase, unless the first chunk will say more."""
        if not self.wait_for_progress:
            yield from self.announce()

    def add(self, chunk: Chunk) -> Iterator[Event]:
        now = time.perf_counter()
        self._keep(chunk)
        if chunk.progress is not None:
            yield from self._progressed(chunk.progress)
        if not self.announced and (chunk.entries or chunk.finish or chunk.usage):
            yield from self.announce()
        if chunk.entries:
            yield from self._tokens(chunk, now)

    def announce(self) -> Iterator[Event]:
        self.announced = True
        reused = self.progress.cache if self.progress else None
        total = self._prompt_length()
        if self.prompt.known:
            yield PromptTokens(self.prompt.ids, self.prompt.pieces, reused)
        new = total - reused if total is not None and reused is not None else total
        yield PhaseChanged("prefill", new, reused)

    def _progressed(self, progress: Progress) -> Iterator[Event]:
        first = self.progress is None
        self.progress = progress
        if first and not self.announced:
            yield from self.announce()
        new, done = progress.total - progress.cache, progress.processed - progress.cache
        if done > 0 and new > 0:  # `processed` counts the cached tokens too
            yield PrefillProgress(min(new, done), new)

    def _tokens(self, chunk: Chunk, now: float) -> Iterator[Event]:
        gap, self.last = now - self.last, now
        first_chunk = self.entries == 0
        tokens = self._tokens_in(chunk)
        for entry, text in zip(chunk.entries, self._texts(chunk)):
            index = self.entries
            self.entries += 1
            if first_chunk:  # the first token's latency is the TTFT; any sent with it came at once
                latency = gap if index == 0 else 0.0
            else:
                latency = gap / len(chunk.entries)
            self.seen.learn(entry.id, entry.own)
            if index == 0:
                self.ttft_s = gap
            self.unsaid.append((index, entry, text, latency))
            if chunk.text:
                yield from self._say(self._thinking(entry))
        if not first_chunk:  # a chunk's gap is shared by the tokens it carried
            self.itl.extend([gap / tokens] * tokens)

    def _say(self, thinking: bool) -> Iterator[Event]:
        """The tokens waiting to go out, as thought or as answer."""
        for index, entry, text, latency in self.unsaid:
            event = self._event(index, entry, text, latency, thinking)
            self.texts.append((thinking, text))
            self.steps.append(event)
            yield event
            if index == 0:
                yield PhaseChanged("decode")
        self.unsaid.clear()

    def flush(self) -> Iterator[Event]:
        """The answer ended: tokens still without text go out as what came before them was."""
        if self.unsaid:
            yield from self._say(self.steps[-1].thinking if self.steps else self._thinking(self.unsaid[0][1]))

    def _event(self, index: int, entry: Entry, text: str, latency: float, thinking: bool) -> TokenSampled:
        rank = next((r for r, c in enumerate(entry.top, 1) if _same(c.id, c.piece, entry)), 0)
        return TokenSampled(
            index=index,
            id=entry.id,
            piece=entry.piece,
            text=text,
            logprob=entry.logprob,
            top_k=entry.top,
            latency_s=latency,
            position=self._position(index),
            entropy=None,  # the top few alternatives do not give the whole distribution's entropy
            rank=rank,
            sent_bytes=entry.own if entry.id is None else None,
            thinking=thinking,
        )

    def _thinking(self, entry: Entry) -> bool:
        """Thought where the server sent it so; else, from a server that sends none apart, as the
        `<think>` markers in its content say."""
        self.parted = self.parted or entry.thought
        return entry.thought or (not self.parted and self.thoughts.is_thought(None, entry.piece))

    def _position(self, index: int) -> int | None:
        """The token's KV slot on the server: after the prompt, when the prompt's length is known."""
        total = self._prompt_length()
        return None if total is None else total + index

    def _prompt_length(self) -> int | None:
        """The prompt's length as known while streaming: the server's progress, else our tokenizing."""
        if self.progress:
            return self.progress.total
        return len(self.prompt.ids) if self.prompt.known else None

    # -- text and counts -----------------------------------------------------------------------
    def _texts(self, chunk: Chunk) -> list[str]:
        """Each entry's share of the chunk's text: from its bytes where they add up to the text
        the server sent, otherwise all of it on the chunk's last entry (the server's text wins)."""
        decoded = [self._utf8.decode(e.span) for e in chunk.entries]
        if "".join(decoded) == chunk.text:
            return decoded
        self._utf8.reset()
        return [""] * (len(chunk.entries) - 1) + [chunk.text]

    def _tokens_in(self, chunk: Chunk) -> int:
        """Tokens this chunk carried: llama.cpp's running count where given, else its entries."""
        counted = whole((self.timings or {}).get("predicted_n"))
        if isinstance(counted, int) and counted > self.server_tokens:
            tokens, self.server_tokens = counted - self.server_tokens, counted
            return max(tokens, len(chunk.entries))
        return len(chunk.entries)

    def _keep(self, chunk: Chunk) -> None:
        self.timings = chunk.timings or self.timings
        self.usage = chunk.usage or self.usage
        self.finish = chunk.finish or self.finish
        self.fingerprint = chunk.fingerprint or self.fingerprint

    def text(self) -> str:
        """The answer as it is kept: thought the server sent apart wrapped in `<think>` markers."""
        return kept(self.texts)

    # -- the figures at the end ---------------------------------------------------------------
    def prompt_tokens(self) -> int | None:
        if self.usage and self.usage.prompt_tokens is not None:
            return self.usage.prompt_tokens
        return self._prompt_length()

    def reused_tokens(self) -> int | None:
        if self.usage and self.usage.cached_tokens is not None:
            return self.usage.cached_tokens
        cache_n = whole((self.timings or {}).get("cache_n"))
        if cache_n is not None:
            return cache_n
        return self.progress.cache if self.progress else None

    def generated_tokens(self) -> int:
        if self.usage and self.usage.completion_tokens is not None:
            return self.usage.completion_tokens
        return max(self.entries, self.server_tokens)

    def context_tokens(self) -> int | None:
        """Tokens this conversation holds on the server after the turn."""
        prompt = self.prompt_tokens()
        return None if prompt is None else prompt + self.generated_tokens()

    def stop(self, cancelled: bool, failed: bool, context: int | None) -> StopReason:
        if cancelled:
            return "cancelled"
        if failed:
            return "error"
        if self.finish == "length":
            held = self.context_tokens()
            return "context" if context and held is not None and held >= context else "length"
        return "eos"

    def stats(self, stop: StopReason) -> TurnStats:
        prompt, reused = self.prompt_tokens(), self.reused_tokens()
        # A server that says it reused more than the prompt reported neither figure rightly.
        prefilled = (
            prompt - reused if prompt is not None and reused is not None and reused <= prompt else None
        )
        ttft = self.ttft_s if self.ttft_s is not None else time.perf_counter() - self.started
        itl = self.itl
        thinking = thinking_figures(self.steps)
        return TurnStats(
            prompt_tokens=prompt,
            reused_tokens=reused,
            prefilled_tokens=prefilled,
            generated_tokens=self.generated_tokens(),
            ttft_s=ttft,
            itl_p50_s=statistics.median(itl) if itl else 0.0,
            itl_p90_s=sorted(itl)[min(len(itl) - 1, round(0.9 * (len(itl) - 1)))] if itl else 0.0,
            # Only once a token came: before that the server may not have computed them all.
            prefill_tok_s=prefilled / ttft if prefilled and self.ttft_s and ttft > 0 else 0.0,
            decode_tok_s=len(itl) / sum(itl) if itl and sum(itl) > 0 else 0.0,
            stop=stop,
            server=self.server_timings(),
            thought_tokens=thinking.tokens,
            first_thought_s=thinking.first_thought_s,
            first_answer_s=thinking.first_answer_s,
        )

    def server_timings(self) -> ServerTimings | None:
        t = self.timings or {}
        cached = self.usage.cached_tokens if self.usage else None
        if not t and cached is None and self.fingerprint is None:
            return None
        return ServerTimings(
            prompt_ms=_number(t.get("prompt_ms")),
            prompt_tokens=whole(t.get("prompt_n")),
            cached_tokens=whole(t.get("cache_n")) if cached is None else cached,
            predicted_ms=_number(t.get("predicted_ms")),
            predicted_tokens=whole(t.get("predicted_n")),
            predicted_per_token_ms=_number(t.get("predicted_per_token_ms")),
            fingerprint=self.fingerprint,
        )


def _same(candidate_id: int | None, candidate_piece: str, entry: Entry) -> bool:
    """The candidate is the chosen token: by id where both have one, else by its text."""
    if candidate_id is not None and entry.id is not None:
        return candidate_id == entry.id
    return candidate_piece == entry.piece


def _number(value) -> float | None:
    """A figure the server reported, or None: a NaN or an infinity is no figure (and no JSON)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value) if number and math.isfinite(value) and abs(value) < 1e15 else None
