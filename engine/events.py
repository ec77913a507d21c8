"""The events a chat session emits; every consumer (TUI, CLI, tests) sees these."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Union

from engine.capabilities import LOCAL, ON_SERVER, Capabilities

Phase = Literal["idle", "prefill", "decode"]
StopReason = Literal["eos", "length", "cancelled", "context", "error"]


@dataclass(frozen=True)
class ServerInfo:
    """The remote server a session talks to, as it described itself (None: it did not say)."""

    url: str
    """The base URL, without credentials or query."""
    kind: str
    """'llama.cpp', 'vllm', 'sglang', 'ollama' or 'openai-compatible' (engine/remote/server.py)."""
    version: str | None
    model: str
    parallelism: str | None = None
    """How the server spreads the model (tensor/pipeline/data parallel sizes), where it tells."""
    quantization: str | None = None
    """The weights' format as the server names it (llama.cpp: the GGUF type, e.g. Q4_1)."""
    top_logprobs_cap: int = 20
    """The most alternatives per token the server returns."""
    top_k_note: str = ""
    """Which distribution the server's top_logprobs come from (before or after its temperature)."""
    unreported: tuple[str, ...] = ()
    """What this server does not report, each with the server flag that would enable it."""
    unsupported_settings: tuple[str, ...] = ()
    """Sampling settings it does not accept (they are not sent; the settings screen says so)."""


@dataclass(frozen=True)
class ModelInfo:
    """What was loaded, with the numbers the panels derive everything from.

    For a model on a remote server (`server` set) the numbers it does not report are None."""

    spec: str
    name: str
    precision: str
    device: str
    compute_dtype: str
    cache_dtype: str
    """The KV cache's element type: fp32 on CPUs without 16-bit arithmetic, else compute_dtype;
    'int8' for a quantized cache (`--kv-cache`, engine/kvcache.py)."""
    parameters: int | None
    weight_bytes: int | None
    layers: int | None
    heads: int | None
    kv_heads: int | None
    head_dim: int | None
    hidden_size: int | None
    vocab_size: int | None
    context: int | None
    cache_element_bytes: int | None
    load_s: float
    server: ServerInfo | None = None
    """Set when the model runs on a remote server (engine/remote/), None for the local engine."""
    cache_scale_bytes: int = 0
    """Bytes of scale per token, head and K/V: 4 for an int8 cache (one float32), 0 for a float one."""
    default_cache_dtype: str = ""
    """The cache dtype the precision chose before any `--kv-cache` override ('' = cache_dtype)."""
    context_limit: int | None = None
    """The window this session keeps to where `--context` made it smaller than `context`."""
    layer_windows: tuple[int | None, ...] = ()
    """Each layer's sliding window, where any layer attends over one (Gemma 3's local layers,
    Mistral's): it sees only its last that many positions. () where every layer sees the whole context."""

    @property
    def window(self) -> int | None:
        """The context window a conversation must fit: `--context`'s, else the model's."""
        return self.context_limit or self.context

    def limited_to(self, tokens: int | None) -> ModelInfo:
        """This info for a session that keeps to `tokens` (None: the model's whole window)."""
        smaller = tokens is not None and self.context is not None and tokens < self.context
        return dataclasses.replace(self, context_limit=tokens if smaller else None)

    @property
    def kv_bytes_per_token(self) -> int | None:
        """2 (K and V) x layers x kv_heads x (head_dim x bytes per element + scale bytes); None if
        any is unknown."""
        parts = (self.layers, self.kv_heads, self.head_dim, self.cache_element_bytes)
        if any(p is None for p in parts):
            return None
        row = self.head_dim * self.cache_element_bytes + self.cache_scale_bytes
        return 2 * self.layers * self.kv_heads * row

    @property
    def cache_is_default(self) -> bool:
        """The cache has the precision's own dtype (no `--kv-cache` override in effect)."""
        return not self.default_cache_dtype or self.default_cache_dtype == self.cache_dtype

    @property
    def capabilities(self) -> Capabilities:
        """What the session serving this model can do (engine/capabilities.py): the UI asks this,
        not whether `server` is set; `server` holds the server's own facts to show."""
        return LOCAL if self.server is None else ON_SERVER


