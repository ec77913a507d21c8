"""Context length is not free: prefill n tokens and decode at context n, for n = 16, 32, ... 2,048.

Each size is one point, measured on the inference thread with the chat's own forward
(`ChatSession.forward`: the eager fast path for prefill; decode on the compiled step once it
is ready, else the eager fast path) into a cache of its own, so the chat's cache and turn stay
exactly as they were:

    TTFT(n) = prefill n tokens from an empty cache and take the first token (median of a few
              runs for small n, where one run is a few milliseconds)
    ITL(n)  = median time of one decode step with n, n+1, ... positions in the cache

What a decode step reads: every weight once (W bytes, the same at any context) and the K and V
of every cached position once:

    KV bytes per step = kv · c,    kv = 2 · layers · kv_heads · head_dim · element bytes
    the cache outweighs the weights from   c* = W / kv   on.

For this model c* comes from its loaded shape; for Llama-2-7B and -70B from the formula with
fp16 weights and cache (their config numbers below). A layer that attends over a sliding window
(Gemma 3's local layers) reads and keeps only its last w positions, so it adds kv/layers · min(c, w):
c* moves far out, or never comes where every layer has a window.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.instruments.phases import ModelShape
from engine.kv_windows import kv_read_bytes
from engine.kvcache import KVCache

if TYPE_CHECKING:
    from engine.session import ChatSession

SMALLEST = 16
LARGEST = 2048
DECODE_STEPS = 8
"""Decode steps timed at each size; their median is the ITL."""
REPEAT_BELOW = 256
"""Prompts shorter than this are prefilled three times and the median kept (one run is a few ms)."""

FILLER = (
    "The history of the city begins with a small settlement on the river, where traders met to "
    "exchange salt, wool and grain. Over the centuries it grew into a busy port with bridges, "
    "markets, churches and a university, and its people wrote down what they saw each year. "
)
"""The prompt the sweep feeds, repeated to length: ordinary prose (what is fed does not change the time)."""


@dataclass(frozen=True)
class CacheShape:
    """What the crossover needs of a model: its cache's bytes per token and its weights' bytes."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    element_bytes: int
    weight_bytes: int
    source: str
    """Where the numbers come from: the loaded model, or the formula with a named config."""
    scale_bytes: int = 0
    """An int8 cache's scale per head and token (engine/events.py ModelInfo.kv_bytes_per_token)."""
    windows: tuple[int | None, ...] = ()
    """Each layer's sliding window (None: the whole context); () where no layer has one."""

    @property
    def kv_bytes_per_token(self) -> int:
        """kv = 2 (K and V) · layers · kv_heads · (head_dim · element bytes + scale bytes)."""
        return 2 * self.layers * self.kv_heads * (self.head_dim * self.element_bytes + self.scale_bytes)

    def kv_bytes(self, context: int) -> int:
        """Cache bytes one decode step reads at `context` positions: a windowed layer's last w only."""
        return kv_read_bytes(self.kv_bytes_per_token, self.layers, self.windows, context)

    @property
    def windowed_layers(self) -> int:
        return sum(1 for w in self.windows if w)

    @property
    def crossover(self) -> int | None:
        """c*: the smallest context whose cache bytes read per step reach the weights' bytes; None
        where every layer's window caps them below."""
        if not self.windows:
            return math.ceil(self.weight_bytes / self.kv_bytes_per_token)
        per_layer, whole = self.kv_bytes_per_token // self.layers, self.layers - self.windowed_layers
        largest = max(w or 0 for w in self.windows)
        if self.kv_bytes(largest) < self.weight_bytes:
            if not whole:
                return None
            # Past every window only the whole-context layers still grow: linearly, solved.
            capped = per_layer * sum(w for w in self.windows if w)
            return math.ceil((self.weight_bytes - capped) / (per_layer * whole))
        low, high = 1, largest  # reached within the windows: the first context that reaches it
        while low < high:
            middle = (low + high) // 2
            low, high = (middle + 1, high) if self.kv_bytes(middle) < self.weight_bytes else (low, middle)
        return low


