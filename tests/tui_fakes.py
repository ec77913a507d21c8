"""A stand-in for the inference worker that emits real engine events from its own thread.

It behaves like `engine.worker.InferenceWorker` as the app sees it (commands in, events
out, cancel and sampling changes reaching a turn at its next token), with a scripted
answer, so app tests are fast and their panels' contents are known exactly.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Callable

from engine.events import (
    CacheChanged,
    Candidate,
    Contention,
    DecodeStep,
    Failed,
    ModelInfo,
    ModelLoading,
    ModelReady,
    PhaseChanged,
    PrefillProgress,
    PromptTokens,
    TokenSampled,
    TurnFinished,
    TurnStats,
)
from engine.thinking import thinking_figures

COMPILE_OFF = DecodeStep("eager", "SDPA", "off", "compile off: --no-compile (or LLMCHAT_COMPILE=0)")
"""What the worker says after a load in tests (LLMCHAT_COMPILE=0), as engine/fast/step_path.py words it."""

INFO = ModelInfo(
    spec="fake-135m",
    name="fake-135m",
    precision="fp32",
    device="cpu",
    compute_dtype="float32",
    cache_dtype="float32",
    parameters=134_515_008,
    weight_bytes=538_060_032,
    layers=30,
    heads=9,
    kv_heads=3,
    head_dim=64,
    hidden_size=576,
    vocab_size=49152,
    context=8192,
    cache_element_bytes=4,
    load_s=0.5,
)
ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 2, "nf4": 2, "w8a8": 4, "w8": 4}

PROMPT = (
    (1, "<|im_start|>"),
    (4093, "user"),
    (198, "\n"),
    (1780, "What"),
    (314, " is"),
    (260, " the"),
    (3575, " capital"),
    (282, " of"),
    (4649, " France"),
    (47, "?"),
    (2, "<|im_end|>"),
    (198, "\n"),
    (1, "<|im_start|>"),
    (520, "assistant"),
    (198, "\n"),
)
ANSWER = (
    (378, "The", 0.93),
    (3575, " capital", 0.71),
    (282, " of", 0.98),
    (4649, " France", 0.88),
    (314, " is", 0.95),
    (7042, " Paris", 0.62),
    (30, ".", 0.41),
    (2, "<|im_end|>", 0.97),
)
RUNNERS_UP = ((216, " **", 0.05), (2362, " city", 0.03), (28, ",", 0.02))


def candidates(token_id: int, piece: str, prob: float) -> tuple[Candidate, ...]:
    """A deterministic top-4: the chosen token first, then fixed runners-up."""
    rest = tuple(Candidate(i, p, q * (1 - prob) / 0.1) for i, p, q in RUNNERS_UP if i != token_id)
    return (Candidate(token_id, piece, prob),) + rest


@dataclass
class Turn:
    prompt: str
    temperatures: list[float]


class FakeEngine:
    session = None
    """No session for the instruments to read: they wait for a model, as before one has loaded."""

    def __init__(
        self,
        emit: Callable,
        sampling,
        *,
        answer=ANSWER,
        token_s: float = 0.0,
        hold_after: int | None = None,
        fail_load: str | None = None,
        load_gate: threading.Event | None = None,
        decode_step: DecodeStep | None = COMPILE_OFF,
        contention: Contention | None = None,
    ):
        self.emit = emit
        self.sampling = sampling
        self.answer = answer
        self.token_s = token_s
        self.hold_after = hold_after
        """Pause each turn after this many tokens until `release` is set (or the turn is cancelled)."""
        self.fail_load = fail_load
        self.load_gate = load_gate
        """When given, each load waits for it before finishing (a slow load)."""
        self.decode_step = decode_step
        """Said after each load, as the worker does."""
        self.contention = contention
        """The CPU share each turn reports (None: not measured)."""
        self.holding = threading.Event()
        self.release = threading.Event()
        self.cancelled = threading.Event()
        self.calls: list[tuple] = []
        self.turns: list[Turn] = []
        self.cache_tokens = 0
        self.info = INFO
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    # -- the interface the app uses --------------------------------------------------
    def load(
        self,
        spec: str,
        precision: str = "fp32",
        device: str = "auto",
        raw: bool = False,
        chat_template: str | None = None,
        thinking: bool | None = None,
    ) -> None:
        self.calls.append(("load", spec, precision, device))
        self._queue.put(("load", precision))

    def connect(self, target) -> None:
        """The fake has no server: it records the call (remote app tests use a real llama-server)."""
        self.calls.append(("connect", target))

    def send(self, text: str) -> None:
        self.calls.append(("send", text))
        self._queue.put(("send", text))

    def regenerate(self) -> None:
        self.calls.append(("regenerate",))
        self._queue.put(("send", self.turns[-1].prompt if self.turns else None))

    def new_chat(self, system_prompt=None) -> None:
        self.calls.append(("new_chat",))
        self._queue.put(("new_chat", None))

    def edit(self, index: int, text: str) -> None:
        self.calls.append(("edit", index, text))

    def resume(self, ref, use_cache: bool = True) -> None:
        self.calls.append(("resume", ref))

    def step_version(self, index: int, step: int) -> None:
        self.calls.append(("step_version", index, step))

    def fork(self, step: int, token_id: int, answer: int | None = None) -> None:
        self.calls.append(("fork", step, token_id, answer))

    def call(self, fn) -> Future:
        """As the real worker answers without a session: the future holds the error."""
        self.calls.append(("call",))
        future: Future = Future()
        future.set_exception(RuntimeError("no model is loaded"))
        return future

    def call_at_gate(self, fn):
        raise RuntimeError("no step is waiting at the gate")

    def cancel(self) -> None:
        self.calls.append(("cancel",))
        self.cancelled.set()

    def set_sampling(self, settings, chosen=()) -> None:
        self.calls.append(("set_sampling", settings))
        self.sampling = settings

    def set_speculation(self, choice, k: int = 4) -> None:
        self.calls.append(("set_speculation", choice, k))

    def set_cache_precision(self, precision: str) -> None:
        self.calls.append(("set_cache_precision", precision))

    def shutdown(self, timeout: float = 5.0) -> None:
        self.cancelled.set()
        self.release.set()
        self._queue.put(("stop", None))

    # -- the thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            kind, arg = self._queue.get()
            if kind == "stop":
                return
            if kind == "load":
                self._load(arg)
            elif kind == "send":
                self._turn(arg)
            elif kind == "new_chat":
                self.cache_tokens = 0

    def _load(self, precision: str) -> None:
        for fraction in (0.0, 0.5):
            self.emit(ModelLoading("reading weights", fraction))
        if self.load_gate is not None:
            self.load_gate.wait(10)
        self.emit(ModelLoading("reading weights", 1.0))
        if self.fail_load:
            self.emit(Failed(self.fail_load))
            return
        element = ELEMENT_BYTES[precision]
        self.info = replace(
            INFO,
            precision=precision,
            cache_element_bytes=element,
            cache_dtype="float32" if element == 4 else "bfloat16",
        )
        self.cache_tokens = 0
        self.emit(ModelReady(self.info))
        if self.decode_step is not None:
            self.emit(self.decode_step)

    def _cache(self) -> CacheChanged:
        per_token = self.info.kv_bytes_per_token
        return CacheChanged(self.cache_tokens, self.cache_tokens * per_token, per_token, self.info.context)

    def _turn(self, prompt: str | None) -> None:
        if prompt is None:
            self.emit(Failed("nothing to regenerate yet"))
            return
        self.cancelled.clear()
        turn = Turn(prompt, [])
        self.turns.append(turn)
        ids = tuple(i for i, _ in PROMPT)
        reused = min(self.cache_tokens, len(ids) - 1)
        self.emit(PromptTokens(ids, tuple(p for _, p in PROMPT), reused))
        self.emit(PhaseChanged("prefill", len(ids) - reused, reused))
        self.emit(PrefillProgress(len(ids) - reused, len(ids) - reused))
        self.cache_tokens = len(ids)
        self.emit(self._cache())
        text, stop, steps = "", "eos", []
        for index, (token_id, piece, prob, *thought) in enumerate(self.answer):  # a 4th True: thought
            if index == self.hold_after:
                self.holding.set()
                while not (self.release.wait(0.01) or self.cancelled.is_set()):
                    pass
            if self.token_s:
                time.sleep(self.token_s)
            turn.temperatures.append(self.sampling.temperature)
            end = piece == "<|im_end|>"
            steps.append(
                TokenSampled(
                    index,
                    token_id,
                    piece,
                    "" if end else piece,
                    math.log(prob),
                    top := candidates(token_id, piece, prob),
                    0.120 if index == 0 else 0.020 + 0.001 * index,
                    self.cache_tokens,
                    entropy=-sum(c.prob * math.log(c.prob) for c in top if c.prob > 0),  # they hold it all
                    thinking=thought == [True],
                )
            )
            self.emit(steps[-1])
            if index == 0:
                self.emit(PhaseChanged("decode"))
            if end:
                break
            text += piece
            if self.cancelled.is_set():
                stop = "cancelled"
                break
            self.cache_tokens += 1
            self.emit(self._cache())
        generated = len(turn.temperatures)
        thinking = thinking_figures(steps)
        self.emit(self._cache())
        self.emit(PhaseChanged("idle"))
        self.emit(
            TurnFinished(
                TurnStats(
                    len(ids),
                    reused,
                    len(ids) - reused,
                    generated,
                    0.120,
                    0.023,
                    0.026,
                    125.0,
                    43.5,
                    stop,
                    contention=self.contention,
                    thought_tokens=thinking.tokens,
                    first_thought_s=thinking.first_thought_s,
                    first_answer_s=thinking.first_answer_s,
                ),
                text,
            )
        )


class FakeFactory:
    """An engine factory for `make_app` that keeps the engine it made for the test to drive."""

    def __init__(self, **options) -> None:
        self.options = options
        self.engine: FakeEngine | None = None

    def __call__(self, emit, sampling, system, context) -> FakeEngine:
        self.engine = FakeEngine(emit, sampling, **self.options)
        return self.engine


def fake_app(factory, tmp_path, **options):
    """The app with a fake engine, no cursor blink, and the config file under tmp_path."""
    from tui.app import make_app
    from tui.options import AppOptions

    return make_app(AppOptions(cursor_blink=False, config_path=tmp_path / "config.json", **options), factory)


def real_tiny_app(recorder, tiny_model_dir, tmp_path, sampling: dict, **options):
    """The app on the real engine (through `recorder.factory`) with the tiny model on the CPU."""
    return fake_app(
        recorder.factory, tmp_path, model=str(tiny_model_dir), device="cpu", sampling=sampling, **options
    )