class Candidate(NamedTuple):
    """One entry of a step's top-k: the token and its probability. A named tuple, not a frozen
    dataclass: a decode step builds ten, and a tuple is built several times faster."""

    id: int | None
    """None when a remote server sent the piece's text but not its id."""
    piece: str
    prob: float


@dataclass(frozen=True)
class ModelLoading:
    stage: str
    fraction: float


@dataclass(frozen=True)
class ModelReady:
    info: ModelInfo


@dataclass(frozen=True)
class SamplingResolved:
    """The sampling a loaded model answers with: what the user chose, the model's own defaults for
    the rest (engine/model_sampling.py), llmchat's where neither says."""

    settings: dict[str, Any]
    """Every SamplingSettings field and its value."""
    from_model: tuple[str, ...]
    """The fields that took the model's own value."""
    source: str | None
    """Where the model's values come from, in words; None where it recommends none."""


@dataclass(frozen=True)
class CachePrecisionChanged:
    """The KV cache's precision changed between turns (`--kv-cache`): `info` has its new element
    and scale sizes; the cache starts empty, so the next turn prefills the conversation again."""

    info: ModelInfo


@dataclass(frozen=True)
class PhaseChanged:
    """The session entered a phase; for prefill, `tokens` are fed and `reused` came from the cache.

    None: a remote server does not tell (yet)."""

    phase: Phase
    tokens: int | None = 0
    reused: int | None = 0
    reuse_stopped: str | None = None
    """Why reuse stopped before the cache's end, where the prompt does not hold an earlier
    answer as it was sampled (engine/prompt_format.py `Joined.broken`)."""


@dataclass(frozen=True)
class PromptTokens:
    """Prompt tokens of this turn: `ids[:reused]` came from the cache, the rest are prefilled."""

    ids: tuple[int, ...]
    pieces: tuple[str, ...]
    reused: int | None
    """None when a remote server does not say how much of the prompt its cache held."""


@dataclass(frozen=True)
class PrefillProgress:
    """A chunk of the prompt went through the model (done of total new tokens)."""

    done: int
    total: int


@dataclass(frozen=True)
class TokenSampled:
    """One decode step: the chosen token, its text, and the distribution it was drawn from."""

    index: int
    id: int | None
    """None when a remote server sends the token's text but not its id."""
    piece: str
    text: str
    logprob: float | None
    """None when a remote server sends no logprobs."""
    top_k: tuple[Candidate, ...]
    latency_s: float
    position: int | None
    """None when a remote server does not say how long the prompt was."""
    entropy: float | None = 0.0
    """Entropy of the distribution the token was drawn from, in nats (-sum p ln p); 0 is certainty.
    None from a remote server: its top few alternatives do not give the whole distribution."""
    rank: int = 0
    """Where the token stood in that distribution: 1 is the most probable; 0 when unknown."""
    sent_bytes: bytes | None = None
    """A remote token sent without an id: its bytes as the server sent them (with an id, the
    tokenizer view looks them up)."""
    thinking: bool = False
    """The token is thought, not answer: inside a `<think>` block, its markers included, or a
    server's reasoning field (engine/thinking.py)."""


@dataclass(frozen=True)
class StepPaused:
    """Step mode: step `index` is drawn and waits for the caller to choose the token to take."""

    index: int
    position: int
    sampled: Candidate
    """Its `prob` is from the distribution the sampler drew from (after temperature, top-k/p, min-p)."""
    greedy: Candidate
    top_k: tuple[Candidate, ...]
    model_probs: tuple[float, float] | None = None
    """The model's own probabilities of the sampled and the greedy token (softmax of its logits,
    before any setting: what F4 shows)."""


@dataclass(frozen=True)
class Forked:
    """An answer continues from step `step` with `token_id`; the text it replaced is `original_text`."""

    step: int
    token_id: int
    reused: int
    """Positions kept in the KV cache (the prompt and the answer before `step`)."""
    new: int
    """Positions fed again before decoding goes on (1 when the cache held the whole prefix)."""
    original_text: str
    start_text: str = ""
    """What the new answer starts with: the kept steps' text and the chosen token's."""


