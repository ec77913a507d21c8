"""The inference thread: commands through its queue, cancel from another thread, failures it survives."""

import queue
import threading
import time

import pytest

from engine.events import (
    Failed,
    ModelLoading,
    ModelReady,
    PhaseChanged,
    PromptTokens,
    TokenSampled,
    TurnFinished,
)
from engine.sampling import SamplingSettings
from engine.worker import InferenceWorker

TIMEOUT = 60.0


class Recorder:
    """Collects the worker's events and lets the test wait for one kind."""

    def __init__(self, slow_tokens: float = 0.0):
        self.events: queue.Queue = queue.Queue()
        self.threads: set[str] = set()
        self.slow_tokens = slow_tokens

    def __call__(self, event) -> None:
        self.threads.add(threading.current_thread().name)
        self.events.put(event)
        if self.slow_tokens and isinstance(event, TokenSampled):
            time.sleep(self.slow_tokens)  # a slow consumer: keeps an answer in flight for the test

    def until(self, kind) -> list:
        """Events up to and including the next one of `kind`."""
        seen = []
        deadline = time.monotonic() + TIMEOUT
        while True:
            event = self.events.get(timeout=max(0.1, deadline - time.monotonic()))
            seen.append(event)
            if isinstance(event, kind):
                return seen


@pytest.fixture
def recorder():
    return Recorder()


@pytest.fixture
def worker(recorder):
    w = InferenceWorker(recorder, SamplingSettings(temperature=0, max_new_tokens=6))
    yield w
    w.shutdown()


def load_tiny(worker, recorder, tiny_model_dir) -> list:
    worker.load(str(tiny_model_dir), "fp32", "cpu")
    return recorder.until(ModelReady)


def test_load_and_send_run_on_the_inference_thread(worker, recorder, tiny_model_dir):
    events = load_tiny(worker, recorder, tiny_model_dir)
    assert any(isinstance(e, ModelLoading) for e in events)
    worker.send("hello")
    events = recorder.until(TurnFinished)
    assert len([e for e in events if isinstance(e, TokenSampled)]) == 6
    assert recorder.threads == {"llmchat-inference"}
    assert worker.session.messages[-1].content == events[-1].text


def test_commands_run_in_order(worker, recorder, tiny_model_dir):
    load_tiny(worker, recorder, tiny_model_dir)
    worker.send("hello")
    worker.send("again")
    worker.regenerate()
    first, second, third = (recorder.until(TurnFinished) for _ in range(3))
    prompts = [next(e for e in turn if isinstance(e, PromptTokens)) for turn in (first, second, third)]
    assert prompts[1].reused > 0  # the second turn reused the first
    assert prompts[2].ids == prompts[1].ids  # regenerate answered the second question again
    assert len(worker.session.messages) == 4


def test_send_before_load_fails_politely(worker, recorder):
    worker.send("hello")
    failure = recorder.until(Failed)[-1]
    assert "no model is loaded" in failure.message


def test_failed_load_keeps_the_worker_usable(worker, recorder, tiny_model_dir, tmp_path):
    worker.load(str(tmp_path / "missing.gguf"), "fp32", "cpu")
    failure = recorder.until(Failed)[-1]
    assert "not found" in failure.message and "\n" not in failure.message
    worker.load(str(tiny_model_dir), "fp8", "cpu")
    assert "unknown precision" in recorder.until(Failed)[-1].message
    load_tiny(worker, recorder, tiny_model_dir)
    worker.send("hello")
    assert recorder.until(TurnFinished)[-1].stats.generated_tokens == 6
    # A failed switch later keeps the loaded model and the conversation.
    worker.load(str(tmp_path), "fp32", "cpu")
    assert "config.json" in recorder.until(Failed)[-1].message
    worker.send("again")
    events = recorder.until(TurnFinished)
    assert next(e for e in events if isinstance(e, PromptTokens)).reused > 0


def test_cancel_from_another_thread_stops_the_answer(tiny_model_dir):
    recorder = Recorder(slow_tokens=0.02)
    worker = InferenceWorker(recorder, SamplingSettings(temperature=0, max_new_tokens=300))
    try:
        load_tiny(worker, recorder, tiny_model_dir)
        worker.send("hello")
        recorder.until(TokenSampled)
        worker.cancel()
        events = recorder.until(TurnFinished)
        finished = events[-1]
        assert finished.stats.stop == "cancelled"
        assert finished.stats.generated_tokens < 300
        assert worker.session.messages[-1].content == finished.text
        assert isinstance(events[-2], PhaseChanged) and events[-2].phase == "idle"
        # The worker is free again and the cancel does not leak into the next answer.
        worker.update_sampling(max_new_tokens=3)
        worker.send("again")
        assert recorder.until(TurnFinished)[-1].stats.stop == "length"
    finally:
        worker.shutdown()


