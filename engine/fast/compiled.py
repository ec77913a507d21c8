"""The decode step compiled by torch.compile, built in the background while eager serves.

A batch-1 decode step is matrix-vector products: each weight is read once per token. aten's
batch-1 matmul reads float32 weights well below the memory bandwidth on a CPU; written as a
multiply-and-sum (`FastLlama._matvec`), Inductor generates one loop per matrix that streams
its rows at close to the bandwidth and fuses the ~25 small operations per layer around them
(norms, RoPE, casts, the cache write). How much faster, per precision: BENCHMARKS.md.

Two steps (engine/fast/steps.py), built one after the other: the regional one (one decoder
block compiled and run for every layer: ~5 s) serves first; the whole one (all layers in one
graph: ~30 s; one call per token instead of 31, 4-20% faster) takes over when built. Each is
compiled without Dynamo's guards (why that is safe: engine/fast/steps.py).

It never blocks: a daemon thread has a separate, lowest-priority process
(`python -m engine.fast.compiled SPEC PRECISION KIND CACHE_DTYPE`) compile each step ahead of
time and save it in llmchat's cache directory, then loads it here (a fraction of a second; at
once, without the child, where an earlier start saved this very step), and the session
switches at the next token. Compiling in this process would hold the GIL and the cores while
an answer streams: even from Inductor's on-disk cache, Dynamo's trace of the whole step held
it ~5 s, and an answer asked meanwhile crawled at 5-8 tok/s.
The eager fast path stays the reference; a test checks both pick the same tokens. A model or
precision switch `stop()`s the compile for the old one (its process killed, its result here
dropped), so switches never leave several compiles running at once.

The step takes each layer's whole cache buffer (capacity marked dynamic, so the cache growing
does not recompile) and writes the new K/V at the position; attention reads the positions up
to it, through the decode-attention kernel (engine/fast/attention.py) that the same background job
builds meanwhile, or SDPA with the slots past it masked; where the CPU has AVX-512, its
matrix-vector products go through the same library's matvec kernel (engine/fast/matvec.py).
A step is built for one cache dtype: a chat that switches its KV cache precision gets a step
of its own (the one left behind is kept once built). For an int8 cache the step quantizes the
new K/V rows and writes their scales too.

On a GPU nothing is compiled: the same whole step, eager, is recorded as a CUDA graph by its
first call and replayed per token (engine/fast/graphed.py), ready at once.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Callable

import platformdirs
import torch

from engine.errors import one_line
from engine.events import ModelInfo
from engine.fast import child_sessions, graphed, kernels, matvec, steps
from engine.fast.fused import FastLlama
from engine.kvcache import KVCache
from engine.quant.int8 import Int8Linear

if not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):  # set but empty, Inductor writes into the working directory
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(platformdirs.user_cache_dir("llmchat"), "inductor")


def supports(fast: FastLlama, cache_dtype: torch.dtype | None = None) -> str | None:
    """None if the decode step of this fast path (over a cache of `cache_dtype`, if given) can be
    compiled here, else why not."""
    device = fast.embed.device.type
    if device not in ("cpu", "cuda"):
        return f"no compiled decode step for {device} (CPU: torch.compile; CUDA: a CUDA graph)"
    if isinstance(fast.lm_head, Int8Linear):
        return "w8a8's fbgemm weights are opaque to the compiler"
    if len({steps.layer_signature(layer) for layer in fast.layers}) > 1:
        # one block's graph runs every layer, unguarded: they must match in shape and dtype
        return "its layers differ in shape or dtype, and one compiled block serves every layer"
    if cache_dtype == torch.int8 and device == "cuda":  # its attention is the CPU kernel's
        return "an int8 KV cache decodes on the eager fast path on a GPU"
    return None


class CompiledDecode:
    """`step(fast, token_id, cache)` once `ready`; `error` says why it never will be."""

    def __init__(
        self,
        fast: FastLlama,
        cache_dtype: torch.dtype,
        source: tuple[str, str] | None = None,
        cuda_graph: bool = False,
    ):
        # Weakly: the registry below is keyed by the fast path, which must be free to go.
        self._fast = weakref.ref(fast)
        self.source = source
        """(model spec, precision) a separate process can load to compile and save the step first."""
        self.cache_dtype = cache_dtype
        self.ready = threading.Event()
        self.started = time.monotonic()
        self.error: str | None = None
        self.gave_up = False
        """The background process ran past CHILD_TIMEOUT_S: no compile here either (it would hold
        the GIL and the cores while an answer streams)."""
        self.compile_s = 0.0
        self.kernel_error: str | None = None
        """Why the step's kernel (attention, matvec: engine/fast/kernels.py) is not used, if it is not."""
        self.notes: list[str] = []
        """What the background job met that the user should know (a stale build lock removed)."""
        self._listeners: list[Callable[["CompiledDecode"], None]] = []
        self._lock = threading.Lock()
        self._stopped = False
        self._child: subprocess.Popen | None = None
        self._finished = threading.Event()
        self._step: Callable | None = None
        self.kind = "regional"
        """Which step of engine/fast/steps.py serves once ready: the whole one once it took over;
        on a GPU "graph", the whole step recorded as a CUDA graph."""
        self.whole_s = 0.0
        """When the whole step took over (0 until it does)."""
        self.whole_error: str | None = None
        """Why the whole step never took over, where it failed; the regional one goes on serving."""
        self._upgrade_listeners: list[Callable[["CompiledDecode"], None]] = []
        self._settled = threading.Event()
        self.verify_ready = threading.Event()
        """The verify step (a speculative round's few tokens) is built: `verify` serves."""
        self.verify_error: str | None = None
        """Why the verify step is not built or never will be, where it is not."""
        self._verify_step: Callable | None = None
        self._verify_thread: threading.Thread | None = None
        self._verify_done = threading.Event()
        self._verify_listeners: list[Callable[["CompiledDecode"], None]] = []
        self._failure_listeners: list[Callable[["CompiledDecode"], None]] = []
        if cuda_graph:  # nothing to compile: the step's first call records it (engine/fast/graphed.py)
            self._step, self.kind = graphed.GraphedStep(steps.whole_step), "graph"
            for done in (self.ready, self._finished, self._settled):
                done.set()
            return
        self._thread = threading.Thread(target=self._warm_up, name="llmchat-compile", daemon=True)
        _compiling[:] = [t for t in _compiling if t.is_alive()] + [self._thread]
        self._thread.start()

    @property
    def stopped(self) -> bool:
        """Stopped for a model no longer in use (a stopped build is started afresh when wanted)."""
        return self._stopped

    def _warm_up(self) -> None:
        """`_build_steps` on this thread. An error it does not expect leaves eager serving and
        says why: a thread that died here once left the app "compiling" for good, its finished
        child never reaped."""
        try:
            self._build_steps()
        except Exception as e:
            self._thread_failed(f"the compile thread failed: {one_line(e, named=True)}")

    def _thread_failed(self, why: str) -> None:
        """Record `why` as the error of what was being built, and tell its listeners."""
        with self._lock:
            if self.ready.is_set():  # the regional step serves; only its upgrade failed
                self.whole_error = self.whole_error or why
                listeners, self._upgrade_listeners = self._upgrade_listeners, []
            else:
                self.error = self.error or why
                listeners, self._listeners = self._listeners, []
            self._finished.set()
        for listener in listeners:
            listener(self)
        self._settled.set()

    def _build_steps(self) -> None:
        """The regional step, then the whole one (engine/fast/steps.py): the first ready in
        seconds, the second, faster per token, taking over when it is built."""
        started = time.perf_counter()
        # The step's kernel (~6 s of the C++ compiler on a fresh machine) builds here meanwhile,
        # beside the child's compile, which traces the step without it (kernels.stand_in).
        # Built once per machine; cached, it only loads.
        _build_in_background("step")
        step, error, timed_out = self._compile("regional")
        with self._lock:
            if self._stopped:  # compiled for a model no longer in use: dropped
                return
            self.compile_s = time.perf_counter() - started
            self.gave_up = timed_out
            self.error = f"the build ran past {CHILD_TIMEOUT_S:.0f} s" if timed_out else error
            if step is not None:
                self._step = step
                self.ready.set()
            self._finished.set()
            listeners, self._listeners = self._listeners, []
        for listener in listeners:
            listener(self)
        # The sampler's kernel after the first step: nothing waits for it, and built beside the
        # child's compile it made a first start's step ready later.
        _build_in_background("sampling")
        if step is not None:
            whole, error, timed_out = self._compile("whole")
            with self._lock:
                failed = self.error is not None  # the regional step failed while serving (`served`)
                if whole is not None and not self._stopped and not failed:
                    self._step, self.kind = whole, "whole"
                    self.whole_s = time.perf_counter() - started
                elif error or timed_out:
                    self.whole_error = f"the build ran past {CHILD_TIMEOUT_S:.0f} s" if timed_out else error
                listeners, self._upgrade_listeners = ([] if failed else self._upgrade_listeners), []
            for listener in listeners:
                listener(self)
        self._settled.set()

    def want_verify(self) -> None:
        """Build the verify step (engine/fast/steps.py VERIFY), once, after the plain steps (one
        compile child at a time): a speculative answer asks for it, and its verify passes run eager
        until it is ready. Nothing is built where no one speculates."""
        with self._lock:
            if self.kind == "graph":  # a GPU's step is a recorded graph of one token
                self.verify_error = "a verify on a GPU runs the eager fast path"
            if self._verify_thread is not None or self._stopped or self.verify_error is not None:
                return
            thread = threading.Thread(target=self._build_verify, name="llmchat-compile-verify", daemon=True)
            self._verify_thread = thread
        _compiling[:] = [t for t in _compiling if t.is_alive()] + [thread]
        thread.start()

    def _build_verify(self) -> None:
        try:
            self._settled.wait()
            if not self.ready.is_set():  # the plain steps failed or were stopped: so would this
                return
            step, error, timed_out = self._compile(steps.VERIFY)
            with self._lock:
                if step is not None and not self._stopped:
                    self._verify_step = step
                    self.verify_ready.set()
                elif error or timed_out:
                    self.verify_error = f"the build ran past {CHILD_TIMEOUT_S:.0f} s" if timed_out else error
        except Exception as e:  # as `_warm_up`: the verify stays eager, and says why
            self.verify_error = f"the compile thread failed: {one_line(e, named=True)}"
        finally:  # the listeners told before `wait_verify` returns (one added meanwhile too)
            while True:
                with self._lock:
                    listeners, self._verify_listeners = self._verify_listeners, []
                    if not listeners:
                        self._verify_done.set()
                        break
                for listener in listeners if not self._stopped else ():
                    listener(self)

    def when_verify_built(self, listener: Callable[["CompiledDecode"], None]) -> None:
        """Call `listener(self)` once a verify step asked for is built or failed to be (now, if it
        has; never if none is asked for, or once stopped)."""
        with self._lock:
            if not self._verify_done.is_set():
                self._verify_listeners.append(listener)
                return
            stopped = self._stopped
        if not stopped:
            listener(self)

    def describe_verify(self) -> str:
        """One line for the chat once a verify step was asked for: what a speculative round's verify runs."""
        if self.verify_ready.is_set():
            return f"a speculative round's verify ({VERIFY_ROWS}) now runs compiled too"
        return f"a speculative round's verify stays on the eager fast path ({self.verify_error})"

    def wait_verify(self, timeout: float | None = None) -> bool:
        """Wait until the verify step asked for (`want_verify`) is built or failed; whether it has
        (at once where none was asked for)."""
        return self._verify_thread is None or self._verify_done.wait(timeout)

    def verifies(self, rows: int) -> bool:
        """Whether a forward of `rows` new tokens (every row's logits) runs the verify step now."""
        return self.verify_ready.is_set() and 2 <= rows <= steps.MAX_VERIFY_ROWS

    def _compile(self, kind: str) -> tuple[Callable | None, str | None, bool]:
        """A compiled step of `kind`, loaded as a separate process saved it (there first, unless
        an earlier start saved this very step), or compiled here where that failed: (step,
        None, False), or (None, why, whether the child ran past its time), or (None, None,
        False) once stopped."""
        fast = self._fast()
        saved = steps.saved_path(fast, self.cache_dtype, kind) if fast is not None else None
        del fast  # held weakly: a switch may drop the model while the child compiles
        wanted = self.source is not None and not self._stopped and not (saved and saved.exists())
        # best effort: on failure we compile here
        timed_out = wanted and _compile_in_a_subprocess(
            *self.source, kind, self.cache_dtype, self._child_started
        )
        if kind == steps.REGIONAL:  # what a child started as the model loaded made, or had to
            stop_early(self.source)
        if timed_out:
            return None, None, True
        if self._stopped:
            return None, None, False
        self.kernel_error = kernels.load("step")  # first: the step calls it
        self._note(kernels.take_notes())
        if self.kernel_error is not None:  # the saved step calls the kernel: this one must not
            saved = None
        fast = self._fast()
        if fast is None or self._stopped:
            return None, None, False
        # Loading (tenths of a second of Python) or compiling here (seconds) holds the GIL: a chat
        # streaming meanwhile waits for it at each op, for up to the switch interval (5 ms: 250 ms tokens).
        try:
            with _short_switch_interval():
                parts = self._load(saved) if saved is not None and saved.exists() else None
                if parts is None:
                    parts = steps.compile_here(kind, fast, self.cache_dtype)
                    if saved is not None:
                        with contextlib.suppress(OSError):  # without it the next start compiles again
                            steps.save(parts, saved)
        except Exception as e:  # no C++ compiler, an unsupported op: eager keeps serving
            return None, one_line(e, 200, named=True), False
        return steps.assemble(kind, parts), None, False

    def _load(self, saved: Path) -> dict | None:
        """The parts of a saved step, or None (and a note why) where the file cannot be loaded."""
        try:
            return steps.load(saved)
        except Exception as e:  # a truncated or foreign file: compiled again here, and replaced
            why = one_line(e, 120, named=True)
            self._note([f"the saved decode step could not be loaded ({why}); compiled again"])
            return None

    @property
    def state(self) -> str:
        """'building', 'ready', 'failed', 'given up' or 'stopped' (engine/events.py CompileState)."""
        if self.ready.is_set():
            return "ready"
        if self._stopped:
            return "stopped"
        if self.gave_up:
            return "given up"
        return "failed" if self.error is not None else "building"

    def _note(self, notes: list[str]) -> None:
        self.notes += [note for note in notes if note not in self.notes]

    def _child_started(self, child: subprocess.Popen) -> None:
        with self._lock:
            self._child = child
            stopped = self._stopped
        if stopped:
            _kill(child)
            return
        # While it compiles: Inductor's imports, ~0.35 s of the load here of what it saves. Only
        # a head start: an import racing another thread's (the kernel build's) may raise here.
        with contextlib.suppress(Exception):
            import torch._inductor.compile_fx  # noqa: F401

    def stop(self) -> None:
        """Abandon this compile (its model or precision is being replaced): the child process is
        killed at once, the compile here is skipped or its result dropped, no listener is called."""
        with self._lock:
            if self._settled.is_set():
                return
            self._stopped = True
            if not self.ready.is_set():  # a ready step stays; only its upgrade stops
                self.error = "stopped: the model, precision or KV cache changed"
            self._listeners, self._upgrade_listeners = [], []
            child = self._child
            self._finished.set()
            self._settled.set()
        if child is not None:
            _kill(child)  # the compiling thread's wait() reaps it

    @property
    def done(self) -> bool:
        return self.ready.is_set() or self.error is not None

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until compilation has finished, failed or was stopped; whether it has."""
        return self._finished.wait(timeout)

    def wait_settled(self, timeout: float | None = None) -> bool:
        """Wait until no other step will take over (the whole one did, or failed); whether so."""
        return self._settled.wait(timeout)

    def when_upgraded(self, listener: Callable[["CompiledDecode"], None]) -> None:
        """Call `listener(self)` once the whole step took over or failed to (never if stopped, or
        where the regional step never became ready)."""
        with self._lock:
            if not self._settled.is_set():
                self._upgrade_listeners.append(listener)
                return
            tried = self.kind == "whole" or self.whole_error is not None
        if tried:
            listener(self)

    def when_done(self, listener: Callable[["CompiledDecode"], None]) -> None:
        """Call `listener(self)` once compilation has finished or failed (now, if it has)."""
        with self._lock:
            if not self.done:
                self._listeners.append(listener)
                return
        listener(self)

    def when_failed(self, listener: Callable[["CompiledDecode"], None]) -> None:
        """Call `listener(self)` if a step that served fails while decoding (`served`)."""
        with self._lock:
            self._failure_listeners.append(listener)

    def served(self, run: Callable[..., torch.Tensor], *args) -> torch.Tensor | None:
        """`run(*args)` (`step` or `verify`); None where it raised: the compiled steps serve no
        more, the eager path decodes (the cache was left as it was), and the listeners hear why.
        A step that fails once would fail each token after it (seen twice in tests on a tiny model:
        a token id past the vocabulary reached Inductor's embedding lookup)."""
        try:
            return run(*args)
        except RuntimeError as e:
            with self._lock:
                self.ready.clear()
                self.verify_ready.clear()
                self.error = f"the step failed while decoding, {one_line(e, 240)}"
                listeners, self._failure_listeners = self._failure_listeners, []
            for listener in listeners:
                listener(self)
            return None

    def step(self, fast: FastLlama, token_id: int, cache: KVCache) -> torch.Tensor:
        """Feed one token after the cache's positions; the logits [vocab]. Needs `ready`."""
        return _feed(self._step, fast, [token_id], cache)

    def verify(self, fast: FastLlama, ids: list[int], cache: KVCache) -> torch.Tensor:
        """Feed a few tokens after the cache's positions (`verifies(len(ids))`); each one's logits
        [n, vocab]."""
        return _feed(self._verify_step, fast, ids, cache)

    def describe(self) -> str:
        """One line for the chat: what decodes now, and why not the compiled step or the kernel."""
        notes = "".join(f"; {note}" for note in self.notes)
        if self.gave_up:
            return f"compiled decode given up ({self.error}); the eager fast path serves{notes}"
        if self.error:
            return f"compiled decode unavailable ({self.error}); the eager fast path serves{notes}"
        kernel = f"; {WITHOUT_KERNEL} ({self.kernel_error})" if self.kernel_error else ""
        fast = self._fast()
        if not self.kernel_error and fast is not None and matvec.steps_use_kernel(fast):
            isa = "AVX-512" if torch.backends.cpu.get_cpu_capability() == "AVX512" else "AVX2"
            kernel = f"; each weight matrix streamed by llmchat's matvec kernel ({isa})"
        how = self.how() if self.kind == "graph" else f"torch.compile: {self.how()}"
        verify = f"; a verify of {VERIFY_ROWS} too" if self.verify_ready.is_set() else ""
        return f"decode now runs the compiled step ({how}){verify}{kernel}{notes}"

    def how(self) -> str:
        """Which compiled step serves and since when, short enough for the Phase panel."""
        if self.kind == "graph":
            return "a CUDA graph of the whole step, replayed per token"
        if self.kind == "whole":
            return f"whole model in one graph, after {self.whole_s:.0f} s"
        regional = f"layer by layer, ready after {self.compile_s:.0f} s"  # 52 cells with "; whole model next"
        if self.whole_error:
            return f"{regional}; whole model failed: {self.whole_error}"
        if not self._settled.is_set():
            return f"{regional}; whole model next"
        return regional


def _feed(step: Callable, fast: FastLlama, ids: list[int], cache: KVCache) -> torch.Tensor:
    """Run a compiled `step` on `ids` after the cache's positions, writing their K/V in place."""
    layers, n, start = cache.layers, len(ids), len(cache)
    buffers, offsets = steps.cache_buffers(layers, n), steps.cache_offsets(layers)
    try:
        logits = step(fast, torch.tensor(ids), torch.arange(start, start + n), offsets, *buffers)
    except RuntimeError as e:  # Inductor's own words name no input ("index out of bounds: 0 <= tmp7 < 399")
        fed = f"fed {ids} at position {start} of {len(buffers[0][0][0, 0])}, vocabulary {len(fast.embed)}"
        raise RuntimeError(f"{fed}: {e}") from e
    for layer in layers:
        layer.advance(n)
    return logits


VERIFY_ROWS = f"2-{steps.MAX_VERIFY_ROWS} tokens"

WITHOUT_KERNEL = "attention by SDPA, matrix-vector products by Inductor's loop"
"""What a compiled step does without the step's kernel."""

SWITCH_INTERVAL_S = 0.0001
"""The GIL's switch interval while a step compiles in this process (Python's default: 5 ms)."""

_switch_lock = threading.Lock()
_switch_users = 0
_usual_switch_interval = 0.0


@contextlib.contextmanager
def _short_switch_interval():
    """The switch interval at SWITCH_INTERVAL_S while any step is made ready here. Counted: the
    first in saves the usual interval and the last out restores it. Two builds overlap (a precision
    switch mid-build); each restoring what it saw left the short interval set for good."""
    global _switch_users, _usual_switch_interval
    with _switch_lock:
        if _switch_users == 0:
            _usual_switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(SWITCH_INTERVAL_S)
        _switch_users += 1
    try:
        yield
    finally:
        with _switch_lock:
            _switch_users -= 1
            if _switch_users == 0:
                sys.setswitchinterval(_usual_switch_interval)


_children: list[subprocess.Popen] = []
CHILD_TIMEOUT_S = 900
"""The compile child is killed past this (a first whole-step compile takes ~30 s; more on busy cores)."""


def _child_command(spec: str, precision: str, kind: str, cache_dtype: str) -> list[str]:
    return [sys.executable, "-m", "engine.fast.compiled", spec, precision, kind, cache_dtype]


def _start_child(key: tuple[str, str, str, str]) -> subprocess.Popen | None:
    """A compile child for `key` (spec, precision, kind, cache dtype), at the lowest priority;
    None where it cannot start."""
    try:
        # Not preexec_fn: it runs Python's at-fork hooks in the forking thread, and logging's
        # waits for its lock; with another thread inside logging (the kernel build's imports)
        # the start hung for good. The child is made lowest-priority once it exists.
        quiet = subprocess.DEVNULL
        child = child_sessions.start(_child_command(*key), stdout=quiet, stderr=quiet)
    except OSError:
        return None
    with contextlib.suppress(OSError, AttributeError):  # no setpriority: it runs at ours
        os.setpriority(os.PRIO_PROCESS, child.pid, 19)
    _children.append(child)
    return child


_early: dict[tuple[str, str, str, str], subprocess.Popen] = {}
"""Compile children started before their model was loaded (`start_early`), by their key."""
_early_lock = threading.Lock()


def start_early(spec: str, precision: str, cache_dtype: torch.dtype) -> None:
    """Start the regional step's compile child as the app starts loading the model, not once it
    has: the child reads the weights alone (engine/fast/checkpoint.py) and compiles while the app
    loads the model through transformers (Gemma 3 270M: ~5 s, SmolLM2: ~3 s), and the session's
    build takes it over (`_compile`). Not where an earlier start made this step, or found nothing
    to compile (`steps.made_before`): the child would load the model to learn just that."""
    key = (spec, precision, steps.REGIONAL, str(cache_dtype).removeprefix("torch."))
    if key in _early:
        return
    stop_early()  # one for a model no longer being loaded would only compete
    if steps.made_before(*key):
        return
    child = _start_child(key)
    if child is not None:
        with _early_lock:
            _early[key] = child


def _take_early(key: tuple[str, str, str, str]) -> subprocess.Popen | None:
    """The child `start_early` started for `key`, if any, now the caller's to wait for."""
    with _early_lock:
        return _early.pop(key, None)


def stop_early(source: tuple[str, str] | None = None) -> None:
    """Kill the children `start_early` started that no build took over: for the model `source`
    (spec, precision; None: for any). Its session wanted another step (a KV cache of the user's
    choice), or found it saved: they would only compete for the cores."""
    with _early_lock:
        stale = [key for key in _early if source is None or key[:2] == source]
        children = [_early.pop(key) for key in stale]
    for child in children:
        _kill(child)
        _children.remove(child)


def _compile_in_a_subprocess(
    spec: str,
    precision: str,
    kind: str,
    cache_dtype: torch.dtype,
    started: Callable[[subprocess.Popen], None] | None = None,
) -> bool:
    """Compile in another process at the lowest priority: a first compile there never competes
    with the chat for the GIL (in-process it slows an answer several-fold while it runs), and
    it saves the step for the app to load (`steps.saved_path`). One `start_early` started is
    taken over. Killed if llmchat exits first or it runs past CHILD_TIMEOUT_S; `started(child)`
    may kill it sooner. Returns whether it was killed for running past CHILD_TIMEOUT_S."""
    key = (spec, precision, kind, str(cache_dtype).removeprefix("torch."))
    child = _take_early(key) or _start_child(key)
    if child is None:
        return False
    try:
        if started is not None:
            started(child)
        child.wait(timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _kill(child)
        return True
    except BaseException:  # `started` failed: no child left compiling or unreaped
        _kill(child)
        raise
    finally:
        _children.remove(child)
    return False


def _kill(child: subprocess.Popen) -> None:
    """Kill the compile child and what it started (the C++ compiler, Inductor's workers, which
    would go on building into the same directories): its whole session. Then reap it: no zombie."""
    child_sessions.end(child)


@atexit.register
def _stop_children() -> None:
    for child in list(_children):
        _kill(child)
    kernels.stop_builds()


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


_built: "weakref.WeakKeyDictionary[FastLlama, dict]" = weakref.WeakKeyDictionary()
"""Each live fast path's compiled steps by the KV cache dtype each was built for."""


BUILD_NICENESS = 10
"""The kernels' build thread's niceness: an answer (0) comes first, the compile child (19) after."""


def _build_in_background(kernel: str) -> None:
    """engine/fast/kernels.py's `kernel`, on a thread of its own at a low priority (its errors
    say why in `load`): on a fresh machine its C++ compiler ran beside an answer asked at once,
    and the answer crawled. On Linux a thread has its own niceness, and the compiler it starts
    inherits it. Above the compile child's, which needs the kernel too: at 19 both, the first
    step was ready 1-2 s later."""

    def build() -> None:
        with contextlib.suppress(OSError, AttributeError):  # no setpriority: it builds at ours
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BUILD_NICENESS)
        kernels.load(kernel)

    threading.Thread(target=build, name=f"llmchat-{kernel}-build", daemon=True).start()


def compiled_decode(fast: FastLlama, info: ModelInfo) -> CompiledDecode | None:
    """The compiled step for the fast path of the model `info` describes, over its KV cache
    (`info.cache_dtype`: the precision's own or the one a chat chose), started once; None where
    it is not supported."""
    cache_dtype = getattr(torch, info.cache_dtype)
    if supports(fast, cache_dtype) is not None:
        return None
    if not _built:  # no live model has compiled code: forget that of models that are gone
        torch.compiler.reset()
    built = _built.setdefault(fast, {})
    compiled = built.get(cache_dtype)
    if compiled is None or compiled.stopped:
        source = (info.spec, info.precision)
        on_gpu = fast.embed.device.type == "cuda"
        compiled = built[cache_dtype] = CompiledDecode(fast, cache_dtype, source, on_gpu)
    return compiled


def main(spec: str, precision: str, kind: str, cache_dtype: str) -> None:
    """`python -m engine.fast.compiled SPEC PRECISION KIND CACHE_DTYPE`: compile a decode step
    and save it where the app loads it from (`steps.saved_path`)."""
    from engine import models
    from engine.fast import fused

    child_sessions.end_with_parent()  # the app was killed: nothing is left compiling
    # On one thread: the load runs beside the app's build of the step's kernel, and torch's
    # parallel loops wait at each step for the thread on the busy core (w8's load: 0.4 -> 10 s).
    # The compile keeps torch's thread count, which Inductor writes into the code it generates.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # No transformers where the checkpoint allows (~2 s sooner), no tokenizer of transformers' (Gemma
    # 3's: ~2.6 s), no chat template: a base model (--raw) compiles too.
    loaded = models.load(spec, precision, "cpu", fast_only=True, chat=False, tokenizer=False)
    fast = fused.for_model(loaded.model, compiled=True, in_huge_pages=False)  # it only traces
    torch.set_num_threads(threads)
    dtype = getattr(torch, cache_dtype)
    saved = steps.saved_path(fast, dtype, kind) if supports(fast, dtype) is None else None
    if saved is not None and not saved.exists():  # None: nothing to compile, or nowhere to save it
        # The app builds the step's kernel meanwhile (and says what went wrong, if anything);
        # this step is traced calling it, as the app's will be once it has loaded it.
        kernels.stand_in()
        steps.save(steps.compile_here(kind, fast, dtype), saved)
    steps.note_made(spec, precision, kind, cache_dtype, saved)


if __name__ == "__main__":
    main(*sys.argv[1:5])
    # Everything is on disk by now; the interpreter's own shutdown (Inductor's compile workers
    # and thread pools) would add ~1.5 s to a first start's wait for the step.
    sys.stdout.flush()
    os._exit(0)
