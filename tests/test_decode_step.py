"""Which decode step runs, and why: eager with compile off, building, compiled, failed, given up."""

from __future__ import annotations

import queue
import threading
import time

import pytest
import torch

from engine import session as session_module
from engine.events import DecodeStep, ModelReady, Notice, TurnFinished, to_json
from engine.fast import compiled, kernels, step_path, steps
from engine.fast.step_path import COMPILE_OFF, decode_step
from engine.sampling import SamplingSettings
from engine.session import ChatSession
from engine.worker import InferenceWorker


def test_compile_off_runs_the_eager_step_and_says_why(tiny_loaded):
    step = decode_step(ChatSession(tiny_loaded, SamplingSettings(), compile=False))
    assert (step.step, step.compile, step.why) == ("eager", "off", COMPILE_OFF)
    assert step.why == "compile off: --no-compile (or LLMCHAT_COMPILE=0)"
    assert step.attention in ("kernel", "SDPA")


def test_without_the_fast_path_the_transformers_forward_runs(tiny_loaded):
    step = decode_step(ChatSession(tiny_loaded, SamplingSettings(), fast=False))
    assert (step.step, step.attention) == ("hf", "HF") and "reference" in step.why


class Weakly:
    """A stand-in fast path (CompiledDecode holds it by a weak reference)."""


class FakeBuild:
    """The parts of a CompiledDecode that `decode_step` reads, in any state."""

    def __init__(self, state: str, error: str | None = None, compile_s: float = 0.0, started_ago: float = 0):
        self.state, self.error, self.compile_s = state, error, compile_s
        self.kernel_error = None
        self.started = time.monotonic() - started_ago
        self.ready = threading.Event()
        if state == "ready":
            self.ready.set()
        self.kind, self.whole_error, self._settled = "regional", None, threading.Event()
        self._settled.set()

    how = compiled.CompiledDecode.how  # the real words, from these fields

    def stop(self) -> None:
        self.state = "stopped"


@pytest.mark.parametrize(
    ("build", "step", "state", "words"),
    [
        (FakeBuild("building", started_ago=12), "eager", "building", "compiling in the background"),
        (FakeBuild("ready", compile_s=58), "compiled", "ready", "layer by layer, ready after 58 s"),
        (FakeBuild("failed", error="no C++ compiler"), "eager", "failed", "compile failed: no C++ compiler"),
        (
            FakeBuild("given up", error="the build ran past 900 s"),
            "eager",
            "given up",
            "compile given up: the build ran past 900 s",
        ),
        (FakeBuild("stopped"), "eager", "stopped", "compile stopped"),
    ],
)
def test_each_compile_state_names_the_step_that_runs(tiny_loaded, build, step, state, words):
    if state == "building":  # the parameters are made at collection, maybe minutes before this runs
        build.started = time.monotonic() - 12
    session = ChatSession(tiny_loaded, SamplingSettings(), compile=False)
    session.compile_wanted, session.compiled = True, build
    shown = decode_step(session)
    assert (shown.step, shown.compile) == (step, state) and words in shown.why
    if state == "building":
        assert 12 <= shown.elapsed_s < 60  # counted from the build's start


def test_a_cache_switch_says_the_eager_step_serves_until_its_compiled_step_is_built(tiny_loaded, monkeypatch):
    building = FakeBuild("building", started_ago=1)
    building.cache_dtype = torch.int8
    monkeypatch.setattr(session_module, "compiled_decode", lambda fast, info: building)
    session = ChatSession(tiny_loaded, SamplingSettings(), compile=False)
    old = session.compiled = FakeBuild("building", started_ago=5)
    session.compile_wanted = True
    notice = session.set_cache_precision("int8")
    assert old.state == "stopped"  # its cores go to the step the chat now needs
    assert "eager fast path decodes until the compiled step for the int8 cache is ready" in notice
    shown = decode_step(session)
    assert (shown.step, shown.compile) == ("eager", "building") and not session.compiled_serves


def test_the_compiled_step_with_sdpa_says_why_not_the_kernel(tiny_loaded):
    session = ChatSession(tiny_loaded, SamplingSettings(), compile=False)
    build = FakeBuild("ready", compile_s=3)
    build.kernel_error = "no C++ compiler"
    session.compile_wanted, session.compiled = True, build
    shown = decode_step(session)
    assert shown.attention == "SDPA"
    assert "attention by SDPA, matrix-vector products by Inductor's loop (no C++ compiler)" in shown.why


def test_a_build_past_its_time_limit_is_given_up_not_compiled_here(tiny_loaded, monkeypatch):
    monkeypatch.setattr(compiled, "_compile_in_a_subprocess", lambda *args: True)
    monkeypatch.setattr(steps, "saved_path", lambda *args: None)  # never compiled before

    def compiling_here(*args):
        raise AssertionError("compiled in the app's process after the background build was given up")

    monkeypatch.setattr(steps, "compile_here", compiling_here)
    fast = Weakly()  # held weakly; never reached: the compile here is not started
    build = compiled.CompiledDecode(fast, torch.float32, source=("tiny", "fp32"))
    told = threading.Event()
    build.when_done(lambda b: told.set())
    assert told.wait(30) and build.wait(1)
    assert build.state == "given up" and build.gave_up and not build.ready.is_set()
    assert "given up" in build.describe() and "past 900 s" in build.describe()