@dataclass(frozen=True)
class DraftRound:
    """One speculative round: K drafted ids, of which `accepted` the model kept; then `next`, its
    correction (a rejection) or bonus (all kept). Comes before the round's token events."""

    index: int
    """The answer index of the first token this round emits."""
    drafter: str
    drafted: tuple[int, ...]
    pieces: tuple[str, ...]
    accepted: int
    next: int
    draft_s: float
    verify_s: float
    """The target's one forward pass over [last token, drafts] and the accept/reject."""


@dataclass(frozen=True)
class CacheChanged:
    """KV cache occupancy: `bytes` is summed from the real tensors.

    From a remote server: `tokens` is this conversation's context (None until the server says),
    `bytes` None (no tensors here), `bytes_per_token` the formula's where the model's shape is
    known, and `server_fill` the server-wide cache usage (0..1) where its metrics expose it,
    named by `server_fill_source`."""

    tokens: int | None
    bytes: int | None
    bytes_per_token: int | None
    capacity: int | None
    server_fill: float | None = None
    server_fill_source: str = ""
    layer_positions: tuple[int, ...] = ()
    """Positions each layer's tensors hold, where sliding windows keep fewer than `tokens`
    (Gemma 3's local layers: their window and a little room); () where every layer holds all."""


@dataclass(frozen=True)
class ContextTrimmed:
    """Old turns were dropped so the conversation fits the context window."""

    dropped_messages: int
    tokens_before: int
    tokens_after: int
    capacity: int


@dataclass(frozen=True)
class ServerTimings:
    """What a remote server measured for one turn, shown beside the client's own figures.

    None where this server does not report it; the difference to the client's TTFT and ITL is
    the network and queueing."""

    prompt_ms: float | None = None
    prompt_tokens: int | None = None
    """Prompt tokens the server computed this turn (not counting cached ones)."""
    cached_tokens: int | None = None
    """Prompt tokens served from its prefix cache."""
    predicted_ms: float | None = None
    predicted_tokens: int | None = None
    predicted_per_token_ms: float | None = None
    fingerprint: str | None = None
    """The stream's `system_fingerprint` (vLLM, llama.cpp: the build)."""


FEWER_SHARE = 0.1
"""A turn that ran on fewer threads this share of its time or more is flagged: a governor that
raised them again after its first window (0.5 s of a 10 s answer) did not slow the answer."""


@dataclass(frozen=True)
class Contention:
    """How much of the CPU this process got while it measured (engine/contention.py)."""

    cpu_share: float | None
    """Run time / (run + run-queue wait) of this process's threads, 0..1; None: not measurable."""
    source: str
    """'schedstat' (the kernel's run-queue accounting) or 'thread_time' (CPU time / wall time)."""
    load_1m: float | None
    """The machine's 1-minute load average (threads wanting a core), None where unknown."""
    cores: int
    busy: bool
    """The figures were measured on a busy machine and are slower than the model's own speed."""
    threads: int | None = None
    """The fewest threads a forward ran on (engine/threads.py: fewer while others take cores)."""
    configured_threads: int | None = None
    """The threads it runs on when the cores are free."""
    fewer_share: float = 0.0
    """The share of the interval it ran on fewer than those, 0..1."""

    @property
    def fewer_threads(self) -> bool:
        """It ran on fewer threads long enough to slow the figures (FEWER_SHARE of the time)."""
        return self.fewer_share >= FEWER_SHARE

    def figures(self) -> str:
        """'CPU share 45%, load 3.1 on 2 cores'."""
        parts = [f"CPU share {self.cpu_share:.0%}"] if self.cpu_share is not None else []
        if self.fewer_threads:
            spell = "" if self.fewer_share > 0.95 else f" {self.fewer_share:.0%} of the time"
            parts.insert(0, f"ran on {self.threads} of {self.configured_threads} threads{spell}")
        if self.load_1m is not None:
            parts.append(f"load {self.load_1m:.1f} on {self.cores} cores")
        return ", ".join(parts)

    def describe(self) -> str:
        """'busy machine: figures slowed (CPU share 45%, load 3.1 on 2 cores)', or the figures alone."""
        return f"busy machine: figures slowed ({self.figures()})" if self.busy else self.figures()


