"""The CUDA path: runs only where a GPU is visible (scripts/gpu_check.sh runs it on one)."""

import pytest
import torch

from engine import models
from engine.events import TokenSampled, TurnFinished
from engine.kvcache_layers import PreallocatedLayer
from engine.sampling import SamplingSettings
from engine.session import ChatSession
from tests.tiny import build_tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _answer(session: ChatSession, prompt: str) -> tuple[list[int], TurnFinished]:
    ids, finished = [], None
    for event in session.send(prompt):
        if isinstance(event, TokenSampled):
            ids.append(event.id)
        elif isinstance(event, TurnFinished):
            finished = event
    return ids, finished


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16", "int8", "nf4"])
def test_every_precision_answers_on_cuda(tiny_model_dir, precision):
    loaded = models.load(str(tiny_model_dir), precision, "cuda")
    assert loaded.info.device == "cuda"
    session = ChatSession(loaded, SamplingSettings(temperature=0.0, max_new_tokens=12))
    ids, finished = _answer(session, "How does inference work?")
    assert len(ids) == finished.stats.generated_tokens > 0
    assert finished.stats.ttft_s > 0
    # Cache bytes from the tensors equal the formula for the tokens held.
    event = session.cache_event()
    assert event.bytes == event.tokens * event.bytes_per_token


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fast_path_matches_reference_on_cuda(tiny_model_dir, precision):
    tokens = []
    for fast in (False, True):
        loaded = models.load(str(tiny_model_dir), precision, "cuda")
        session = ChatSession(loaded, SamplingSettings(temperature=0.0, max_new_tokens=16), fast=fast)
        tokens.append(_answer(session, "The capital of France is")[0])
    assert tokens[0] == tokens[1]


def test_precision_switch_keeps_conversation_on_cuda(tiny_model_dir):
    session = ChatSession(
        models.load(str(tiny_model_dir), "bf16", "cuda"), SamplingSettings(temperature=0.0, max_new_tokens=8)
    )
    _answer(session, "Hello there")
    session.use_model(models.load(str(tiny_model_dir), "nf4", "cuda"))
    _, finished = _answer(session, "And again")
    assert finished.stats.reused_tokens == 0  # a new precision re-prefills the whole history
    assert len(session.messages) == 4


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_cuda_graph_step_picks_the_eager_tokens_past_a_cache_growth(tiny_model_dir, precision):
    # The graph is recorded over the cache's buffers: the growth past the first capacity
    # reallocates them, and the step must record again, not replay into the freed ones.
    loaded = models.load(str(tiny_model_dir), precision, "cuda")
    settings = SamplingSettings(temperature=0.0, max_new_tokens=PreallocatedLayer.initial_capacity)
    graphed = ChatSession(loaded, settings, compile=True)
    assert graphed.compiled is not None and graphed.compiled.ready.is_set(), graphed.decode_path()
    eager = ChatSession(loaded, settings, compile=False)
    for prompt in ("How does inference work?", "And again, longer please"):  # two turns, one cache
        from_graph, finished = _answer(graphed, prompt)
        from_eager = _answer(eager, prompt)[0]
        assert finished.stats.generated_tokens == len(from_graph) > 0
        if precision == "fp32":  # bf16: the masked and the sliced attention may round a near-tie apart
            assert from_graph == from_eager
    assert len(graphed.cache) > PreallocatedLayer.initial_capacity
    assert graphed.compiled.kind == "graph" and "CUDA graph" in graphed.compiled.describe()
    assert graphed.compiled._step.recordings >= 2, "the cache grew: the step must be recorded again"


def test_a_kv_cache_switch_on_the_gpu_records_a_step_of_its_own_and_int8_says_why(tiny_model_dir):
    loaded = models.load(str(tiny_model_dir), "bf16", "cuda")
    session = ChatSession(loaded, SamplingSettings(temperature=0.0, max_new_tokens=8), compile=True)
    session.set_cache_precision("fp32")
    assert session.compiled is not None and session.compiled.kind == "graph" and session.compiled_serves
    assert _answer(session, "Hello there")[0] and session.decoded_by[1] == "compiled"
    session.set_cache_precision("int8")  # its attention is the CPU kernel's: eager, and the chat says why
    assert session.compiled is None and "eager fast path" in session.decode_path()
    assert _answer(session, "And again")[0] and session.decoded_by[1] == "fused"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma3_text", "phi3"])
def test_each_family_on_the_cuda_graph_step_picks_the_eager_tokens(tmp_path, family, precision):
    # Each family's step (biases, q/k norms, Gemma's scaled embeddings and sliding windows) recorded
    # as a CUDA graph; the tiny configs' windows are shorter than the answer, so they decide tokens.
    loaded = models.load(str(build_tiny_model(tmp_path, family=family)), precision, "cuda")
    settings = SamplingSettings(temperature=0.0, max_new_tokens=24)
    graphed = ChatSession(loaded, settings, compile=True)
    assert graphed.compiled is not None and graphed.compiled.ready.is_set(), graphed.decode_path()
    eager = ChatSession(loaded, settings, compile=False)
    for prompt in ("How does inference work?", "And again"):
        from_graph, finished = _answer(graphed, prompt)
        assert finished.stats.generated_tokens == len(from_graph) > 0
        if precision == "fp32":
            assert from_graph == _answer(eager, prompt)[0]
    assert graphed.decoded_by[1] == "compiled" and graphed.compiled.kind == "graph"


def test_a_gpu_load_turns_off_attention_that_plans_each_new_length(tiny_model_dir):
    # cuDNN's attention built a plan per shape: every follow-up turn (a new length) waited 45 ms to
    # 1.4 s for it, 10x a fresh prompt's TTFT (bench's multi_turn, H200).
    loaded = models.load(str(tiny_model_dir), "bf16", "cuda")
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    # A CUDA graph's recording (one shape, replayed) allows it for itself only.
    session = ChatSession(loaded, SamplingSettings(temperature=0.0, max_new_tokens=8), compile=True)
    assert _answer(session, "Hello there")[0] and session.decoded_by[1] == "compiled"
    assert session.compiled._step.recordings >= 1 and not torch.backends.cuda.cudnn_sdp_enabled()
