"""The headless benchmark: our instrumented loop against transformers' `generate`, same run.

Everything is measured in one process, interleaved, so the ratios hold on a noisy machine:
prefill (TTFT, tok/s) at several prompt lengths, decode tok/s and ITL for our loop and for
`model.generate` (timed per token through a streamer), multi-turn reuse (turn-N TTFT with
the cache against a fresh full prefill), and decode against the memory-bandwidth bound.
"""

from __future__ import annotations

import functools
import gc
import mmap
import resource
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch

from engine import models
from engine.contention import ContentionMeter
from engine.events import TokenSampled, TurnFinished, contention_json
from engine.fast import compiled as compiled_module
from engine.fast import fused, huge_pages, kernels, matvec
from engine.kv_windows import kv_read_bytes
from engine.kvcache import CACHE_PRECISIONS, with_cache_precision
from engine.models import LoadedModel, weights_read_per_token
from engine.prompts import FILLER, QUESTIONS
from engine.sampling import SamplingSettings
from engine.session import ChatSession, Message
from engine.threads import configured as configured_threads

Report = Callable[[str], None]


@dataclass
class BenchConfig:
    model: str = models.DEFAULT_MODEL
    precisions: tuple[str, ...] = ("fp32",)
    device: str = "auto"
    prompt_lengths: tuple[int, ...] = (16, 128, 512)
    decode_tokens: int = 64
    repeats: int = 3
    turns: int = 3
    long_context: int = 0
    """If > 0, also compare ITL at this many tokens of context against ITL at ~100."""
    random_weights: bool = False
    """Same architecture, random values: speed does not depend on the weights' values."""
    raw: bool = False
    """A base model: the multi-turn measurement's questions go as raw text, no chat template."""
    chat_template: str | None = None
    """The template text for a model that ships none (`--chat-template`)."""
    compile: bool = True
    """Decode with the compiled step where it is supported (engine/fast/compiled.py), as the app does."""
    speculative: str | None = None
    """Also measure speculative decoding with this drafter (`lookup` or a draft MODEL[@PRECISION])."""
    draft_tokens: int = 4
    """Tokens drafted per speculative round (1..8)."""
    kv_caches: tuple[str, ...] = ()
    """Also time decode at `kv_cache_context` tokens with each of these KV cache precisions."""
    kv_cache_context: int = 4000

    def __post_init__(self) -> None:
        """Raise ValueError, starting with the field's name, for a value no measurement can use."""
        if not self.prompt_lengths:
            raise ValueError("prompt_lengths needs at least one length")
        for length in self.prompt_lengths:
            _at_least("prompt_lengths", length, 1)
        _at_least("decode_tokens", self.decode_tokens, 2)  # the inter-token latency needs two tokens
        _at_least("repeats", self.repeats, 1)
        _at_least("long_context", self.long_context, 0)
        _at_least("kv_cache_context", self.kv_cache_context, 1)
        for name in self.kv_caches:
            if name not in CACHE_PRECISIONS:
                raise ValueError(f"kv_caches must be among {', '.join(CACHE_PRECISIONS)}, got {name!r}")
        if not 1 <= self.draft_tokens <= 8:
            raise ValueError(f"draft_tokens must be a whole number from 1 to 8, got {self.draft_tokens}")
        if not 1 <= self.turns <= len(QUESTIONS):
            raise ValueError(f"turns must be in [1, {len(QUESTIONS)}], got {self.turns}")


def _at_least(name: str, value: int, low: int) -> None:
    if value < low:
        raise ValueError(f"{name} must be at least {low}, got {value}")