@dataclass(frozen=True)
class TurnStats:
    """One answer's figures, as the client measured them; None where a remote server did not say."""

    prompt_tokens: int | None
    reused_tokens: int | None
    prefilled_tokens: int | None
    generated_tokens: int
    ttft_s: float
    itl_p50_s: float
    itl_p90_s: float
    prefill_tok_s: float
    decode_tok_s: float
    """The ITLs and decode rate are 0 where there was no gap to time (an answer of one token)."""
    stop: StopReason
    server: ServerTimings | None = None
    """A remote server's own figures for this turn."""
    speculative: str | None = None
    """Who drafted and how many a round ('lookup, K 4') when this answer was decoded
    speculatively; None for plain decoding."""
    step_path: str | None = None
    """What ran the decode: 'compiled', 'fused' (the eager fast path), 'reference' (the HF forward),
    or 'step mode' (each token waited for the user: its times are not a speed); None from a server."""
    contention: Contention | None = None
    """Whether the machine let this process run while the turn was measured (None: not measured)."""
    thought_tokens: int = 0
    """Of `generated_tokens`, those that were thought (engine/thinking.py)."""
    first_thought_s: float | None = None
    """From the turn's start to the first thought token, as `ttft_s` counts (None: no thought)."""
    first_answer_s: float | None = None
    """From the turn's start to the first token that is not thought (None: none came)."""


@dataclass(frozen=True)
class TurnFinished:
    stats: TurnStats
    text: str
    error: str = ""
    """Why a turn stopped early (stop 'error'): one line; its partial answer is kept."""


CompileState = Literal["off", "unsupported", "building", "ready", "failed", "given up", "stopped"]


@dataclass(frozen=True)
class DecodeStep:
    """Which code runs the next decode step, and why that one (engine/fast/compiled.py).

    Sent after a load and whenever the background compile changes state."""

    step: Literal["compiled", "eager", "hf"]
    """'compiled' (torch.compile), 'eager' (the fused fast path), 'hf' (the transformers forward)."""
    attention: str
    """How a decode step attends: 'kernel' (engine/fast/attention.py), 'SDPA', or 'HF'."""
    compile: CompileState
    why: str
    """Plain words: why this step and not a faster one (or why the compile failed)."""
    elapsed_s: float = 0.0
    """While building: seconds since the compile started; when ready: how long it took."""


@dataclass(frozen=True)
class Notice:
    """Something the user should read that is not an error."""

    message: str


@dataclass(frozen=True)
class Failed:
    """A one-line, user-readable error; the session stays usable."""

    message: str
    lasting: bool = False
    """Trying again cannot help until the user changes something (a server refused the key):
    `ask` exits 2, as for a wrong argument."""


@dataclass(frozen=True)
class SavedMessage:
    """A message as the store holds it, with its place among the versions of its turn."""

    id: int
    role: str
    content: str
    version: int
    """1-based position among the message's siblings (edits and regenerations of one turn)."""
    versions: int


@dataclass(frozen=True)
class ConversationLoaded:
    """A saved conversation became current (resumed, or moved to another branch): redraw from it."""

    conversation_id: int
    title: str
    messages: tuple[SavedMessage, ...]


@dataclass(frozen=True)
class MessageSaved:
    """Message `index` of the session's messages was committed to the store."""

    conversation_id: int
    index: int
    message: SavedMessage


Event = Union[
    ModelLoading,
    ModelReady,
    SamplingResolved,
    CachePrecisionChanged,
    PhaseChanged,
    PromptTokens,
    PrefillProgress,
    TokenSampled,
    StepPaused,
    Forked,
    DraftRound,
    CacheChanged,
    ContextTrimmed,
    TurnFinished,
    DecodeStep,
    Notice,
    Failed,
    ConversationLoaded,
    MessageSaved,
]


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def _prob(p: float) -> float:
    """Six decimals, rounded down: a top-k that holds all the mass still sums to at most 1."""
    return math.floor(p * 1e6) / 1e6