FP16 = 2
LLAMA_2_7B = CacheShape(
    "Llama-2-7B", 32, 32, 128, FP16, int(6.7e9) * FP16, "computed from the formula: fp16 weights and cache"
)
LLAMA_2_70B = CacheShape(
    "Llama-2-70B", 80, 8, 128, FP16, int(69e9) * FP16, "computed from the formula: fp16 weights and cache"
)
"""70B shares each K/V head among 8 query heads (GQA): 8 KV heads for 64 query heads."""


def shape_of(session: ChatSession) -> CacheShape:
    """This model as loaded: the weight bytes one pass reads and the cache's element size."""
    info = session.info
    return CacheShape(
        info.name,
        info.layers,
        info.kv_heads,
        info.head_dim,
        info.cache_element_bytes,
        ModelShape.of(session.loaded).streamed_weight_bytes,
        f"this model as loaded: {info.precision} weights, {info.cache_dtype} cache",
        info.cache_scale_bytes or 0,
        info.layer_windows,
    )


def sizes(window: int, largest: int = LARGEST, steps: int = DECODE_STEPS) -> list[int]:
    """16, 32, 64, ... up to `largest`, each leaving room in the window for its decode steps."""
    out, n = [], SMALLEST
    while n <= largest and n + steps + 1 <= window:
        out.append(n)
        n *= 2
    return out


@dataclass(frozen=True)
class ContextPoint:
    """One size, measured."""

    context: int
    """Prompt tokens prefilled, then the context the decode steps start from."""
    ttft_s: float
    """Prefill of `context` tokens from an empty cache to the first token (median of `ttft_runs`)."""
    ttft_runs: int
    itl_s: float
    """Median of `itl_steps` decode steps at context `context`..`context + itl_steps - 1`."""
    itl_steps: int
    cache_bytes: int
    """K and V bytes held after the prefill, summed from the sweep cache's real tensors."""
    prefill_path: str
    """Which forward the prefill ran: "eager fast path" or "HF forward"."""
    decode_path: str
    """Which forward the decode steps ran: "compiled step", "eager fast path" or "HF forward"."""
    cpu_share: float
    """Process CPU seconds per wall second while measuring (well below `threads`: other work
    on the machine took cores, and the times are slower than an idle machine's)."""
    threads: int
    """torch's intra-op threads: the cores the forward can use at most."""


def decode_path(session: ChatSession) -> str:
    if session.fast is None:
        return "HF forward"
    return "compiled step" if session.compiled_step_ready() else "eager fast path"


