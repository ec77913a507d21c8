"""One streamed chunk, read into plain records: the answer's text, its tokens with their
logprobs and alternatives, and whatever the server added (progress, timings, usage).

Servers differ in what a chunk holds, and this is the one place that knows:
- OpenAI fields: `delta.content`, `logprobs.content` (one entry per token: token, bytes,
  logprob, top_logprobs), `usage` with `prompt_tokens_details.cached_tokens`.
- llama.cpp adds `id` to each logprob entry and alternative, `timings` (prompt_ms, cache_n,
  predicted_n, ...) and `prompt_progress` (total, cache, processed). When a UTF-8 character
  spans several tokens it sends one entry for them: the text of all, the id, logprob and
  alternatives of the last, and `timings.predicted_n` counts them all.
- vLLM may put several tokens in one chunk; with `return_token_ids` the choice carries their
  `token_ids`. Its alternatives have no ids.
- Thought, where the server parses a model's `<think>` block out of the answer, comes in a
  delta field of its own (REASONING_FIELDS).
Extra fields arrive through pydantic's `model_extra`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from engine.detok import readable_bytes
from engine.events import Candidate

REASONING_FIELDS = ("reasoning", "reasoning_content", "thinking")
"""Delta fields that carry thought, the first one holding text wins:
- llama.cpp's server: `reasoning_content` (common/chat.cpp `common_chat_msg_diff_to_json_oaicompat`);
  a token's logprobs ride on its last delta's chunk (`server_task_result_cmpl_partial::
  to_json_oaicompat_chat`), the first token's on the role chunk, whose content is null;
- vLLM: `reasoning`, with the deprecated `reasoning_content` a copy of it in the same delta
  (vllm/entrypoints/openai/engine/protocol.py `DeltaMessage`), `reasoning_content` alone before;
- SGLang: `reasoning_content` (python/sglang/srt/entrypoints/openai/protocol.py `DeltaMessage`);
- Ollama's OpenAI API: `reasoning` (openai/openai.go `Message.Reasoning`, from its `thinking`),
  `thinking` in its own API's messages."""


@dataclass(frozen=True)
class Entry:
    """One logprob entry: a token (or, from llama.cpp, the last of a split character's tokens)."""

    id: int | None
    piece: str
    """Readable text of this token's own bytes (stray bytes as `<0xEC>`)."""
    span: bytes
    """The bytes of answer text this entry stands for."""
    own: bytes
    """This token's own bytes (less than `span` where llama.cpp merged a split character)."""
    logprob: float | None
    top: tuple[Candidate, ...]
    thought: bool = False
    """The server sent it as thought (a reasoning field), not as the answer's content."""


@dataclass(frozen=True)
class Progress:
    """llama.cpp's prompt_progress: of `total` prompt tokens, `cache` came from its cache."""

    total: int
    cache: int
    processed: int


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None


@dataclass
class Chunk:
    content: str = ""
    thought: str = ""
    """Text of a reasoning field: what the model thought, apart from the answer."""
    entries: list[Entry] = field(default_factory=list)
    progress: Progress | None = None
    timings: dict[str, Any] | None = None
    usage: Usage | None = None
    finish: str | None = None
    fingerprint: str | None = None

    @property
    def text(self) -> str:
        """All the text this chunk carried, thought first: its tokens' bytes add up to this."""
        return self.thought + self.content


def parse(chunk: Any) -> Chunk:
    """Read a `ChatCompletionChunk` (pydantic, extra fields in `model_extra`)."""
    extra = chunk.model_extra or {}
    out = Chunk(
        fingerprint=chunk.system_fingerprint,
        timings=extra.get("timings") if isinstance(extra.get("timings"), dict) else None,
        progress=_progress(extra.get("prompt_progress")),
        usage=_usage(chunk.usage, extra),
    )
    for choice in chunk.choices[:1]:  # one answer per request (n=1)
        out.content = _text(choice.delta.content) if choice.delta is not None else ""
        out.thought = _thought(choice.delta) if choice.delta is not None else ""
        out.finish = choice.finish_reason
        logprobs = choice.logprobs.content if choice.logprobs is not None else None
        ids = (choice.model_extra or {}).get("token_ids")
        thought = bool(out.thought) and not out.content  # a chunk of both: its tokens count as answer
        out.entries = [
            _entry(e, ids[i] if _has(ids, i) else None, thought) for i, e in enumerate(logprobs or [])
        ]
        if not out.entries:  # a server that sends text without logprobs: one entry for each text
            texts = ((out.thought, True), (out.content, False))  # thought first, as servers send it
            out.entries = [_text_entry(text, is_thought) for text, is_thought in texts if text]
    return out