def contention_json(c: Contention) -> dict[str, Any]:
    """The JSON form of a `Contention` (turn events, bench results)."""
    share = None if c.cpu_share is None else round(c.cpu_share, 3)
    load = None if c.load_1m is None else round(c.load_1m, 2)
    return {
        "cpu_share": share,
        "source": c.source,
        "load_1m": load,
        "cores": c.cores,
        "busy": c.busy,
        "threads": c.threads,
        "configured_threads": c.configured_threads,
        "fewer_threads_share": round(c.fewer_share, 3),
    }


def _top_k_json(top_k: tuple[Candidate, ...]) -> list[dict[str, Any]]:
    return [{"id": c.id, "text": c.piece, "prob": _prob(c.prob)} for c in top_k]


def _fields_json(tag: str) -> Callable[[Any], dict[str, Any]]:
    """For events whose JSON is their own fields, unchanged, after the tag."""
    return lambda event: {"event": tag, **dataclasses.asdict(event)}


def _loading_json(event: ModelLoading) -> dict[str, Any]:
    return {"event": "loading", "stage": event.stage, "fraction": round(event.fraction, 3)}


def _ready_json(event: ModelReady) -> dict[str, Any]:
    return {
        "event": "ready",
        **dataclasses.asdict(event.info),
        "kv_bytes_per_token": event.info.kv_bytes_per_token,
    }


def _kv_cache_json(event: CachePrecisionChanged) -> dict[str, Any]:
    """Only the cache's figures: the rest of the model did not change."""
    info = event.info
    return {
        "event": "kv_cache",
        "cache_dtype": info.cache_dtype,
        "element_bytes": info.cache_element_bytes,
        "scale_bytes": info.cache_scale_bytes,
        "kv_bytes_per_token": info.kv_bytes_per_token,
    }


def _phase_json(event: PhaseChanged) -> dict[str, Any]:
    phase = {"event": "phase", "phase": event.phase, "tokens": event.tokens, "reused": event.reused}
    return phase | ({"reuse_stopped": event.reuse_stopped} if event.reuse_stopped else {})


def _sampling_json(event: SamplingResolved) -> dict[str, Any]:
    return {
        "event": "sampling",
        **event.settings,
        "from_model": list(event.from_model),
        "source": event.source,
    }


def _prompt_json(event: PromptTokens) -> dict[str, Any]:
    return {"event": "prompt", "ids": list(event.ids), "pieces": list(event.pieces), "reused": event.reused}


def _prefill_progress_json(event: PrefillProgress) -> dict[str, Any]:
    return {"event": "prefill_progress", "done": event.done, "total": event.total}


def _token_json(event: TokenSampled) -> dict[str, Any]:
    return {
        "event": "token",
        "index": event.index,
        "id": event.id,
        "text": event.text,
        "piece": event.piece,
        "logprob": _round(event.logprob),
        "top_k": _top_k_json(event.top_k),
        "latency_ms": _ms(event.latency_s),
        "position": event.position,
        "entropy": _round(event.entropy),
        "rank": event.rank,
        "thinking": event.thinking,
    }


def _step_paused_json(event: StepPaused) -> dict[str, Any]:
    return {
        "event": "step_paused",
        "index": event.index,
        "position": event.position,
        "sampled": event.sampled.id,
        "greedy": event.greedy.id,
        "top_k": _top_k_json(event.top_k),
        "model_probs": None if event.model_probs is None else [_round(p) for p in event.model_probs],
    }


def _draft_json(event: DraftRound) -> dict[str, Any]:
    return {
        "event": "draft",
        "index": event.index,
        "drafter": event.drafter,
        "drafted": list(event.drafted),
        "pieces": list(event.pieces),
        "accepted": event.accepted,
        "next": event.next,
        "draft_ms": _ms(event.draft_s),
        "verify_ms": _ms(event.verify_s),
    }


