"""The GPU's CUDA-graph decode step, its bookkeeping checked on a CPU.

A CUDA graph replays the kernels it recorded on the same memory: the step's inputs are read from
the two small tensors it was recorded with, its output lands in the tensor the recording
returned, and a cache whose buffers moved needs a new recording. Here a stand-in recording calls
the step again on those same tensors, which is what a replay computes; the recording itself
(and that nothing in the step syncs with the host) is proven on a GPU by tests/test_cuda.py.
"""

import pytest
import torch

from engine import models
from engine.events import TokenSampled
from engine.fast import compiled, graphed
from engine.kvcache_layers import PreallocatedLayer
from engine.sampling import SamplingSettings
from engine.session import ChatSession
from tests.tiny import build_tiny_model


class Replays:
    """A recording as a replay sees it: `step()` again, its output written where it was."""

    def __init__(self, step, output):
        self.step, self.output = step, output

    def replay(self):
        self.output.copy_(self.step())


def _record(step, device):
    output = step()
    return Replays(step, output), output


def _greedy(session: ChatSession, prompt: str) -> list[int]:
    return [e.id for e in session.send(prompt) if isinstance(e, TokenSampled)]


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_the_graph_step_reads_its_recorded_inputs_and_records_again_when_the_cache_moves(
    tiny_model_dir, tmp_path, monkeypatch, family
):
    """Gemma 3's local layer (window 6) drops its oldest positions as the answer goes on: the
    recording reads each layer's first position held from a tensor of its own too."""
    monkeypatch.setattr(graphed, "record", _record)
    directory = tiny_model_dir if family == "llama" else build_tiny_model(tmp_path, family=family)
    loaded = models.load(str(directory), "fp32", "cpu")
    settings = SamplingSettings(temperature=0.0, max_new_tokens=PreallocatedLayer.initial_capacity)
    session = ChatSession(loaded, settings, compile=False)
    session.compiled = compiled.CompiledDecode(session.fast, torch.float32, cuda_graph=True)
    assert session.compiled_step_ready()
    eager = ChatSession(loaded, settings, compile=False)
    for prompt in ("How does inference work?", "And again"):  # two turns, one cache that grows
        assert _greedy(session, prompt) == _greedy(eager, prompt)
    assert len(session.cache) > PreallocatedLayer.initial_capacity
    if family != "llama":
        assert session.cache.layers[0].start > 0
        assert session.cache.positions_held() == eager.cache.positions_held()
    assert session.compiled._step.recordings == 2  # the first decode step, then past the growth
    assert "CUDA graph" in session.compiled.describe()