def _thought(delta: Any) -> str:
    """The delta's thought: the first reasoning field that holds text (vLLM sends two copies)."""
    extra = delta.model_extra or {}
    return next((text for name in REASONING_FIELDS if (text := _text(extra.get(name)))), "")


def _text_entry(text: str, thought: bool) -> Entry:
    raw = text.encode("utf-8")
    return Entry(None, text, raw, raw, None, (), thought)


def _entry(item: Any, stream_id: int | None, thought: bool) -> Entry:
    extra = item.model_extra or {}
    token_id = whole(extra.get("id"))
    if token_id is None:
        token_id = whole(stream_id)
    span = _bytes(item.bytes, item.token)
    alternatives = list(item.top_logprobs or ())
    top = tuple(_candidate(alt) for alt in alternatives)
    mine = [a for a, c in zip(alternatives, top) if token_id is not None and c.id == token_id]
    own = _bytes(mine[0].bytes, mine[0].token) if mine else span
    return Entry(
        id=token_id,
        piece=readable_bytes(own),
        span=span,
        own=own,
        logprob=_logprob(item.logprob),
        top=tuple(c for c in top if c.prob > 0),
        thought=thought,
    )


def _candidate(alt: Any) -> Candidate:
    extra = alt.model_extra or {}
    logprob = _logprob(alt.logprob)
    prob = math.exp(logprob) if logprob is not None else 0.0  # -inf: filtered out by the server
    return Candidate(whole(extra.get("id")), readable_bytes(_bytes(alt.bytes, alt.token)), prob)


def _bytes(raw: list[int] | None, token: str | None) -> bytes:
    if raw:
        try:
            return bytes(raw)
        except (TypeError, ValueError):
            pass
    return _text(token).encode("utf-8")


def _text(value: Any) -> str:
    """Text as the server sent it, a lone surrogate (JSON can spell one; UTF-8 cannot hold it)
    made U+FFFD; anything but a string is no text."""
    return _SURROGATE.sub("\ufffd", value) if isinstance(value, str) else ""


_SURROGATE = re.compile("[\ud800-\udfff]")


def _progress(raw: Any) -> Progress | None:
    if not isinstance(raw, dict):
        return None
    total, cache, processed = (whole(raw.get(k)) for k in ("total", "cache", "processed"))
    if total is None:
        return None
    return Progress(total, cache or 0, processed or 0)


def _usage(usage: Any, extra: dict) -> Usage | None:
    if usage is None:
        return None
    details = getattr(usage, "prompt_tokens_details", None)
    cached = whole(getattr(details, "cached_tokens", None)) if details is not None else None
    if cached is None:  # SGLang's cache report, when enabled, travels in the usage's extras
        cached = whole((usage.model_extra or {}).get("cached_tokens"))
    return Usage(whole(usage.prompt_tokens), whole(usage.completion_tokens), cached)


def _has(ids: Any, i: int) -> bool:
    return isinstance(ids, list) and i < len(ids)


MAX_COUNT = 2**31 - 1
"""No server counts more tokens than this; a larger count is read as not reported (a count past
SQLite's integers lost a whole answer)."""


def whole(value: Any) -> int | None:
    """A count or an id as the server sent it, or None where it is not one a server could send."""
    whole = isinstance(value, int) and not isinstance(value, bool)
    return value if whole and 0 <= value <= MAX_COUNT else None


def _logprob(value: Any) -> float | None:
    """A log-probability: finite, and at most 0 (a server's rounding may pass 0 by a hair; one past
    exp's range ended the turn with an OverflowError)."""
    return min(float(value), 0.0) if _finite(value) else None


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)
