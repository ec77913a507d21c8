"""A conversation with one model and one KV cache that lives across turns.

Each turn re-templates the whole conversation, reuses the longest common prefix with the
ids already in the cache, prefills only the rest, then decodes one token at a time:

    ids   = template(conversation)
    reuse = common_prefix(cache.ids, ids), at most len(ids) - 1
    cache.crop(reuse); prefill(ids[reuse:])          -> TTFT
    loop: sample -> emit -> stop? -> forward(token)  -> ITL
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import threading
import time
from typing import Generator, Iterator, Protocol

import torch

from engine.answer_stream import AnswerStream
from engine.capabilities import LOCAL
from engine.chat_templates import END_OF_TURN
from engine.contention import ContentionMeter
from engine.conversation import Message, Turns
from engine.detok import PieceNamer, StreamingDetokenizer
from engine.events import (
    CacheChanged,
    Candidate,
    ContextTrimmed,
    Event,
    Failed,
    Forked,
    PhaseChanged,
    PrefillProgress,
    PromptTokens,
    StepPaused,
    StopReason,
    TokenSampled,
    TurnFinished,
    TurnStats,
)
from engine.fast import fused
from engine.fast.compiled import compiled_decode
from engine.fast.compiled import supports as supports_compiled
from engine.forward import forward
from engine.instruments.stepping import PendingStep, StepGate
from engine.instruments.trace import AnswerTrace, forced_step
from engine.kvcache import KVCache, cache_precision_of, cache_precision_problem, with_cache_precision
from engine.models import LoadedModel, ModelError, not_enough_memory, out_of_memory, resolve
from engine.prompt_format import CHAT_TEMPLATE, RAW, Joined, answer_ids_in
from engine.sampling import Draw, Sampler, SamplingSettings
from engine.thinking import ThoughtSplitter, markers_of, opens_block, switch_problem, thinking_figures
from engine.threads import ThreadGovernor


class DecodeStrategy(Protocol):
    """Another way to decode than one token a forward (engine/speculative/loop.py `Speculation`), given
    to the session; `decode` takes the arguments of `ChatSession.decode_plain`."""

    @property
    def label(self) -> str:
        """How an answer's figures name it (TurnStats.speculative), e.g. 'lookup, K 4'."""
        ...

    def decode(
        self, session: ChatSession, *args: object
    ) -> Generator[Event, None, tuple[str, list[float], StopReason]]: ...


PREFILL_CHUNK = 512
"""Prompt tokens per forward pass in prefill: bounds memory and lets progress and Esc through."""