@dataclass
class PrecisionResult:
    precision: str
    device: str
    weight_bytes: int
    kv_bytes_per_token: int
    read_bytes_per_token: int
    """Weight bytes one decode step reads (`weights_read_per_token`): the bound and the
    long-context prediction are made of these."""
    prefill: list[dict] = field(default_factory=list)
    decode: dict = field(default_factory=dict)
    decode_step: dict = field(default_factory=dict)
    """The same decode's step alone: fed a token at a time, nothing sampled, no events. What
    llama.cpp's `llama-bench` times; `decode` over it is what sampling and the panels cost."""
    decode_eager: dict = field(default_factory=dict)
    """Our loop without the compiled step (the same as `decode` where nothing was compiled)."""
    compiled: dict = field(default_factory=dict)
    generate: dict = field(default_factory=dict)
    multi_turn: dict = field(default_factory=dict)
    long_context: dict = field(default_factory=dict)
    quality: dict = field(default_factory=dict)
    speculative: dict = field(default_factory=dict)
    """Speculative against plain decoding (engine/speculative/bench.py), when asked for."""
    kv_cache: dict = field(default_factory=dict)
    """Per KV cache precision: bytes per token, bytes a step reads and ITL at long context."""
    contention: dict = field(default_factory=dict)
    """The CPU share the decode runs got (engine/contention.py): busy means other work slowed them."""
    peak_memory_bytes: int = 0
    peak_memory_scope: str = "this precision"
    """What the peak covers: "the run so far" where the system cannot reset it between precisions."""
    bandwidth_bound_tok_s: float = 0.0
    fp32_generate_tok_s: float = 0.0
    """transformers' generate at fp32 in this run (the targets are ratios to it), 0 if not run."""

    @property
    def decode_vs_generate(self) -> float:
        ours, theirs = self.decode.get("tok_s", 0.0), self.generate.get("tok_s", 0.0)
        return ours / theirs if theirs else 0.0

    def as_dict(self) -> dict:
        """The JSON record: sizes, speeds, the other measurements, then memory and the bound."""
        sizes = {
            "precision": self.precision,
            "device": self.device,
            "weight_bytes": self.weight_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "read_bytes_per_token": self.read_bytes_per_token,
        }
        return {**sizes, **self._speeds(), **self._measurements(), **self._memory_and_bound()}

    def _speeds(self) -> dict:
        """Prefill and each decode's speed, and our decode's ratios to `generate`'s."""
        tok_s = self.decode.get("tok_s", 0.0)
        return {
            "prefill": self.prefill,
            "decode": self.decode,
            "decode_step": self.decode_step,
            "decode_eager": self.decode_eager,
            "compiled": self.compiled,
            "generate": self.generate,
            "decode_vs_generate": round(self.decode_vs_generate, 3),
            "decode_vs_fp32_generate": round(tok_s / self.fp32_generate_tok_s, 3)
            if self.fp32_generate_tok_s
            else 0.0,
        }

    def _measurements(self) -> dict:
        """Quality, reuse and long context; speculative and KV cache runs only where measured."""
        return {
            "quality": self.quality,
            "multi_turn": self.multi_turn,
            "long_context": self.long_context,
            **({"speculative": self.speculative} if self.speculative else {}),
            **({"kv_cache": self.kv_cache} if self.kv_cache else {}),
            "contention": self.contention,
        }

    def _memory_and_bound(self) -> dict:
        """The peak memory, and decode against the memory-bandwidth bound."""
        return {
            "peak_memory_bytes": self.peak_memory_bytes,
            "peak_memory_scope": self.peak_memory_scope,
            "bandwidth_bound_tok_s": round(self.bandwidth_bound_tok_s, 1),
            "fraction_of_bound": round(self.decode.get("tok_s", 0.0) / self.bandwidth_bound_tok_s, 3)
            if self.bandwidth_bound_tok_s
            else 0.0,
        }


def prompt_ids(tokenizer, length: int) -> list[int]:
    """Exactly `length` ids of ordinary English text."""
    ids: list[int] = []
    while len(ids) < length:
        ids += tokenizer(FILLER, add_special_tokens=False)["input_ids"]
    return ids[:length]


def _ms(values: list[float]) -> dict:
    ordered = sorted(values)
    return {
        "itl_ms_p50": round(statistics.median(ordered) * 1000, 3),
        "itl_ms_p90": round(ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))] * 1000, 3),
    }


def _greedy(loaded: LoadedModel, max_new: int, compile: bool = False, raw: bool = False) -> ChatSession:
    settings = SamplingSettings(temperature=0.0, max_new_tokens=max_new)
    return ChatSession(loaded, settings, compile=compile, raw=raw)


def measure_ours(
    loaded: LoadedModel, ids: list[int], new_tokens: int, compile: bool = False
) -> tuple[TurnFinished, list[float]]:
    """One fresh-cache run of our loop; returns the stats and the per-token ITLs."""
    session = _greedy(loaded, new_tokens, compile)
    latencies: list[float] = []
    runner = session.run(ids, stop_at_eos=False)
    try:
        while True:
            event = next(runner)
            if isinstance(event, TokenSampled):
                latencies.append(event.latency_s)
    except StopIteration as done:
        text, stats = done.value
    return TurnFinished(stats, text), latencies[1:]


