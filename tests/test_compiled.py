"""The compiled decode step: built in the background, same tokens as eager, never in the way."""

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from engine import models
from engine.events import TokenSampled
from engine.fast import compiled
from engine.kvcache import PreallocatedLayer
from engine.sampling import SamplingSettings
from engine.session import ChatSession

QUESTION = "How does inference work?"
ROOT = Path(__file__).resolve().parents[1]


def _greedy(session: ChatSession, prompt: str = QUESTION) -> list[int]:
    return [e.id for e in session.send(prompt) if isinstance(e, TokenSampled)]


# fp32 is laid out [out, in] for the compiled matvec, or [in, out] when an eager session built
# the fast path first; fp16 and w8's int8 weights are widened inside the matvec.
@pytest.mark.parametrize(
    "precision, eager_first", [("fp32", False), ("fp32", True), ("fp16", False), ("w8", False)]
)
def test_compiled_step_picks_the_eager_tokens_past_a_cache_growth(tiny_model_dir, precision, eager_first):
    loaded = models.load(str(tiny_model_dir), precision, "cpu")
    settings = SamplingSettings(temperature=0.0, max_new_tokens=PreallocatedLayer.initial_capacity)
    if eager_first:
        ChatSession(loaded, settings, compile=False)
    fast = ChatSession(loaded, settings, compile=True)
    assert fast.fast.transposed == eager_first
    assert fast.compiled is not None
    assert fast.compiled.ready.wait(600), fast.compiled.describe()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled_tokens = _greedy(fast)  # the answer runs past the first 256 slots: the buffers grow
    assert len(fast.cache) > PreallocatedLayer.initial_capacity
    assert (
        torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    )  # capacity is dynamic: no recompiling
    eager_tokens = _greedy(ChatSession(loaded, settings, compile=False))
    assert compiled_tokens == eager_tokens
    assert len(set(eager_tokens)) > 3
    assert "compiled step" in fast.compiled.describe()


def test_a_failed_compilation_leaves_eager_answering(tiny_model_dir, monkeypatch):
    def broken(fn, **kwargs):
        def step(*args):
            raise RuntimeError("no C++ compiler found\nmore detail")

        return step

    monkeypatch.setattr(torch, "compile", broken)
    loaded = models.load(str(tiny_model_dir), "fp32", "cpu")  # a fresh fast path: compiled anew
    session = ChatSession(loaded, SamplingSettings(temperature=0.0, max_new_tokens=8), compile=True)
    reports = []
    reported = threading.Event()
    session.compiled.when_done(lambda c: (reports.append(c), reported.set()))
    assert len(_greedy(session)) == 8  # eager answers meanwhile
    assert reported.wait(600)
    assert reports == [session.compiled] and not session.compiled.ready.is_set()
    assert session.compiled.describe() == (
        "compiled decode unavailable (RuntimeError: no C++ compiler found); the eager fast path serves"
    )


def test_w8a8_is_not_compiled(tiny_model_dir):
    loaded = models.load(str(tiny_model_dir), "w8a8", "cpu")
    session = ChatSession(loaded, compile=True)
    assert session.compiled is None
    assert "opaque" in compiled.supports(session.fast)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has ended
    except FileNotFoundError:
        return True


def test_quitting_while_compiling_ends_the_process_cleanly_and_stops_the_child():
    # Interpreter shutdown under a running compile aborted the app (exit 134); this ends it first.
    script = """
import subprocess, sys, threading, time
from engine.fast import compiled
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
compiled._children.append(child)
print(child.pid, flush=True)
compiled.exit_if_compiling(5)  # nothing compiling: returns
thread = threading.Thread(target=time.sleep, args=(120,), daemon=True)
thread.start()
compiled._compiling.append(thread)
compiled.exit_if_compiling(3)
print("still running")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 3, done.stderr
    assert "still running" not in done.stdout
    child = int(done.stdout.split()[0])
    deadline = time.monotonic() + 10
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(child)