class ChatSession(Turns):
    """Messages, the persistent cache, and the prefill/decode loop that answers."""

    capabilities = LOCAL
    """Weights, cache and decode loop are here: everything a session can do (engine/capabilities.py)."""

    def __init__(
        self,
        loaded: LoadedModel,
        sampling: SamplingSettings | None = None,
        system_prompt: str | None = None,
        context: int | None = None,
        show_top_k: int = 10,
        fast: bool = True,
        compile: bool = False,
        kv_cache: str | None = None,
        raw: bool = False,
        thinking: bool | None = None,
    ):
        problem = switch_problem(getattr(loaded.tokenizer, "chat_template", None))
        if thinking is not None and problem:
            raise ModelError(f"--thinking {'on' if thinking else 'off'}: {problem}")
        self.prompt_format = (RAW if raw else CHAT_TEMPLATE).with_thinking(thinking)
        """How the conversation becomes ids: the chat template (its thinking switched by
        `--thinking`), or raw text (`--raw`, a base model)."""
        self.kv_cache = kv_cache
        """The KV cache's precision (engine/kvcache.py CACHE_PRECISIONS); None: the model precision's own."""
        self.fast_path_wanted = fast
        """Use engine/fast/fused.py where the model allows; False keeps the HF forward (the reference)."""
        self.compile_wanted = compile
        """Compile the decode step in the background (engine/fast/compiled.py) and switch to it when ready."""
        self.sampling = sampling or SamplingSettings()
        """Swapped whole (never mutated), read at every step: a change applies to the next token."""
        self.system_prompt = system_prompt
        self.messages: list[Message] = []
        self.cancel = threading.Event()
        self.show_top_k = show_top_k
        self.step_gate = StepGate()
        """Step mode: when enabled, each drawn token waits for the caller's choice."""
        self.trace: AnswerTrace | None = None
        """The steps of the answer in progress, or of the last one."""
        self.reuse_stopped: str | None = None
        """Why this turn's prompt could not hold every earlier answer as sampled (set by `_fit`)."""
        self.speculation: DecodeStrategy | None = None
        """Speculative decoding (engine/speculative/): off (None) keeps the plain loop below."""
        self.threads = ThreadGovernor()
        """Runs each forward on the cores other programs leave free (engine/threads.py)."""
        if context is not None and (isinstance(context, bool) or not isinstance(context, int) or context < 1):
            raise ValueError(f"context must be a positive number of tokens, got {context!r}")
        self._context_limit = context
        self.use_model(loaded)

    # -- model -----------------------------------------------------------------
    def use_model(self, loaded: LoadedModel) -> None:
        """Switch model or precision: the conversation stays, the cache starts empty."""
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.device = next(self.model.parameters()).device
        self.info = loaded.info
        if self.kv_cache is not None and cache_precision_problem(self.kv_cache, self.device.type):
            self.kv_cache = None  # a new device that cannot hold it: the precision's own cache
        if self.kv_cache is not None:
            self.info = with_cache_precision(loaded.info, self.kv_cache)
        self.info = self.info.limited_to(self._context_limit)
        self.cache = KVCache.for_model(self.info)
        self.namer = PieceNamer(self.tokenizer)
        self.stop_ids = self._stop_ids()
        self.thought_markers = markers_of(self.tokenizer)
        self.starts_thinking = opens_block(self.prompt_format.generation_prompt(self.tokenizer))
        """The generation prompt opens a `<think>` block (DeepSeek-R1's): each answer starts as thought."""
        self.thoughts = ThoughtSplitter()
        """Which tokens of the answer in progress are thought (engine/thinking.py)."""
        self._no_ids = torch.empty(0, dtype=torch.long, device=self.device)
        self.fast = None
        self.compiled = None
        self.decoded_by: tuple[str | None, str] = (None, "")
        """How the last answer was decoded (`_decoding`)."""
        if self.fast_path_wanted and fused.supports(self.model) is None:
            try:
                self.fast = fused.for_model(self.model, compiled=self.compile_wanted)
            except Exception as e:  # its fused copies of the weights did not fit (`ulimit -v`)
                if not out_of_memory(e, self.device.type):
                    raise
                raise ModelError(not_enough_memory(resolve(self.info.spec), self.loaded.precision)) from None
            if self.compile_wanted:
                self.compiled = compiled_decode(self.fast, self.info)

    @property
    def context(self) -> int:
        """The window a conversation must fit: `--context`'s, else the model's (`info.window`)."""
        return self.info.window

    def set_cache_precision(self, precision: str) -> str:
        """Keep the KV cache at `precision` from the next turn (ValueError, with the reason, where
        the device cannot; the setting in use stays). The cache starts empty and the next turn
        prefills the conversation again: converting the old cache would give K/V that no run at
        the new precision computes (each layer's K/V depend on attention over the earlier layers'
        rounded cache), and an int8 cache cannot be widened back to what it lost."""
        problem = cache_precision_problem(precision, self.device.type)
        if problem:
            raise ValueError(problem)
        self.kv_cache = precision
        self.info = with_cache_precision(self.loaded.info, precision).limited_to(self._context_limit)
        self.cache = KVCache.for_model(self.info)
        if self.fast is not None and self.compile_wanted:
            self._compile_for_cache()
        return f"KV cache now {precision}: {self.info.kv_bytes_per_token:,} B/token; {self.decode_path()}"

    def _compile_for_cache(self) -> None:
        """The compiled step for this cache's dtype (one built whole is kept: switching back is
        instant). One still building for the cache left behind is stopped: it would only compete
        for the cores."""
        previous, self.compiled = self.compiled, compiled_decode(self.fast, self.info)
        if previous is not None and previous is not self.compiled:
            previous.stop()  # nothing to stop once built

    def decode_path(self) -> str:
        """Which step decodes at this cache precision, and why not the compiled one where it is not."""
        if self.fast is None:
            return "the Hugging Face forward decodes (no fast path for this model)"
        cache = cache_precision_of(self.info.cache_dtype)
        if self.compile_wanted and self.compiled is None:
            why = supports_compiled(self.fast, getattr(torch, self.info.cache_dtype))
            return f"the eager fast path decodes ({why})"
        if self.compiled is not None and self.compiled.error is not None:  # failed or given up: for good
            return f"the eager fast path decodes (no compiled step: {self.compiled.error})"
        if self.compiled is not None and not self.compiled_serves:
            return f"the eager fast path decodes until the compiled step for the {cache} cache is ready"
        return "the fast path decodes"

    @property
    def compiled_serves(self) -> bool:
        """The compiled step is ready and built for this cache's dtype."""
        return (
            self.compiled is not None
            and self.compiled.ready.is_set()
            and self.compiled.cache_dtype == getattr(torch, self.info.cache_dtype)
        )

    def _stop_ids(self) -> set[int]:
        ids = set()
        for source in (
            self.tokenizer.eos_token_id,
            getattr(self.model.generation_config, "eos_token_id", None),
        ):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(source)
        for token in END_OF_TURN:  # a chat template's end of a turn, where the vocabulary has it
            end_of_turn = self.tokenizer.convert_tokens_to_ids(token)
            if isinstance(end_of_turn, int) and end_of_turn != self.tokenizer.unk_token_id:
                ids.add(end_of_turn)
        return ids

    def reset(self, system_prompt: str | None = None) -> None:
        self.messages.clear()
        self.system_prompt = system_prompt
        self.cache.clear()

    def template(self, messages: list[Message]) -> list[int]:
        return self.joined(messages).ids

    def joined(self, messages: list[Message]) -> Joined:
        """The conversation's ids, each answer of this session as the ids it was sampled as (the
        ones the KV cache holds), so a follow-up reuses the whole cache."""
        chat = [{"role": m.role, "content": m.content} for m in messages]
        if self.system_prompt:
            chat.insert(0, {"role": "system", "content": self.system_prompt})
        first = len(chat) - len(messages)
        kept = {first + i: ids for i, m in enumerate(messages) if (ids := self.sampled_ids(m))}
        return self.prompt_format.joined(self.tokenizer, chat, kept=kept)

    def sampled_ids(self, message: Message) -> list[int] | None:
        """The ids an answer was sampled as, without the stop token that ended it: from its trace,
        or read back from a saved cache (None: not known, its text is tokenized)."""
        if message.role != "assistant":
            return None
        if message.sampled_ids is not None:
            return list(message.sampled_ids)
        if message.trace is None or not message.trace.steps or None in (ids := message.trace.ids):
            return None
        return ids[:-1] if ids[-1] in self.stop_ids else ids

    def with_sampled_ids(self, messages: list[Message], held: list[int]) -> list[Message]:
        """`messages` (resumed from the store) with each answer's sampled ids read back from `held`,
        a saved cache's ids, as far as the cache holds the conversation: so the next turn's prompt
        is the one the cache was made for, not the text tokenized again."""
        messages = list(messages)
        for index, message in enumerate(messages):
            if message.role != "assistant" or self.sampled_ids(message) is not None:
                continue
            start = self.template(messages[:index])  # the prompt the answer continued
            ids = answer_ids_in(self.tokenizer, held, len(start), message.content)
            if ids is None or held[: len(start)] != start:
                break
            messages[index] = dataclasses.replace(message, sampled_ids=tuple(ids))
        return messages

    def _fit(self) -> tuple[list[int] | None, ContextTrimmed | None]:
        """Template the conversation, dropping the oldest turns until it fits the window."""
        reserve = min(self.sampling.max_new_tokens, self.context // 4)
        messages = list(self.messages)  # trimmed only once the rest is known to fit
        joined = self.joined(messages)
        before = len(joined.ids)
        while len(joined.ids) + reserve > self.context and len(messages) > 1:
            # Drop the oldest exchange (a user message and the answer that followed).
            cut = 2 if len(messages) > 2 and messages[1].role == "assistant" else 1
            del messages[:cut]
            joined = self.joined(messages)
        ids = joined.ids
        self.reuse_stopped = joined.broken
        if len(ids) + 1 > self.context:
            return None, None
        dropped = len(self.messages) - len(messages)
        self.messages[:] = messages
        trimmed = ContextTrimmed(dropped, before, len(ids), self.context) if dropped else None
        return ids, trimmed

    def _too_long(self) -> str:
        """Why the last message cannot fit even alone: the message, or the system prompt."""
        window = f"the context window is {self.context}"
        if self.system_prompt:
            system = len(self.template([]))
            if system + 1 > self.context:
                return f"the system prompt is {system} tokens; {window}: shorten the system prompt"
        size = len(self.template(self.messages[-1:]))
        with_system = " with the system prompt" if self.system_prompt else ""
        return f"the message is {size} tokens{with_system}; {window}: shorten it"

    # -- one turn ----------------------------------------------------------------
    def answer(self) -> Iterator[Event]:
        """Prefill what the cache lacks, then decode an answer to the last user message."""
        self.cancel.clear()
        ids, trimmed = self._fit()
        if ids is None:
            yield Failed(self._too_long())
            self.messages.pop()
            return
        if trimmed:
            yield trimmed
        text, stats = yield from self.run(ids)
        self.messages.append(Message("assistant", text, self.trace))
        yield PhaseChanged("idle")
        yield TurnFinished(stats, text)

    def run(
        self,
        ids: list[int],
        stop_at_eos: bool = True,
        first: int = 0,
        detok: StreamingDetokenizer | None = None,
        thoughts: ThoughtSplitter | None = None,
    ) -> Generator[Event, None, tuple[str, TurnStats]]:
        """Reuse the cache for `ids`, prefill the rest, decode; returns (text, stats).

        `stop_at_eos=False` decodes exactly max_new_tokens (the benchmark compares equal lengths).
        A fork continues an answer: its steps count from `first`, its text from `detok`, its
        thinking from `thoughts`.
        """
        started = time.perf_counter()
        self.thoughts = thoughts or self.thought_splitter()
        self.meter = ContentionMeter()
        self.paused_s = 0.0
        """Step mode: seconds this turn waited for the student (not the machine's time)."""
        held = len(self.cache)
        reused = self.cache.reuse(ids)
        self.trace = AnswerTrace(tuple(ids), reused)
        new_ids = ids[reused:]
        yield PromptTokens(tuple(ids), self.namer.pieces(ids), reused)
        stopped, self.reuse_stopped = (self.reuse_stopped if reused < held else None), None
        yield PhaseChanged("prefill", len(new_ids), reused, stopped)
        with torch.inference_mode():
            logits = yield from self._prefill(new_ids)
            prefill_s = time.perf_counter() - started
            yield self.cache_event()
            if logits is None:
                return "", self._stats(ids, reused, [], prefill_s, "cancelled")
            text, latencies, stop = yield from self._decode(logits, ids, started, stop_at_eos, first, detok)
        yield self.cache_event()
        return text, self._stats(ids, reused, latencies, prefill_s, stop)

    def thought_splitter(self) -> ThoughtSplitter:
        """A splitter for a new answer, open where the generation prompt opened a block."""
        return ThoughtSplitter(self.thought_markers, self.starts_thinking, opens_as_text=False)

    def _prefill(self, new_ids: list[int]) -> Generator[Event, None, torch.Tensor | None]:
        """Feed the new prompt tokens in chunks; return the last position's logits (None if cancelled)."""
        logits = None
        for start in range(0, len(new_ids), PREFILL_CHUNK):
            if self.cancel.is_set():
                return None
            chunk = new_ids[start : start + PREFILL_CHUNK]
            logits = self.forward(chunk)
            yield PrefillProgress(start + len(chunk), len(new_ids))
        return logits

    def forward(self, ids: list[int], cache: KVCache | None = None, every: bool = False) -> torch.Tensor:
        """One forward pass over `ids` with the cache (the chat's, or another an instrument
        fills with the very same forward: engine/instruments/context_sweep.py); the last position's
        logits, or with `every` each position's (a speculative verify)."""
        self.threads.follow()
        compiled = self.compiled if self.compiled_step_ready() else None
        cache = self.cache if cache is None else cache
        return forward(self.model, self.fast, compiled, ids, cache, self.device, every)

    def want_compiled_verify(self) -> None:
        """A speculative answer's verify passes run compiled once that step is built (after the
        plain steps; engine/fast/steps.py VERIFY), eager until then."""
        if self.compiled is not None:
            self.compiled.want_verify()

    def compiled_step_ready(self) -> bool:
        """A decode step (one token after a non-empty cache) runs the compiled step now."""
        return self.fast is not None and self.compiled_serves

    def _decode(
        self,
        logits: torch.Tensor,
        prompt_ids: list[int],
        started: float,
        stop_at_eos: bool,
        first: int = 0,
        detok: StreamingDetokenizer | None = None,
    ) -> Generator[Event, None, tuple[str, list[float], StopReason]]:
        """Decode until a stop with the strategy in force: speculation where it is set (step mode
        draws one token at a time, so it decodes plainly); returns (text, latencies, stop reason)."""
        self.decoded_by = self._decoding()
        decode = self.decode_plain
        if self.speculation is not None and not self.step_gate.enabled:
            decode = functools.partial(self.speculation.decode, self)
        return (yield from decode(logits, prompt_ids, started, stop_at_eos, first, detok))

    def decode_plain(
        self,
        logits: torch.Tensor,
        prompt_ids: list[int],
        started: float,
        stop_at_eos: bool,
        first: int = 0,
        detok: StreamingDetokenizer | None = None,
    ) -> Generator[Event, None, tuple[str, list[float], StopReason]]:
        """Sample, emit, and feed one token at a time until a stop."""
        sampler = Sampler(self.sampling, self.show_top_k)
        context_ids = list(prompt_ids)  # what the repetition penalty looks at
        detok = detok if detok is not None else StreamingDetokenizer(self.tokenizer)
        out = AnswerStream(self, detok, started)
        index = first
        while True:
            draw = yield from self._draw(sampler, logits, context_ids, index, out)
            finished = stop_at_eos and draw.id in self.stop_ids
            stop = self.stop_reason(finished, index + 1)
            yield out.token(index, draw, finished, stop)
            if index == first:
                yield PhaseChanged("decode")
            index += 1
            if stop is None and self.cancel.is_set():  # Esc while this token was shown
                stop = "cancelled"  # held-back bytes of a split character are dropped, as never shown
            if stop:
                return out.text(), out.latencies, stop
            logits = self.forward([draw.id])
            context_ids.append(draw.id)
            yield self.cache_event()

    def _draw(
        self, sampler: Sampler, logits: torch.Tensor, context_ids: list[int], index: int, out: AnswerStream
    ) -> Generator[Event, None, Draw]:
        """The next token: sampled with the current settings, or chosen by the student in step mode."""
        sampler.settings = self.sampling
        seen = self.repetition_ids(context_ids, sampler.settings)
        draw = sampler.sample(logits, seen)
        if self.step_gate.enabled:
            draw, waited = yield from self._step(index, draw, logits, seen)
            out.waited(waited)
        return draw

    def candidates(self, draw: Draw) -> tuple[Candidate, ...]:
        return tuple(
            Candidate(i, self.namer.piece(i), p) for i, p in zip(draw.top_ids, draw.top_probs) if p > 0
        )

    def _step(
        self, index: int, draw: Draw, logits: torch.Tensor, seen: torch.Tensor
    ) -> Generator[Event, None, tuple[Draw, float]]:
        """Step mode: show the draw and wait for the caller's choice; returns (draw taken, seconds waited)."""
        waiting = time.perf_counter()
        self.step_gate.offer(PendingStep(index, draw, logits, seen, self.sampling))
        greedy = draw.greedy_id
        model = torch.softmax(logits.float(), -1)  # before any setting: F4's figures
        yield StepPaused(
            index=index,
            position=len(self.cache),
            sampled=Candidate(draw.id, self.namer.piece(draw.id), math.exp(draw.logprob)),
            greedy=Candidate(greedy, self.namer.piece(greedy), draw.top_probs[0] if draw.top_probs else 1.0),
            top_k=self.candidates(draw),
            model_probs=(model[draw.id].item(), model[greedy].item()),
        )
        chosen = self.step_gate.wait(self.cancel)
        waited = time.perf_counter() - waiting
        self.paused_s += waited
        return chosen, waited

    def stop_reason(
        self, sampled_eos: bool, generated: int, position: int | None = None
    ) -> StopReason | None:
        if sampled_eos:
            return "eos"
        if self.cancel.is_set():
            return "cancelled"
        if generated >= self.sampling.max_new_tokens:
            return "length"
        if (len(self.cache) if position is None else position) + 1 >= self.context:
            return "context"
        return None

    def repetition_ids(self, context_ids: list[int], settings: SamplingSettings) -> torch.Tensor:
        """Token ids for the repetition penalty; built only when the penalty is on."""
        if settings.repetition_penalty == 1.0:
            return self._no_ids
        return torch.tensor(context_ids, device=self.device)

    # -- instruments ------------------------------------------------------------------
    def fork(self, step: int, token_id: int, answer: int | None = None) -> Iterator[Event]:
        """Answer again from step `step` of an answer, taking `token_id` (one of that step's alternatives).

        `answer` is the answer's message index (default: the last answer); later messages go.
        The cache keeps the prompt and the answer's first `step` tokens, so only the forced
        token and what follows are computed (`Forked` says how many positions were reused and
        fed). The new answer replaces the old one, whose text comes in `Forked.original_text`
        and whose trace stays as the new trace's `parent`: a branch a caller can keep.
        """
        self.cancel.clear()
        try:
            index, old = self._forkable(answer, step)
            forced = forced_step(old.steps[step], token_id, self.namer.piece(token_id))
        except ValueError as e:
            yield Failed(str(e))
            return
        original = self.messages[index].content
        ids = [*old.prompt_ids, *old.ids[:step], token_id]
        reused = self.cache.reuse(ids)
        del self.messages[index:]
        detok = StreamingDetokenizer(self.tokenizer)
        prefix = "".join(detok.add(i) for i in old.ids[:step])
        finished = token_id in self.stop_ids
        forced = dataclasses.replace(forced, text="" if finished else detok.add(token_id))
        thoughts, forced = self._fork_thoughts(old.steps[:step], forced)
        yield Forked(step, token_id, reused, len(ids) - reused, original, prefix + forced.text)
        yield forced
        if finished:  # the alternative ends the answer: nothing to compute
            self.trace = AnswerTrace(tuple(ids), reused)
            text, stats = (
                prefix + detok.flush(),
                self._stats(ids[:-1], reused, [], 0.0, "eos", measured=False),
            )
        else:
            text, stats = yield from self.run(ids, first=step + 1, detok=detok, thoughts=thoughts)
            text = prefix + forced.text + text
        self.trace = old.forked(step, forced, self.trace)
        self.messages.append(Message("assistant", text, self.trace))
        yield PhaseChanged("idle")
        yield TurnFinished(stats, text)

    def _fork_thoughts(
        self, kept: list[TokenSampled], forced: TokenSampled
    ) -> tuple[ThoughtSplitter, TokenSampled]:
        """The splitter as the kept steps left it, and the forced token marked by it."""
        thoughts = self.thought_splitter()
        for step in kept:
            thoughts.is_thought(step.id, step.text)
        return thoughts, dataclasses.replace(forced, thinking=thoughts.is_thought(forced.id, forced.text))

    def _forkable(self, answer: int | None, step: int) -> tuple[int, AnswerTrace]:
        """The message index and trace of the answer to fork; ValueError says why not."""
        if answer is None:
            answer = self.last_answer_index()
        if not 0 <= answer < len(self.messages) or self.messages[answer].role != "assistant":
            raise ValueError(f"message {answer} is not an answer")
        trace = self.messages[answer].trace
        if trace is None:
            raise ValueError("that answer has no token history (it was loaded, not generated here)")
        if not 0 <= step < len(trace):
            raise ValueError(f"step {step} is outside the answer's {len(trace)} steps")
        return answer, trace

    def cache_event(self) -> CacheChanged:
        held = self.cache.positions_held()
        return CacheChanged(
            tokens=len(self.cache),
            bytes=self.cache.tensor_bytes(),
            bytes_per_token=self.info.kv_bytes_per_token,
            capacity=self.context,
            layer_positions=held if any(n != len(self.cache) for n in held) else (),
        )

    def _decoding(self) -> tuple[str | None, str]:
        """(speculative setting or None, step path) of the answer about to be decoded, for its
        TurnStats: a speed is comparable only with one decoded the same way."""
        if self.step_gate.enabled:
            return None, "step mode"
        path = "reference" if self.fast is None else "fused"
        served = self.compiled_serves  # not for a cache of another precision than it was built for
        if self.speculation is not None:  # a round's verify pass: eager until its own step is built
            verify_built = served and self.compiled.verify_ready.is_set()
            return self.speculation.label, "compiled" if verify_built else path
        return None, "compiled" if served else path

    def _step_path(self) -> str:
        """What decoded the turn: as it began, unless its compiled step failed on the way (the
        eager path took the rest, `CompiledDecode.served`)."""
        path = self.decoded_by[1]
        return "fused" if path == "compiled" and not self.compiled_serves else path

    def _stats(
        self,
        ids: list[int],
        reused: int,
        latencies: list[float],
        prefill_s: float,
        stop: StopReason,
        measured: bool = True,
    ) -> TurnStats:
        """The turn's figures; `measured` False where nothing ran (no CPU share to judge)."""
        itl = latencies[1:]
        prefilled = len(ids) - reused
        thinking = thinking_figures(self.trace.steps)
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
            contention=self.meter.stop(self.paused_s) if measured else None,
            speculative=self.decoded_by[0] if latencies else None,
            step_path=self._step_path() if latencies else None,
            thought_tokens=thinking.tokens,
            first_thought_s=thinking.first_thought_s,
            first_answer_s=thinking.first_answer_s,
        )


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]