class _Timestamps:
    """A `generate` streamer that records when each new token arrives."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:  # the first call carries the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def measure_step(
    loaded: LoadedModel, ids: list[int], new_tokens: int, compile: bool = False
) -> tuple[float, list[float]]:
    """`measure_ours`' decode without its loop: after the prompt, the step fed one token
    `new_tokens` times, nothing sampled, no events. (prefill seconds, per-step seconds)."""
    session = _greedy(loaded, new_tokens, compile)
    with torch.inference_mode():
        started = time.perf_counter()
        session.forward(ids)
        times = [time.perf_counter()]
        for _ in range(new_tokens):
            session.forward(ids[-1:])  # the step's cost does not depend on which token
            times.append(time.perf_counter())
    return times[0] - started, [b - a for a, b in zip(times, times[1:])][1:]


def measure_generate(loaded: LoadedModel, ids: list[int], new_tokens: int) -> tuple[float, list[float]]:
    """transformers' `model.generate`, greedy, exactly `new_tokens`: (TTFT, ITLs)."""
    inputs = torch.tensor([ids], device=next(loaded.model.parameters()).device)
    stamps = _Timestamps()
    started = time.perf_counter()
    with torch.inference_mode():
        loaded.model.generate(
            inputs,
            attention_mask=torch.ones_like(inputs),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            streamer=stamps,
            pad_token_id=loaded.tokenizer.pad_token_id or 0,
        )
    times = [started] + stamps.times
    gaps = [b - a for a, b in zip(times, times[1:])]
    return gaps[0], gaps[1:]


def bench_prefill(loaded: LoadedModel, lengths: tuple[int, ...], repeats: int) -> list[dict]:
    rows = []
    for length in lengths:
        ids = prompt_ids(loaded.tokenizer, length)
        measure_ours(loaded, ids, 1)  # warm-up: a GPU loads each new shape's kernels on first use
        runs = [measure_ours(loaded, ids, 1)[0].stats for _ in range(repeats)]
        ttft = statistics.median(s.ttft_s for s in runs)
        rows.append(
            {
                "prompt_tokens": length,
                "ttft_ms": round(ttft * 1000, 2),
                "prefill_tok_s": round(statistics.median(s.prefill_tok_s for s in runs), 1),
            }
        )
    return rows


def compile_decode(loaded: LoadedModel) -> dict:
    """Start the compiled decode step and wait for it (the app would answer eagerly meanwhile)."""
    session = _greedy(loaded, 1, compile=True)
    if session.compiled is None:
        return {
            "compiled": False,
            "note": compiled_module.supports(session.fast) if session.fast else "no fast path",
        }
    # The whole step once it took over (or failed to): the app's speed after its first seconds.
    session.compiled.wait_settled(900)  # `ready` alone never comes on a failure
    return {
        "compiled": session.compiled.ready.is_set(),
        "compile_s": round(session.compiled.compile_s, 1),
        "whole_s": round(session.compiled.whole_s, 1),
        "note": session.compiled.describe(),
    }


class DecodeRuns(NamedTuple):
    """`bench_decode`'s summaries, each a dict of tok/s, TTFT and ITL percentiles."""

    ours: dict
    step: dict
    eager: dict
    generate: dict


def bench_decode(loaded: LoadedModel, tokens: int, repeats: int, compile: bool) -> DecodeRuns:
    """Ours (compiled step where ready), the same step alone, ours eager and generate's decode
    on the same 32-token prompt, interleaved run by run."""
    ids = prompt_ids(loaded.tokenizer, 32)
    for use_compiled in {compile, False}:  # warm-up: first calls allocate and pick kernels
        measure_ours(loaded, ids, 4, use_compiled)
    measure_generate(loaded, ids, 4)
    runs: dict[str, tuple[list[list[float]], list[float]]] = {name: ([], []) for name in DecodeRuns._fields}

    def record(name: str, ttft: float, itl: list[float]) -> None:
        runs[name][0].append(itl)
        runs[name][1].append(ttft)

    for _ in range(repeats):
        finished, itl = measure_ours(loaded, ids, tokens, compile)
        record("ours", finished.stats.ttft_s, itl)
        record("step", *measure_step(loaded, ids, tokens, compile))
        if compile:
            finished, itl = measure_ours(loaded, ids, tokens, False)
        record("eager", finished.stats.ttft_s, itl)
        record("generate", *measure_generate(loaded, ids, tokens))
    return DecodeRuns(**{name: _decode_summary(*runs[name], tokens) for name in DecodeRuns._fields})


