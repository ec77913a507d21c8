"""The decode step compiled by torch.compile, built in the background while eager serves.

A batch-1 decode step is matrix-vector products: each weight is read once per token. aten's
batch-1 matmul reads float32 weights well below the memory bandwidth on a CPU; written as a
multiply-and-sum (`FastLlama._matvec`), Inductor generates one loop per matrix that streams
its rows at close to the bandwidth and fuses the ~25 small operations per layer around them
(norms, RoPE, casts, the cache write). How much faster, per precision: BENCHMARKS.md.

Compiling takes about a minute the first time and seconds once Inductor's on-disk cache (kept
in llmchat's cache directory) holds the artifacts. It never blocks: a daemon thread first has a
separate, lowest-priority process (`python -m engine.fast.compiled SPEC PRECISION`) compile the
same step into that cache, then compiles here from it against scratch buffers, and the
session switches to the compiled step at the first token after `ready`. Compiling in this
process from scratch would hold the GIL and the cores for a minute while an answer streams.
The eager fast path stays the reference; a test checks both pick the same tokens.

The step takes each layer's whole cache buffer (capacity marked dynamic, so the cache growing
does not recompile) and writes the new K/V at the position; attention reads the positions up
to it, through the decode-attention kernel (engine/fast/attention.py) that the same background job
builds first, or SDPA with the slots past it masked.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import threading
import time
import weakref
from typing import Callable

import platformdirs
import torch

from engine.errors import one_line
from engine.events import ModelInfo
from engine.fast import attention
from engine.fast.fused import FastLlama
from engine.kvcache import KVCache, PreallocatedLayer
from engine.quant.int8 import Int8Linear

os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR", os.path.join(platformdirs.user_cache_dir("llmchat"), "inductor")
)


def supports(fast: FastLlama) -> str | None:
    """None if the decode step of this fast path can be compiled here, else why not."""
    if fast.embed.device.type != "cpu":
        return "compiled decode is checked on CPU only so far (CUDA graphs are the GPU's next step)"
    if isinstance(fast.lm_head, Int8Linear):
        return "w8a8's fbgemm weights are opaque to the compiler"
    return None


class CompiledDecode:
    """`step(fast, token_id, cache)` once `ready`; `error` says why it never will be."""

    def __init__(self, fast: FastLlama, cache_dtype: torch.dtype, source: tuple[str, str] | None = None):
        # Weakly: the registry below is keyed by the fast path, which must be free to go.
        self._fast = weakref.ref(fast)
        self.source = source
        """(model spec, precision) a separate process can load to fill the compile cache first."""
        self.cache_dtype = cache_dtype
        self.ready = threading.Event()
        self.error: str | None = None
        self.compile_s = 0.0
        self.attention_error: str | None = None
        """Why the decode-attention kernel (engine/fast/attention.py) is not used, if it is not."""
        self._listeners: list[Callable[["CompiledDecode"], None]] = []
        self._lock = threading.Lock()
        self._step = torch.compile(FastLlama.step_on_buffers, dynamic=False, fullgraph=True)
        thread = threading.Thread(target=self._warm_up, name="llmchat-compile", daemon=True)
        _compiling[:] = [t for t in _compiling if t.is_alive()] + [thread]
        thread.start()

    def _warm_up(self) -> None:
        """Fill the on-disk cache in a separate process, then compile here from it."""
        started = time.perf_counter()
        if self.source is not None:
            _fill_cache_in_a_subprocess(*self.source)  # best effort: on failure we compile here
        self.attention_error = attention.load()  # before tracing, so the step calls the kernel
        fast = self._fast()
        if fast is None:
            return
        try:
            compile_once(self._step, fast, self.cache_dtype)
        except Exception as e:  # no C++ compiler, an unsupported op: eager keeps serving
            self.error = one_line(e, 200, named=True)
        self.compile_s = time.perf_counter() - started
        with self._lock:
            if self.error is None:
                self.ready.set()
            listeners, self._listeners = self._listeners, []
        for listener in listeners:
            listener(self)

    @property
    def done(self) -> bool:
        return self.ready.is_set() or self.error is not None

    def when_done(self, listener: Callable[["CompiledDecode"], None]) -> None:
        """Call `listener(self)` once compilation has finished or failed (now, if it has)."""
        with self._lock:
            if not self.done:
                self._listeners.append(listener)
                return
        listener(self)

    def step(self, fast: FastLlama, token_id: int, cache: KVCache) -> torch.Tensor:
        """Feed one token after the cache's positions; the logits [vocab]. Needs `ready`."""
        layers = cache.hf.layers
        buffers = [layer.buffers_with_room(1) for layer in layers]
        position = torch.tensor([len(cache)])
        logits = self._step(
            fast, torch.tensor([token_id]), position, [k for k, _ in buffers], [v for _, v in buffers]
        )
        for layer in layers:
            layer.advance(1)
        return logits

    def describe(self) -> str:
        if self.error:
            return f"compiled decode unavailable ({self.error}); the eager fast path serves"
        kernel = f"; attention by SDPA ({self.attention_error})" if self.attention_error else ""
        return (
            f"decode now runs the compiled step (torch.compile, ready after {self.compile_s:.0f} s "
            f"in the background){kernel}"
        )


