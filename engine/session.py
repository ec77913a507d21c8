"""A conversation with one model and one KV cache that lives across turns.

Each turn re-templates the whole conversation, reuses the longest common prefix with the
ids already in the cache, prefills only the rest, then decodes one token at a time:

    ids   = template(conversation)
    reuse = common_prefix(cache.ids, ids), at most len(ids) - 1
    cache.crop(reuse); prefill(ids[reuse:])          -> TTFT
    loop: sample -> emit -> stop? -> forward(token)  -> ITL
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass
from typing import Iterator

import torch

from .detok import PieceNamer, StreamingDetokenizer
from .events import (
    CacheChanged,
    Candidate,
    ContextTrimmed,
    Event,
    Failed,
    PhaseChanged,
    PrefillProgress,
    PromptTokens,
    StopReason,
    TokenSampled,
    TurnFinished,
    TurnStats,
)
from .kvcache import KVCache
from .models import LoadedModel
from .sampling import Sampler, SamplingSettings

PREFILL_CHUNK = 512
"""Prompt tokens per forward pass in prefill: bounds memory and lets progress and Esc through."""


@dataclass(frozen=True)
class Message:
    role: str
    content: str


class ChatSession:
    """Messages, the persistent cache, and the prefill/decode loop that answers."""

    def __init__(
        self,
        loaded: LoadedModel,
        sampling: SamplingSettings | None = None,
        system_prompt: str | None = None,
        context: int | None = None,
        show_top_k: int = 10,
    ):
        self.sampling = sampling or SamplingSettings()
        """Swapped whole (never mutated), read at every step: a change applies to the next token."""
        self.system_prompt = system_prompt
        self.messages: list[Message] = []
        self.cancel = threading.Event()
        self.show_top_k = show_top_k
        self._context_limit = context
        self.use_model(loaded)

    # -- model -----------------------------------------------------------------
    def use_model(self, loaded: LoadedModel) -> None:
        """Switch model or precision: the conversation stays, the cache starts empty."""
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.info = loaded.info
        self.device = next(self.model.parameters()).device
        self.cache = KVCache(loaded.info.layers)
        self.namer = PieceNamer(self.tokenizer)
        self.context = min(self._context_limit or self.info.context, self.info.context)
        self.stop_ids = self._stop_ids()
        self._no_ids = torch.empty(0, dtype=torch.long, device=self.device)

    def _stop_ids(self) -> set[int]:
        ids = set()
        for source in (self.tokenizer.eos_token_id, getattr(self.model.generation_config, "eos_token_id", None)):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(source)
        end_of_turn = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        if isinstance(end_of_turn, int) and end_of_turn != self.tokenizer.unk_token_id:
            ids.add(end_of_turn)
        return ids

    # -- conversation ------------------------------------------------------------
    def send(self, text: str) -> Iterator[Event]:
        """Add a user message and answer it."""
        self.messages.append(Message("user", text))
        yield from self.answer()

    def regenerate(self) -> Iterator[Event]:
        """Drop the last answer and answer the last user message again."""
        while self.messages and self.messages[-1].role == "assistant":
            self.messages.pop()
        if not self.messages:
            yield Failed("nothing to regenerate yet")
            return
        yield from self.answer()

    def edit(self, index: int, text: str) -> Iterator[Event]:
        """Replace user message `index`, forget what followed it, and answer again."""
        if not (0 <= index < len(self.messages)) or self.messages[index].role != "user":
            yield Failed(f"message {index} is not a user message")
            return
        del self.messages[index:]
        yield from self.send(text)

    def reset(self, system_prompt: str | None = None) -> None:
        self.messages.clear()
        self.system_prompt = system_prompt
        self.cache.clear()

    def template(self, messages: list[Message]) -> list[int]:
        chat = [{"role": m.role, "content": m.content} for m in messages]
        if self.system_prompt:
            chat.insert(0, {"role": "system", "content": self.system_prompt})
        text = self.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _fit(self) -> tuple[list[int] | None, ContextTrimmed | None]:
        """Template the conversation, dropping the oldest turns until it fits the window."""
        reserve = min(self.sampling.max_new_tokens, self.context // 4)
        ids = self.template(self.messages)
        before = len(ids)
        dropped = 0
        while len(ids) + reserve > self.context and len(self.messages) > 1:
            # Drop the oldest exchange (a user message and the answer that followed).
            cut = 2 if len(self.messages) > 2 and self.messages[1].role == "assistant" else 1
            del self.messages[:cut]
            dropped += cut
            ids = self.template(self.messages)
        if len(ids) + 1 > self.context:
            return None, None
        trimmed = ContextTrimmed(dropped, before, len(ids), self.context) if dropped else None
        return ids, trimmed

    # -- one turn ----------------------------------------------------------------
    def answer(self) -> Iterator[Event]:
        """Prefill what the cache lacks, then decode an answer to the last user message."""
        self.cancel.clear()
        ids, trimmed = self._fit()
        if ids is None:
            size = len(self.template(self.messages[-1:]))
            self.messages.pop()
            yield Failed(f"the message is {size} tokens; the context window is {self.context}: shorten it")
            return
        if trimmed:
            yield trimmed
        text, stats = yield from self.run(ids)
        self.messages.append(Message("assistant", text))
        yield PhaseChanged("idle")
        yield TurnFinished(stats, text)

    def run(self, ids: list[int], stop_at_eos: bool = True) -> Iterator[Event]:
        """Reuse the cache for `ids`, prefill the rest, decode; returns (text, stats).

        `stop_at_eos=False` decodes exactly max_new_tokens (the benchmark compares equal lengths).
        """
        started = time.perf_counter()
        reused = self.cache.reuse(ids)
        new_ids = ids[reused:]
        yield PromptTokens(tuple(ids), self.namer.pieces(ids), reused)
        yield PhaseChanged("prefill", len(new_ids), reused)
        with torch.inference_mode():
            logits = yield from self._prefill(new_ids)
            prefill_s = time.perf_counter() - started
            yield self.cache_event()
            if logits is None:
                return "", self._stats(ids, reused, [], prefill_s, "cancelled")
            text, latencies, stop = yield from self._decode(logits, ids, started, stop_at_eos)
        yield self.cache_event()
        return text, self._stats(ids, reused, latencies, prefill_s, stop)

    def _prefill(self, new_ids: list[int]) -> Iterator[Event]:
        """Feed the new prompt tokens in chunks; return the last position's logits (None if cancelled)."""
        logits = None
        for start in range(0, len(new_ids), PREFILL_CHUNK):
            if self.cancel.is_set():
                return None
            chunk = new_ids[start : start + PREFILL_CHUNK]
            logits = self._forward(chunk)
            yield PrefillProgress(start + len(chunk), len(new_ids))
        return logits

    def _forward(self, ids: list[int]) -> torch.Tensor:
        """One forward pass over `ids` with the cache; the last position's logits."""
        inputs = torch.tensor([ids], device=self.device)
        out = self.model(input_ids=inputs, cache=self.cache.hf, use_cache=True, logits_to_keep=1)
        self.cache.appended(ids)
        return out.logits[0, -1]

    def _decode(
        self, logits: torch.Tensor, prompt_ids: list[int], started: float, stop_at_eos: bool
    ) -> Iterator[Event]:
        """Sample, emit, and feed tokens until a stop; returns (text, latencies, stop reason)."""
        sampler = Sampler(self.sampling, self.device, self.show_top_k)
        context_ids = list(prompt_ids)  # what the repetition penalty looks at
        detok = StreamingDetokenizer(self.tokenizer)
        pieces: list[str] = []
        latencies: list[float] = []
        last = started
        index = 0
        while True:
            sampler.settings = self.sampling
            draw = sampler.sample(logits, self._seen(context_ids, sampler.settings))
            finished = stop_at_eos and draw.id in self.stop_ids
            text = "" if finished else detok.add(draw.id)
            now = time.perf_counter()
            latencies.append(now - last)
            last = now
            pieces.append(text)
            yield TokenSampled(
                index=index,
                id=draw.id,
                piece=self.namer.piece(draw.id),
                text=text,
                logprob=draw.logprob,
                top_k=tuple(
                    Candidate(i, self.namer.piece(i), p) for i, p in zip(draw.top_ids, draw.top_probs) if p > 0
                ),
                latency_s=latencies[-1],
                position=len(self.cache),
            )
            if index == 0:
                yield PhaseChanged("decode")
            index += 1
            stop = self._stop_reason(finished, index)
            if stop:
                break
            logits = self._forward([draw.id])
            context_ids.append(draw.id)
            yield self.cache_event()
        tail = detok.flush()
        if tail:
            pieces.append(tail)
        return "".join(pieces), latencies, stop

    def _stop_reason(self, sampled_eos: bool, generated: int) -> StopReason | None:
        if sampled_eos:
            return "eos"
        if self.cancel.is_set():
            return "cancelled"
        if generated >= self.sampling.max_new_tokens:
            return "length"
        if len(self.cache) + 1 >= self.context:
            return "context"
        return None

    def _seen(self, context_ids: list[int], settings: SamplingSettings) -> torch.Tensor:
        """Token ids for the repetition penalty; built only when the penalty is on."""
        if settings.repetition_penalty == 1.0:
            return self._no_ids
        return torch.tensor(context_ids, device=self.device)

    def cache_event(self) -> CacheChanged:
        return CacheChanged(
            tokens=len(self.cache),
            bytes=self.cache.tensor_bytes(),
            bytes_per_token=self.info.kv_bytes_per_token,
            capacity=self.context,
        )

    def _stats(
        self, ids: list[int], reused: int, latencies: list[float], prefill_s: float, stop: StopReason
    ) -> TurnStats:
        itl = latencies[1:]
        prefilled = len(ids) - reused
        return TurnStats(
            prompt_tokens=len(ids),
            reused_tokens=reused,
            prefilled_tokens=prefilled,
            generated_tokens=len(latencies),
            ttft_s=latencies[0] if latencies else prefill_s,
            itl_p50_s=statistics.median(itl) if itl else 0.0,
            itl_p90_s=_percentile(itl, 0.9),
            prefill_tok_s=prefilled / prefill_s if prefill_s > 0 else 0.0,
            decode_tok_s=len(itl) / sum(itl) if itl and sum(itl) > 0 else 0.0,
            stop=stop,
        )


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]