def _decode_summary(itls: list[list[float]], ttfts: list[float], tokens: int) -> dict:
    """Runs' inter-token latencies and TTFTs as one decode's figures."""
    # Per-run decode rate, then the median run: robust to one noisy run.
    rates = sorted(len(itl) / sum(itl) for itl in itls)
    flat = [x for itl in itls for x in itl]
    return {
        "tok_s": round(statistics.median(rates), 2),
        "ttft_ms": round(statistics.median(ttfts) * 1000, 2),
        **_ms(flat),
        "tokens": tokens,
    }


def bench_multi_turn(loaded: LoadedModel, turns: int, answer_tokens: int = 32, raw: bool = False) -> dict:
    """Turn-N TTFT with the cache reused against the same conversation prefilled from scratch
    (`raw`: a base model's, each question appended to the text as it is)."""
    # Warm-up: a prefill over a reused cache runs kernels of its own (a GPU's first took 680 ms).
    warm = _greedy(loaded, 2, raw=raw)
    _finished_stats(event for question in QUESTIONS[:2] for event in warm.send(question))
    session = _greedy(loaded, answer_tokens, raw=raw)
    last = _finished_stats(event for question in QUESTIONS[:turns] for event in session.send(question))
    history = list(session.messages[:-1])  # the last turn again, from an empty cache
    fresh = _greedy(loaded, answer_tokens, raw=raw)
    fresh.messages = history
    fresh_stats = _finished_stats(fresh.answer())
    return {
        "turn": turns,
        "prompt_tokens": last.prompt_tokens,
        "reused_tokens": last.reused_tokens,
        "ttft_ms_reused": round(last.ttft_s * 1000, 2),
        "ttft_ms_fresh": round(fresh_stats.ttft_s * 1000, 2),
        "speedup": round(fresh_stats.ttft_s / last.ttft_s, 2) if last.ttft_s else 0.0,
    }


def _finished_stats(events):
    """The stats of the last turn that finished in `events` (read to the end); None if none did."""
    stats = None
    for event in events:
        if isinstance(event, TurnFinished):
            stats = event.stats
    return stats


def bench_long_context(
    loaded: LoadedModel, context: int, read_bytes: int, tokens: int = 16, compile: bool = False
) -> dict:
    """ITL at ~100 and at `context` tokens, with the ratio the bytes read per token predict."""
    per_token = loaded.info.kv_bytes_per_token
    result = {}
    for label, length in (("short", 100), ("long", context)):
        _, itl = measure_ours(loaded, prompt_ids(loaded.tokenizer, length), tokens, compile)
        result[f"itl_ms_{label}"] = round(statistics.median(itl) * 1000, 3)
        result[f"context_{label}"] = length
    measured = result["itl_ms_long"] / result["itl_ms_short"]
    windows, layers = loaded.info.layer_windows, loaded.info.layers
    predicted = (read_bytes + kv_read_bytes(per_token, layers, windows, context)) / (
        read_bytes + kv_read_bytes(per_token, layers, windows, 100)
    )
    result.update(measured_ratio=round(measured, 3), predicted_ratio=round(predicted, 3))
    return result


def bench_kv_cache(
    loaded: LoadedModel,
    precisions: tuple[str, ...],
    context: int,
    read_bytes: int,
    tokens: int,
    repeats: int,
    compile: bool = False,
) -> dict:
    """Decode at `context` tokens with each KV cache precision, interleaved (a round of every
    precision per repeat), on the compiled step built for each float cache where `compile`, else
    (and for int8) the eager fast path. The context is prefilled once, into an fp32 cache, and
    converted to each precision: a step's time does not depend on the values it reads."""
    from engine.fast import kernels

    kernel = kernels.load("step")
    session = _greedy(loaded, tokens, compile)
    ids = prompt_ids(loaded.tokenizer, context)
    caches = _filled_caches(session, ids, precisions)
    for precision in precisions if compile else ():  # each float cache's step built before any is timed
        session.set_cache_precision(precision)
        if session.compiled is not None:
            session.compiled.wait_settled(900)
    timed = _time_kv_caches(session, ids, caches, tokens, repeats)
    attention = f"tensor ops ({kernel})" if kernel else "the C++ kernel (reads each precision as stored)"
    result = {}
    for precision in precisions:
        per_token = with_cache_precision(loaded.info, precision).kv_bytes_per_token
        kv_read = kv_read_bytes(per_token, loaded.info.layers, loaded.info.layer_windows, context)
        result[precision] = {
            "bytes_per_token": per_token,
            "context": context,
            "kv_bytes_read_per_step": kv_read,
            "bytes_read_per_step": read_bytes + kv_read,
            **timed[precision].as_dict(),
            "attention": attention,
        }
    return result