class ContextSweep:
    """The sweep's own cache and prompt; `measure(session, n)` is one point, on the inference thread."""

    def __init__(self, steps: int = DECODE_STEPS) -> None:
        self.steps = steps
        self._cache: KVCache | None = None
        self._model = None
        self._prompt: list[int] = []

    def measure(
        self, session: ChatSession, n: int, cancel: threading.Event | None = None
    ) -> ContextPoint | None:
        """Prefill `n` tokens into the sweep's cache and decode `steps` more; None if cancelled."""
        if n + self.steps + 1 > session.context:
            raise ValueError(
                f"{n} tokens and {self.steps} decode steps do not fit the {session.context}-token window"
            )
        cancel = cancel or threading.Event()
        if cancel.is_set():  # stopped while this point waited behind a chat turn
            return None
        cache = self._ready_cache(session)
        prompt = self._prompt_of(session, n)
        wall, cpu = time.perf_counter(), time.process_time()
        with torch.inference_mode():
            self._warm_up(session, cache)
            runs = 3 if n < REPEAT_BELOW else 1
            ttfts = []
            for _ in range(runs):
                seconds, first = self._prefill(session, cache, prompt, cancel)
                if first is None:
                    return None
                ttfts.append(seconds)
            cache_bytes = cache.tensor_bytes()
            path = decode_path(session)
            itls = self._decode(session, cache, first, cancel)
            if itls is None:
                return None
        share = (time.process_time() - cpu) / max(time.perf_counter() - wall, 1e-9)
        cache.clear()
        return ContextPoint(
            n,
            statistics.median(ttfts),
            runs,
            statistics.median(itls),
            len(itls),
            cache_bytes,
            "HF forward" if session.fast is None else "eager fast path",
            path,
            share,
            torch.get_num_threads(),
        )

    def close(self) -> None:
        """Drop the sweep's cache (its tensors go with it)."""
        self._cache = self._model = None

    # -- the parts ------------------------------------------------------------------
    def _ready_cache(self, session: ChatSession) -> KVCache:
        stale = self._cache is not None and self._cache.precision != KVCache.for_model(session.info).precision
        if self._cache is None or self._model is not session.model or stale:  # first, or model/cache changed
            self._cache, self._model = KVCache.for_model(session.info), session.model
            self._prompt = []
        return self._cache

    def _prompt_of(self, session: ChatSession, n: int) -> list[int]:
        while len(self._prompt) < n:
            self._prompt += session.tokenizer(FILLER, add_special_tokens=False)["input_ids"]
        return self._prompt[:n]

    def _warm_up(self, session: ChatSession, cache: KVCache) -> None:
        """One small untimed prefill and step the first time (thread pools, first-call allocations),
        then room in the cache's buffers for the whole point: growing them would be timed."""
        if not _initialized(cache):
            logits = session.forward(self._prompt[:SMALLEST], cache)
            session.forward([int(torch.argmax(logits))], cache)
        cache.clear()
        for layer in cache.layers:
            layer.buffers_with_room(len(self._prompt) + self.steps + 1)

    def _prefill(
        self, session: ChatSession, cache: KVCache, prompt: list[int], cancel: threading.Event
    ) -> tuple[float, int | None]:
        """Seconds to prefill `prompt` from an empty cache and take the first token (greedy); the token."""
        from engine.session import PREFILL_CHUNK

        cache.clear()
        started = time.perf_counter()
        for start in range(0, len(prompt), PREFILL_CHUNK):
            if cancel.is_set():
                return 0.0, None
            logits = session.forward(prompt[start : start + PREFILL_CHUNK], cache)
        first = int(torch.argmax(logits))  # reading the value waits for the device
        return time.perf_counter() - started, first

    def _decode(
        self, session: ChatSession, cache: KVCache, token: int, cancel: threading.Event
    ) -> list[float] | None:
        """Seconds of each decode step (forward one token, take the next greedily), as the chat's ITL."""
        itls = []
        for _ in range(self.steps):
            if cancel.is_set():
                return None
            started = time.perf_counter()
            token = int(torch.argmax(session.forward([token], cache)))
            itls.append(time.perf_counter() - started)
        return itls


def _initialized(cache: KVCache) -> bool:
    return all(layer.is_initialized for layer in cache.layers)


def main(argv: list[str] | None = None) -> None:
    """`python -m engine.instruments.context_sweep [MODEL] [--precision fp32] [--largest 2048]`:
    the app's sweep without the app, one JSON line per size, then the crossovers."""
    import argparse
    import dataclasses
    import json

    from engine import models
    from engine.session import ChatSession

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("model", nargs="?", default=models.DEFAULT_MODEL)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--largest", type=int, default=LARGEST)
    args = parser.parse_args(argv)
    session = ChatSession(models.load(args.model, args.precision, "cpu"))
    sweep = ContextSweep()
    for n in sizes(session.context, args.largest):
        print(json.dumps(dataclasses.asdict(sweep.measure(session, n))), flush=True)
    for shape in (shape_of(session), LLAMA_2_7B, LLAMA_2_70B):
        print(
            json.dumps(
                {
                    **dataclasses.asdict(shape),
                    "kv_bytes_per_token": shape.kv_bytes_per_token,
                    "crossover": shape.crossover,
                }
            )
        )


if __name__ == "__main__":
    main()