def test_sampling_change_reaches_an_answer_in_progress(tiny_model_dir):
    recorder = Recorder(slow_tokens=0.02)
    worker = InferenceWorker(recorder, SamplingSettings(temperature=1.0, seed=0, max_new_tokens=40))
    try:
        load_tiny(worker, recorder, tiny_model_dir)
        worker.send("hello")
        recorder.until(TokenSampled)
        worker.update_sampling(top_k=1)
        events = recorder.until(TurnFinished)
        tokens = [e for e in events if isinstance(e, TokenSampled)]
        assert len(tokens[-1].top_k) == 1  # the answer finished under the new setting
        assert worker.session.sampling.top_k == 1
    finally:
        worker.shutdown()


def test_invalid_sampling_change_is_refused_and_nothing_changes(worker):
    before = worker.sampling
    with pytest.raises(ValueError, match=r"^top_p must be in \(0, 1\]"):
        worker.update_sampling(top_p=2.0)
    assert worker.sampling is before


def test_an_unexpected_error_keeps_the_thread_alive(worker, recorder, tiny_model_dir, monkeypatch):
    load_tiny(worker, recorder, tiny_model_dir)

    def boom(text, saved_id=None):
        raise RuntimeError("boom\nsecond line")
        yield  # a generator, like the real send

    monkeypatch.setattr(worker.session, "send", boom)
    worker.send("hello")
    events = recorder.until(PhaseChanged)
    failure = next(e for e in events if isinstance(e, Failed))
    assert failure.message == "RuntimeError: boom"
    assert events[-1].phase == "idle"
    monkeypatch.undo()
    worker.send("hello")
    assert recorder.until(TurnFinished)[-1].stats.generated_tokens == 6


def test_new_chat_clears_the_conversation_and_cache(worker, recorder, tiny_model_dir):
    load_tiny(worker, recorder, tiny_model_dir)
    worker.send("hello")
    recorder.until(TurnFinished)
    worker.new_chat("be brief")
    worker.send("hello")
    events = recorder.until(TurnFinished)
    prompt = next(e for e in events if isinstance(e, PromptTokens))
    assert prompt.reused == 0
    assert "be brief" in worker.session.tokenizer.decode(prompt.ids)
    assert len(worker.session.messages) == 2


def test_shutdown_stops_the_thread(recorder):
    worker = InferenceWorker(recorder)
    worker.shutdown()
    assert not worker._thread.is_alive()


def test_switching_precision_keeps_the_conversation(worker, recorder, tiny_model_dir):
    load_tiny(worker, recorder, tiny_model_dir)
    worker.send("hello")
    recorder.until(TurnFinished)
    worker.load(str(tiny_model_dir), "bf16", "cpu")
    assert recorder.until(ModelReady)[-1].info.precision == "bf16"
    worker.send("again")
    events = recorder.until(TurnFinished)
    prompt = next(e for e in events if isinstance(e, PromptTokens))
    assert prompt.reused == 0  # another model's cache cannot be reused
    assert "hello" in worker.session.tokenizer.decode(prompt.ids)  # but the conversation goes on
    assert len(worker.session.messages) == 4
    assert (
        worker.session.cache.tensor_bytes()
        == len(worker.session.cache) * worker.session.info.kv_bytes_per_token
    )


def test_fork_and_call_run_on_the_inference_thread(tiny_model_dir):
    import threading

    from engine.events import Forked, TurnFinished
    from engine.sampling import SamplingSettings
    from engine.worker import InferenceWorker

    events, done = [], threading.Event()

    def emit(event):
        events.append(event)
        if isinstance(event, TurnFinished):
            done.set()

    worker = InferenceWorker(emit, SamplingSettings(temperature=0.0, max_new_tokens=8))
    try:
        worker.load(str(tiny_model_dir), "fp32", "cpu")
        worker.send("How does inference work?")
        assert done.wait(60)
        first = worker.session.trace.steps
        alternative = first[2].top_k[1].id  # the second most likely token at step 2
        done.clear()
        worker.fork(2, alternative)
        assert done.wait(60)
        forked = next(e for e in events if isinstance(e, Forked))
        assert (forked.step, forked.token_id) == (2, alternative)
        assert worker.session.trace.steps[2].id == alternative
        thread = worker.call(lambda session: threading.current_thread().name).result(30)
        assert thread == "llmchat-inference"
        failing = worker.call(lambda session: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            failing.result(30)
    finally:
        worker.shutdown()