def _turn_json(event: TurnFinished) -> dict[str, Any]:
    """The times, the token counts and the text, then the parts only some turns have."""
    times, counts = _turn_times(event.stats), _turn_counts(event.stats)
    return {"event": "turn", **times, **counts, "text": event.text, **_turn_extras(event)}


def _turn_times(stats: TurnStats) -> dict[str, Any]:
    gaps = stats.generated_tokens > 1  # one token has no gap to time: null, not 0
    return {
        "ttft_ms": _ms(stats.ttft_s),
        "first_thought_ms": None if stats.first_thought_s is None else _ms(stats.first_thought_s),
        "first_answer_ms": None if stats.first_answer_s is None else _ms(stats.first_answer_s),
        "itl_ms_p50": _ms(stats.itl_p50_s) if gaps else None,
        "itl_ms_p90": _ms(stats.itl_p90_s) if gaps else None,
        "prefill_tok_s": round(stats.prefill_tok_s, 2),
        "decode_tok_s": round(stats.decode_tok_s, 2) if gaps else None,
        "stop": stats.stop,
    }


def _turn_counts(stats: TurnStats) -> dict[str, Any]:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "reused_tokens": stats.reused_tokens,
        "prefilled_tokens": stats.prefilled_tokens,
        "generated_tokens": stats.generated_tokens,
        "thought_tokens": stats.thought_tokens,
    }


def _turn_extras(event: TurnFinished) -> dict[str, Any]:
    """Keys a turn has only where they apply (None and an empty error are left out, not null)."""
    stats = event.stats
    extras = {
        "step_path": stats.step_path,
        "speculative": stats.speculative,
        "server": None if stats.server is None else dataclasses.asdict(stats.server),
        "contention": None if stats.contention is None else contention_json(stats.contention),
        "error": event.error or None,
    }
    return {key: value for key, value in extras.items() if value is not None}


def _decode_step_json(event: DecodeStep) -> dict[str, Any]:
    return {"event": "decode_step", **dataclasses.asdict(event), "elapsed_s": round(event.elapsed_s, 1)}


def _notice_json(event: Notice) -> dict[str, Any]:
    return {"event": "notice", "message": event.message}


def _error_json(event: Failed) -> dict[str, Any]:
    """The message alone: `lasting` decides `ask`'s exit status, it is not part of the stream."""
    return {"event": "error", "message": event.message}


def _conversation_json(event: ConversationLoaded) -> dict[str, Any]:
    return {
        "event": "conversation",
        "conversation_id": event.conversation_id,
        "title": event.title,
        "messages": [dataclasses.asdict(m) for m in event.messages],
    }


def _saved_json(event: MessageSaved) -> dict[str, Any]:
    return {
        "event": "saved",
        "conversation_id": event.conversation_id,
        "index": event.index,
        **dataclasses.asdict(event.message),
    }


_ENCODERS: dict[type, Callable[[Any], dict[str, Any]]] = {
    ModelLoading: _loading_json,
    ModelReady: _ready_json,
    SamplingResolved: _sampling_json,
    CachePrecisionChanged: _kv_cache_json,
    PhaseChanged: _phase_json,
    PromptTokens: _prompt_json,
    PrefillProgress: _prefill_progress_json,
    TokenSampled: _token_json,
    StepPaused: _step_paused_json,
    Forked: _fields_json("forked"),
    DraftRound: _draft_json,
    CacheChanged: _fields_json("cache"),
    ContextTrimmed: _fields_json("context_trimmed"),
    TurnFinished: _turn_json,
    DecodeStep: _decode_step_json,
    Notice: _notice_json,
    Failed: _error_json,
    ConversationLoaded: _conversation_json,
    MessageSaved: _saved_json,
}
"""The function that writes each event class's JSON: a new event needs its line here."""


def to_json(event: Event) -> dict[str, Any]:
    """The JSON Lines form of an event (schema documented in README.md)."""
    for kind in type(event).__mro__:  # a subclass of an event is written as that event
        if kind in _ENCODERS:
            return _ENCODERS[kind](event)
    raise TypeError(f"not an event: {event!r}")