def test_the_worker_says_which_step_after_a_load(tiny_model_dir):
    events: queue.Queue = queue.Queue()
    worker = InferenceWorker(events.put, compile=False)
    try:
        worker.load(str(tiny_model_dir), "fp32", "cpu")
        seen = []
        while not any(isinstance(e, DecodeStep) for e in seen):
            seen.append(events.get(timeout=60))
        assert any(isinstance(e, ModelReady) for e in seen)
        step = seen[-1]
        assert (step.step, step.compile, step.why) == ("eager", "off", COMPILE_OFF)
        line = to_json(step)
        assert line["event"] == "decode_step" and line["step"] == "eager" and line["compile"] == "off"
    finally:
        worker.shutdown()


def test_the_words_for_the_building_state_are_the_panels():
    assert step_path.BUILDING.startswith("compiling in the background")


def test_the_worker_says_building_then_failed_when_the_compile_breaks(tiny_model_dir, monkeypatch):
    def broken(*args):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(steps, "compile_here", broken)
    building = threading.Event()  # the background build waits until the test has seen "building"
    monkeypatch.setattr(compiled, "_compile_in_a_subprocess", lambda *args: (building.wait(60), False)[1])
    monkeypatch.setattr(steps, "saved_path", lambda *args: None)  # never compiled before
    monkeypatch.setattr(kernels, "load", lambda name: "no compiler")
    events: queue.Queue = queue.Queue()
    worker = InferenceWorker(events.put, compile=True)
    try:
        worker.load(str(tiny_model_dir), "fp32", "cpu")
        seen: list[DecodeStep] = []
        deadline = time.monotonic() + 120
        while len(seen) < 2 and time.monotonic() < deadline:
            event = events.get(timeout=120)
            if isinstance(event, DecodeStep):
                seen.append(event)
                building.set()
        assert [s.compile for s in seen] == ["building", "failed"]
        assert seen[0].step == "eager" and seen[1].step == "eager"
        assert seen[1].why == "compile failed: RuntimeError: no C++ compiler found"
    finally:
        getattr(worker.session.compiled, "stop", lambda: None)()
        worker.shutdown()


def test_after_a_cache_switch_the_worker_says_building_then_compiled(tiny_model_dir):
    events: queue.Queue = queue.Queue()
    worker = InferenceWorker(events.put, compile=True)

    def steps_until(compiled_for: str) -> list[DecodeStep]:
        seen: list[DecodeStep] = []
        deadline = time.monotonic() + 600
        while not (seen and seen[-1].step == "compiled" and worker.session.info.cache_dtype == compiled_for):
            assert time.monotonic() < deadline, seen
            event = events.get(timeout=600)
            if isinstance(event, DecodeStep):
                seen.append(event)
        return seen

    try:
        worker.load(str(tiny_model_dir), "fp32", "cpu")
        steps_until("float32")
        worker.set_cache_precision("bf16")
        seen = steps_until("bfloat16")
        assert seen[0].compile in ("building", "ready"), seen  # said at once, then again once it serves
    finally:
        worker.shutdown()


@pytest.mark.compile
def test_the_worker_says_so_when_the_compiled_step_fails_while_decoding(tiny_model_dir):
    """The user hears why the answer's speed changed: the Phase panel's step turns eager with the
    reason, a notice says it, and the answer runs to its end (engine/fast/compiled.py `served`)."""
    events: queue.Queue = queue.Queue()
    worker = InferenceWorker(events.put, SamplingSettings(temperature=0, max_new_tokens=8), compile=True)
    try:
        worker.load(str(tiny_model_dir), "fp32", "cpu")
        while not isinstance(events.get(timeout=120), ModelReady):
            pass
        build = worker.session.compiled
        assert build.wait_settled(600) and build.kind == "whole", build.describe()
        real, calls = build._step, []

        def failing_at_the_third(*args):  # a fault no input here provokes in the real step
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("index out of bounds: 0 <= tmp7 < 399")
            return real(*args)

        build._step = failing_at_the_third
        worker.send("hello")
        seen = []
        while not isinstance(seen[-1] if seen else None, TurnFinished):
            seen.append(events.get(timeout=120))
        steps_said = [e for e in seen if isinstance(e, DecodeStep)]
        assert steps_said and (steps_said[-1].step, steps_said[-1].compile) == ("eager", "failed")
        why = steps_said[-1].why
        assert why.startswith("compile failed: the step failed while decoding, fed [")
        assert why.endswith(": index out of bounds: 0 <= tmp7 < 399")
        said = "compiled decode unavailable (the step failed while decoding"
        assert any(e.message.startswith(said) for e in seen if isinstance(e, Notice))
        stats = seen[-1].stats
        assert stats.generated_tokens == 8 and stats.step_path == "fused" and len(calls) == 3
    finally:
        worker.shutdown()