def compile_once(step, fast: FastLlama, cache_dtype: torch.dtype) -> None:
    """One call of the compiled step on scratch buffers: compiles it, or loads it from the cache."""
    shape = (1, fast.kv_heads, PreallocatedLayer.initial_capacity, fast.head_dim)
    with torch.inference_mode():  # as the session's calls are: same guards, no recompiling
        keys = [torch.zeros(shape, dtype=cache_dtype) for _ in fast.layers]
        values = [torch.zeros(shape, dtype=cache_dtype) for _ in fast.layers]
        for buffer in keys + values:
            torch._dynamo.mark_dynamic(buffer, 2)  # any capacity, one compilation
        step(fast, torch.tensor([0]), torch.tensor([0]), keys, values)


_children: list[subprocess.Popen] = []


def _fill_cache_in_a_subprocess(spec: str, precision: str) -> bool:
    """Compile in another process at the lowest priority: a first compile there never competes
    with the chat for the GIL (in-process it slows an answer several-fold for a minute), and
    leaves artifacts that make the compile here take seconds. Killed if llmchat exits first."""
    command = [sys.executable, "-m", "engine.fast.compiled", spec, precision]
    try:
        child = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=lambda: os.nice(19)
        )
    except OSError:
        return False
    _children.append(child)
    try:
        return child.wait(timeout=900) == 0
    except subprocess.TimeoutExpired:
        child.kill()
        return False
    finally:
        _children.remove(child)


@atexit.register
def _stop_children() -> None:
    for child in list(_children):
        child.kill()


_compiling: list[threading.Thread] = []


def exit_if_compiling(code: int = 0) -> None:
    """End the process at once if a compile is still running in it. Interpreter shutdown under
    Inductor's native code aborts ("terminate called without an active exception", exit 134:
    seen when quitting the app in the seconds of the in-process compile), so a caller that has
    saved everything ends here instead, after stopping the compiling child process."""
    if any(thread.is_alive() for thread in _compiling):
        _stop_children()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


_built: "weakref.WeakKeyDictionary[FastLlama, CompiledDecode]" = weakref.WeakKeyDictionary()


def compiled_decode(fast: FastLlama, info: ModelInfo) -> CompiledDecode | None:
    """The compiled step for the fast path of the model `info` describes, started once; None
    where it is not supported."""
    if supports(fast) is not None:
        return None
    compiled = _built.get(fast)
    if compiled is None:
        if not _built:  # no live model has compiled code: forget that of models that are gone
            torch._dynamo.reset()
        source = (info.spec, info.precision)
        compiled = _built[fast] = CompiledDecode(fast, getattr(torch, info.cache_dtype), source)
    return compiled


def main(spec: str, precision: str) -> None:
    """`python -m engine.fast.compiled SPEC PRECISION`: compile the decode step once, for the cache."""
    from engine import models
    from engine.fast import fused

    loaded = models.load(spec, precision, "cpu")
    fast = fused.for_model(loaded.model, compiled=True)
    if supports(fast) is None:
        attention.load()
        step = torch.compile(FastLlama.step_on_buffers, dynamic=False, fullgraph=True)
        compile_once(step, fast, getattr(torch, loaded.info.cache_dtype))


if __name__ == "__main__":
    main(*sys.argv[1:3])