def _filled_caches(session: ChatSession, ids: list[int], precisions: tuple[str, ...]) -> dict:
    """All but the last of `ids` prefilled once, in 512-token chunks, into an fp32 cache, then
    converted to each precision."""
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, 512):
            session.forward(ids[start : min(start + 512, len(ids) - 1)])
    filled = session.cache
    return {p: filled.converted(p) for p in precisions}


@dataclass
class _CacheTimes:
    """One KV cache precision's decode timings at long context."""

    itls: list[float] = field(default_factory=list)
    attention_s: list[float] = field(default_factory=list)
    step: str = ""

    def as_dict(self) -> dict:
        return {
            "itl_ms_long": round(statistics.median(self.itls) * 1000, 3),
            "attention_ms": round(statistics.median(self.attention_s) * 1000, 3),
            # Best of: on a shared machine other work only adds, so the minimum is the steadiest.
            "itl_ms_min": round(min(self.itls) * 1000, 3),
            "attention_ms_min": round(min(self.attention_s, default=0.0) * 1000, 3),
            **_ms(self.itls),
            "step": self.step,
        }


def _time_kv_caches(
    session: ChatSession, ids: list[int], caches: dict, tokens: int, repeats: int
) -> dict[str, _CacheTimes]:
    """Decode from each filled cache in turn, a round of every precision per repeat."""
    times = {precision: _CacheTimes() for precision in caches}
    for _ in range(repeats):
        for precision, cache in caches.items():
            session.set_cache_precision(precision)
            session.cache = cache
            runner = session.run(ids, stop_at_eos=False)  # reuses all but the last id, then decodes
            times[precision].itls += _latencies(runner)[1:]
            compiled = session.decoded_by[1] == "compiled"
            times[precision].step = "compiled step" if compiled else "eager fast path"
            times[precision].attention_s += _attention_alone(session, tokens)
    return times


def _attention_alone(session: ChatSession, repeats: int) -> list[float]:
    """Seconds for one token's attention over every layer of the session's cache, as the decode
    step calls it (the cache read as stored), without the rest of the step: what the cache's
    precision changes, apart from the weights' reads that dominate a small model's step."""
    fast = session.fast
    if fast is None:
        return []
    position = torch.tensor([len(session.cache) - 1])
    q = torch.randn(1, fast.heads, 1, fast.head_dim)
    times = []
    with torch.inference_mode():
        for _ in range(repeats):
            started = time.perf_counter()
            _attend_every_layer(fast, session.cache, q, position)
            times.append(time.perf_counter() - started)
    return times


def _attend_every_layer(fast, cache, q: torch.Tensor, position: torch.Tensor) -> None:
    """One query's attention over each layer of `cache`, read as stored."""
    for layer in cache.layers:
        stored = layer.quantized() if cache.quantized else (layer.keys, layer.values)
        keys, values = (stored, None) if cache.quantized else stored
        fast.attention(q, keys, values, None, position - layer.start)  # a sliding window's slots


def _latencies(runner) -> list[float]:
    """Drain a session.run generator; the latency of each token it emitted."""
    latencies = []
    for event in runner:
        if isinstance(event, TokenSampled):
            latencies.append(event.latency_s)
    return latencies


def bench_kv_cache_quality(
    loaded: LoadedModel, precisions: tuple[str, ...], tokens: int = 32, raw: bool = False
) -> dict:
    """Each cache precision against an fp32 cache, teacher-forced on the fp32 cache's greedy answer
    to each question (engine/instruments/precision_compare.py `compare_kv_cache`; `raw`: the
    questions as text, a base model's)."""
    from engine.instruments.precision_compare import compare_kv_cache

    session = _greedy(loaded, tokens, raw=raw)
    result = {}
    for precision in precisions:
        steps = []
        for question in QUESTIONS:
            ids = session.template([Message("user", question)])
            steps += compare_kv_cache(loaded, ids, precision, tokens, session.stop_ids).steps
        result[precision] = _agreement(steps, kl_digits=5)
    return result


def bench_quality(reference: LoadedModel, loaded: LoadedModel, tokens: int = 32, raw: bool = False) -> dict:
    """What a precision does to the distribution: fp32 answers each question greedily, the other
    is teacher-forced on its tokens (engine/instruments/precision_compare.py); `raw`: a base
    model continues each question as text."""
    from engine.instruments.precision_compare import compare_precisions

    session = _greedy(reference, tokens, raw=raw)
    steps = []
    for question in QUESTIONS:
        session.messages = [Message("user", question)]
        compared = compare_precisions(
            reference, loaded, session.template(session.messages), tokens, session.stop_ids
        )
        steps += compared.steps
    return _agreement(steps, kl_digits=4)


def _agreement(steps: list, kl_digits: int) -> dict:
    """How teacher-forced steps (each with `agree` and `kl`) matched the reference: the share whose
    top token agreed, and the mean KL to `kl_digits` decimals (its largest to one fewer)."""
    agree, kl = [s.agree for s in steps], [s.kl for s in steps]
    return {
        "steps": len(agree),
        "top1_agreement": round(sum(agree) / len(agree), 3),
        "mean_kl_nats": round(statistics.fmean(kl), kl_digits),
        "max_kl_nats": round(max(kl), kl_digits - 1),
    }


BANDWIDTH_READ = "best of torch.mv and the step's matvec kernel, paged as the weights are"
"""How `measure_bandwidth` reads (saved with F6's calibration, which is measured again when this
changes). A plain `sum` read ~20% slower than torch.mv on the AVX-512 Xeon (23 vs 29 GiB/s), and
torch.mv alone read ~45% slower than the step's own kernel on an AVX-512 EPYC (16-18 vs 30-32 GB/s):
decode steps then outran the roof (a Zen 5 `bench -p fp32`: roof 20.1 GB/s, decode 31 GB/s). So did
Gemma 3's fp32 step once its weights were in huge pages and the buffer read was not (engine/fast/
huge_pages.py): 32.2 tok/s against a roof of 29.1."""


def measure_bandwidth(device: str, megabytes: int = 512) -> float:
    """Bytes/s for reading a large buffer once (the memory bound a decode step pays): the buffer
    as a matrix times a vector, a decode step's own read, on all of torch's threads, the best of
    five reads by each reader a step may use (torch's kernel; on a CPU also engine/fast/matvec.cpp,
    built or loaded here, which the compiled and fused steps multiply with). On a CPU the buffer is
    moved into huge pages first, as the fast path's weights are."""
    matrix = torch.ones(megabytes * 2**20 // 4 // 2048, 2048, dtype=torch.float32, device=device)
    huge_pages.move([matrix])
    vector = torch.ones(2048, dtype=torch.float32, device=device)
    readers = [lambda: torch.mv(matrix, vector)]
    if (
        device == "cpu"
        and matvec.enabled
        and kernels.load("step") is None
        and matvec.can_multiply_now(matrix)
    ):
        readers.append(lambda: matvec.multiply(vector[None], matrix))
    return matrix.numel() * 4 / min(_best_time(read, device) for read in readers)


def _best_time(read: Callable[[], object], device: str, runs: int = 5) -> float:
    """The shortest of `runs` timed calls of `read`, after one untimed (a first call pays its setup)."""
    read()
    best = float("inf")
    for _ in range(runs):
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        read()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return best


def reset_peak_memory(device: str) -> bool:
    """Start a new peak, so each precision reports its own rather than the run's so far.

    True if the peak now starts here; False where the system cannot reset it (the peak then
    covers the whole run, and the report says so).
    """
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        return True
    return _clear_peak_rss() and _peak_rss_resets()


def _clear_peak_rss() -> bool:
    try:  # Linux: writing 5 to clear_refs resets VmHWM to the current RSS
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@functools.cache
def _peak_rss_resets() -> bool:
    """Some kernels and sandboxes accept the write and keep the old peak: try it once on a peak made here."""
    size = 64 * 2**20
    region = mmap.mmap(-1, size)
    region.write(bytes(size))  # touched, so it counts in RSS, then unmapped: RSS drops by `size`
    region.close()
    _clear_peak_rss()
    status = _proc_status_kib("VmHWM", "VmRSS")
    return len(status) == 2 and status["VmHWM"] - status["VmRSS"] < size // 2**10 // 2


def _proc_status_kib(*keys: str) -> dict[str, int]:
    found: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in keys:
                    found[key] = int(line.split()[1])
    except OSError:
        pass
    return found


def peak_memory_bytes(device: str) -> int:
    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    hwm = _proc_status_kib("VmHWM").get("VmHWM")
    if hwm is not None:
        return hwm * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def run(config: BenchConfig, report: Report = lambda line: None) -> dict:
    """Every measurement of `config`, one precision at a time, as a JSON-ready dict."""
    device = models.resolve_device(config.device)
    bandwidth = measure_bandwidth(device)
    report(f"measured memory bandwidth: {bandwidth / 1e9:.1f} GB/s ({BANDWIDTH_READ})")
    results: list[PrecisionResult] = []
    # fp32 first: the targets are ratios to its generate, and it is the quality reference.
    for precision in sorted(config.precisions, key=lambda p: p != "fp32"):
        results.append(bench_precision(config, precision, device, bandwidth, results, report))
        gc.collect()  # the model went with bench_precision's frame: free it before the next loads
    return {
        "model": config.model,
        "device": device,
        "random_weights": config.random_weights,
        "bandwidth_gb_s": round(bandwidth / 1e9, 2),
        "bandwidth_read": BANDWIDTH_READ,
        "torch_threads": configured_threads(),
        "results": [r.as_dict() for r in results],
    }


def bench_precision(
    config: BenchConfig,
    precision: str,
    device: str,
    bandwidth: float,
    earlier: list[PrecisionResult],
    report: Report,
) -> PrecisionResult:
    """Load the model at `precision` and take each measurement `config` asks for."""
    loaded, peak_is_own = _load_for_bench(config, precision, device, report)
    info = loaded.info
    result = PrecisionResult(
        precision, device, info.weight_bytes, info.kv_bytes_per_token, weights_read_per_token(loaded)
    )
    use_compiled = _measure_speed(config, loaded, result, report)
    _measure_options(config, loaded, result, use_compiled, report)
    _bound_and_peak(result, bandwidth, peak_is_own)
    _compare_to_fp32(config, loaded, result, earlier, report)
    return result


def _load_for_bench(
    config: BenchConfig, precision: str, device: str, report: Report
) -> tuple[LoadedModel, bool]:
    """The model at `precision`, its weights laid out as the app lays them out, and whether the
    peak memory could be reset before it loaded (else the peak covers the run so far)."""
    weights_note = " (random weights)" if config.random_weights else ""
    report(f"loading {config.model} at {precision} on {device}{weights_note}")
    peak_is_own = reset_peak_memory(device)
    if config.random_weights:
        loaded = models.load_random(config.model, precision, device)
    else:
        loaded = models.load(
            config.model, precision, device, chat=not config.raw, chat_template=config.chat_template
        )
    if fused.supports(loaded.model) is None:
        fast = fused.for_model(loaded.model, compiled=config.compile)
        if fast.settling is not None:  # timed in the pages the app's steps run on after their first seconds
            fast.settling.join()
    return loaded, peak_is_own


def _bound_and_peak(result: PrecisionResult, bandwidth: float, peak_is_own: bool) -> None:
    """The memory-bandwidth bound on decode (at 64 tokens of context) and the peak memory."""
    per_token_bytes = result.read_bytes_per_token + result.kv_bytes_per_token * 64
    result.bandwidth_bound_tok_s = bandwidth / per_token_bytes
    result.peak_memory_bytes = peak_memory_bytes(result.device)
    result.peak_memory_scope = "this precision" if peak_is_own else "the run so far"


def _measure_speed(config: BenchConfig, loaded: LoadedModel, result: PrecisionResult, report: Report) -> bool:
    """Prefill, the compiled step, decode against generate, multi-turn reuse and long context,
    into `result`; whether decode used the compiled step."""
    precision = result.precision
    report(f"[{precision}] prefill at {config.prompt_lengths} tokens")
    result.prefill = bench_prefill(loaded, config.prompt_lengths, config.repeats)
    use_compiled = _compile_step(config, loaded, result, report)
    _measure_decode(config, loaded, result, use_compiled, report)
    report(f"[{precision}] multi-turn reuse over {config.turns} turns")
    result.multi_turn = bench_multi_turn(loaded, config.turns, raw=config.raw)
    if config.long_context:
        report(f"[{precision}] ITL at {config.long_context} tokens of context")
        result.long_context = bench_long_context(
            loaded, config.long_context, result.read_bytes_per_token, compile=use_compiled
        )
    return use_compiled


def _compile_step(config: BenchConfig, loaded: LoadedModel, result: PrecisionResult, report: Report) -> bool:
    """Build the compiled decode step where `config` asks for it; whether it is ready."""
    if config.compile:
        report(f"[{result.precision}] compiling the decode step (torch.compile; cached for later runs)")
        result.compiled = compile_decode(loaded)
        report(f"[{result.precision}] {result.compiled['note']}")
    return bool(result.compiled.get("compiled"))


def _measure_decode(
    config: BenchConfig, loaded: LoadedModel, result: PrecisionResult, use_compiled: bool, report: Report
) -> None:
    """Our decode against `model.generate`, interleaved, with the CPU share the runs got."""
    precision = result.precision
    report(f"[{precision}] decode {config.decode_tokens} tokens: ours vs model.generate, interleaved")
    meter = ContentionMeter()
    decoded = bench_decode(loaded, config.decode_tokens, config.repeats, use_compiled)
    result.decode, result.decode_step = decoded.ours, decoded.step
    result.decode_eager, result.generate = decoded.eager, decoded.generate
    measured = meter.stop()
    result.contention = contention_json(measured)
    report(f"[{precision}] decode measured at {measured.describe() or 'an unknown CPU share'}")


def _measure_options(
    config: BenchConfig, loaded: LoadedModel, result: PrecisionResult, use_compiled: bool, report: Report
) -> None:
    """The measurements only some runs ask for: speculative decoding, KV cache precisions."""
    if config.speculative:
        _measure_speculative(config, loaded, result, use_compiled, report)
    if config.kv_caches:
        _measure_kv_caches(config, loaded, result, use_compiled, report)
        if not config.random_weights:  # agreement between random models says nothing
            report(f"[{result.precision}] top-1 agreement and KL of each KV cache precision against fp32's")
            for name, quality in bench_kv_cache_quality(loaded, config.kv_caches, raw=config.raw).items():
                result.kv_cache[name]["quality"] = quality


def _measure_speculative(
    config: BenchConfig, loaded: LoadedModel, result: PrecisionResult, use_compiled: bool, report: Report
) -> None:
    """Speculative decoding with `config.speculative`'s drafter against plain decoding."""
    from engine.speculative.bench import bench_speculative

    report(f"[{result.precision}] speculative ({config.speculative}, K={config.draft_tokens}) against plain")
    result.speculative = bench_speculative(
        loaded,
        config.speculative,
        config.draft_tokens,
        config.decode_tokens,
        config.repeats,
        use_compiled,
        raw=config.raw,
    )


def _measure_kv_caches(
    config: BenchConfig, loaded: LoadedModel, result: PrecisionResult, use_compiled: bool, report: Report
) -> None:
    """ITL at long context with each KV cache precision, interleaved."""
    report(
        f"[{result.precision}] ITL at {config.kv_cache_context} tokens with a "
        f"{', '.join(config.kv_caches)} KV cache, interleaved"
    )
    result.kv_cache = bench_kv_cache(
        loaded,
        config.kv_caches,
        config.kv_cache_context,
        result.read_bytes_per_token,
        config.decode_tokens,
        config.repeats,
        use_compiled,
    )


def _compare_to_fp32(
    config: BenchConfig,
    loaded: LoadedModel,
    result: PrecisionResult,
    earlier: list[PrecisionResult],
    report: Report,
) -> None:
    """fp32's generate speed (the targets' reference) and, after fp32, agreement with it."""
    if earlier and earlier[0].precision == "fp32":
        result.fp32_generate_tok_s = earlier[0].generate["tok_s"]
        if not config.random_weights:  # agreement between random models says nothing
            report(f"[{result.precision}] top-1 agreement and KL against fp32, teacher-forced")
            chat = {"chat": not config.raw, "chat_template": config.chat_template}
            reference = models.load(config.model, "fp32", result.device, **chat)
            result.quality = bench_quality(reference, loaded, raw=config.raw)
    elif result.precision == "fp32":
        result.fp32_generate_tok_s = result.generate["tok_s"]
