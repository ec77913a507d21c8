"""The KV cache's precision (--kv-cache): bytes against the formula, answers against the fp32
cache, the attention that reads an int8 cache as stored, switching between turns, refusals,
the compiled step's bypass, saved files, flags and config."""

from __future__ import annotations

import json
import threading
import types

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from engine.events import CachePrecisionChanged, Failed, ModelReady, PhaseChanged, TurnFinished
from engine.fast import attention, kernels
from engine.instruments import kv_budget
from engine.instruments.precision_compare import compare_kv_cache
from engine.kvcache import CACHE_PRECISIONS, KVCache
from engine.kvcache_layers import QuantizedKV, QuantizedLayer, dequantize, quantize
from engine.sampling import SamplingSettings
from engine.saved.cache_file import load_cache, save_cache
from engine.session import ChatSession
from engine.worker import InferenceWorker
from tests.test_worker import Recorder
from tui.config import KV_CACHE_CHOICES, load_config

QUESTIONS = ("What is the capital of France?", "How does inference work?")


def greedy(loaded, kv_cache=None, tokens: int = 24) -> ChatSession:
    return ChatSession(loaded, SamplingSettings(temperature=0.0, max_new_tokens=tokens), kv_cache=kv_cache)


def answers(session: ChatSession, questions=QUESTIONS) -> list[str]:
    texts = []
    for question in questions:
        texts += [e.text for e in session.send(question) if isinstance(e, TurnFinished)]
    return texts


# -- bytes -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", CACHE_PRECISIONS)
def test_bytes_summed_from_the_tensors_equal_the_formula(tiny_loaded, precision):
    session = greedy(tiny_loaded, precision)
    answers(session)
    info = session.info
    element = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1}[precision]
    scale = 4 if precision == "int8" else 0
    per_token = 2 * info.layers * info.kv_heads * (info.head_dim * element + scale)
    assert info.kv_bytes_per_token == per_token
    assert len(session.cache) > 20
    assert session.cache.tensor_bytes() == per_token * len(session.cache)
    assert session.cache_event().bytes == session.cache_event().bytes_per_token * len(session.cache)


@pytest.mark.parametrize("precision", CACHE_PRECISIONS)
def test_every_instrument_counts_the_bytes_per_token_the_tensors_hold(tiny_loaded, precision):
    """One figure for one cache: the KV panel's, F6's, the context sweep's and F8's (an int8
    cache read 12,240 B/token in the KV panel, 46,080 in F6 and 11,520 in the sweep)."""
    from engine.instruments.context_sweep import shape_of
    from engine.instruments.phases import ModelShape
    from engine.instruments.precision_compare import compare_kv_cache

    session = greedy(tiny_loaded, precision)
    answers(session)
    measured = session.cache.tensor_bytes() // len(session.cache)
    assert session.cache_event().bytes_per_token == measured  # the KV panel
    assert ModelShape.of(session.loaded, session.info).kv_bytes_per_token == measured  # F6
    assert shape_of(session).kv_bytes_per_token == measured  # the context sweep (x)
    if precision != "fp32":
        compared = compare_kv_cache(tiny_loaded, session.template(session.messages[:1]), precision, 4)
        assert compared.other.kv_bytes_per_token == measured  # F8


def test_the_int8_cache_holds_int8_values_and_a_float32_scale_per_token_and_head(tiny_loaded):
    session = greedy(tiny_loaded, "int8")
    answers(session, QUESTIONS[:1])
    layer = session.cache.layers[0]
    assert isinstance(layer, QuantizedLayer)
    n, heads = len(session.cache), tiny_loaded.info.kv_heads
    assert layer.keys.dtype == torch.int8 and layer.keys.shape == (1, heads, n, tiny_loaded.info.head_dim)
    assert layer.key_scales.dtype == torch.float32 and layer.key_scales.shape == (1, heads, n)


def test_quantize_round_trips_within_half_a_step():
    x = torch.randn(1, 3, 50, 64) * 4
    values, scales = quantize(x)
    error = (dequantize(values, scales) - x).abs()
    assert (error <= scales[..., None] / 2 + 1e-6).all()
    zero_values, zero_scales = quantize(torch.zeros(1, 1, 2, 8))  # an all-zero row stays zero
    assert not zero_values.any() and torch.isfinite(zero_scales).all()


# -- answers ---------------------------------------------------------------------------------------
def test_greedy_answers_with_an_fp32_cache_equal_todays(tiny_loaded):
    assert answers(greedy(tiny_loaded, "fp32")) == answers(greedy(tiny_loaded))


@pytest.mark.parametrize("precision", ["bf16", "fp16", "int8"])
def test_the_fast_path_over_a_rounded_cache_answers_as_the_reference_forward(tiny_loaded, precision):
    """The tiny random model's near-ties let a rounded cache change its free-running text (bf16
    flips a token within the first answer), so the check is against the readable reference: the
    Hugging Face forward over the same rounded cache (`update` hands it a widened copy)."""
    reference = ChatSession(
        tiny_loaded, SamplingSettings(temperature=0.0, max_new_tokens=24), fast=False, kv_cache=precision
    )
    assert answers(greedy(tiny_loaded, precision)) == answers(reference)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_16_bit_cache_agrees_with_the_fp32_cache_teacher_forced(tiny_loaded, precision):
    session = greedy(tiny_loaded)
    ids = session.template([types.SimpleNamespace(role="user", content=QUESTIONS[0])])
    result = compare_kv_cache(tiny_loaded, ids, precision, 32, frozenset())
    assert result.agreement >= 0.9 and result.mean_kl < 0.01


def test_an_int8_cache_agrees_with_the_fp32_cache_teacher_forced(tiny_loaded):
    session = greedy(tiny_loaded)
    ids = session.template([types.SimpleNamespace(role="user", content=QUESTIONS[0])])
    result = compare_kv_cache(tiny_loaded, ids, "int8", 32, frozenset())
    assert len(result.steps) == 32
    assert result.agreement >= 0.9, [(s.token, s.other_top) for s in result.steps]
    assert result.mean_kl < 0.01
    assert result.other.kv_bytes_per_token < result.reference.kv_bytes_per_token / 3
    # The same cache on both sides is the identity: the comparison itself adds nothing.
    same = compare_kv_cache(tiny_loaded, ids, "fp32", 16, frozenset())
    assert same.agreement == 1.0 and same.mean_kl < 1e-9


# -- the attention that reads the cache as stored -----------------------------------------------------
def reference_attention(q, keys, values):
    """SDPA over a full-precision copy of the cache: what the readers must equal."""
    return F.scaled_dot_product_attention(q, keys.float(), values.float())


def int8_cache(heads=3, length=1300, d=64, capacity=2048):
    """An int8 layer holding `length` positions in a larger buffer (views, as the session has them)."""
    layer = QuantizedLayer()
    layer.initial_capacity = capacity
    layer.append(torch.randn(1, heads, length, d), torch.randn(1, heads, length, d))
    return layer


def test_the_chunked_int8_path_equals_attention_over_the_dequantized_cache():
    layer = int8_cache()
    q = torch.randn(1, 3, 3, 64)  # 3 kv heads, 3 query heads each
    keys, values = layer.dequantized(torch.float32)
    expected = reference_attention(q, keys, values)
    got = attention.chunked_int8(q, layer.quantized(), layer.length - 1, chunk=300)  # 5 chunks merged
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def kernel():
    problem = kernels.load("step")
    if problem is not None:
        pytest.skip(f"the decode kernel cannot be built here: {problem}")


@pytest.mark.parametrize("length", [6, 1300])
@pytest.mark.parametrize("d", [64, 40])
def test_the_kernel_reads_an_int8_cache_as_stored(kernel, length, d):
    layer = int8_cache(length=length, d=d)
    q = torch.randn(1, 3, 3, d)
    position = torch.tensor([layer.length - 1])
    keys, values = layer.dequantized(torch.float32)
    got = attention.decode_int8(q, layer.quantized(), position)
    torch.testing.assert_close(got, reference_attention(q, keys, values), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("length, first", [(6, 2), (1300, 1100), (1300, 200)])
def test_an_int8_window_attends_from_its_first_position(kernel, length, first):
    """A sliding window over an int8 cache: the kernel and the chunked sum where it is not loaded
    both read positions first.. only."""
    layer = int8_cache(length=length, d=64)
    q = torch.randn(1, 3, 3, 64)
    keys, values = (x[:, :, first:] for x in layer.dequantized(torch.float32))
    expected = reference_attention(q, keys, values)
    position = torch.tensor([layer.length - 1])
    got = attention.decode_int8(q, layer.quantized(), position, torch.tensor([first]))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    chunked = attention.chunked_int8(q, layer.quantized(), layer.length - 1, first, chunk=256)
    torch.testing.assert_close(chunked, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("length", [6, 700])  # on the calling thread alone; on the threads, two blocks
@pytest.mark.parametrize("d", [64, 40])  # rows in 16-wide vectors, or the plain loops
def test_the_kernel_reads_a_float_cache_as_stored(kernel, dtype, length, d):
    keys, values = torch.randn(1, 3, length, d).to(dtype), torch.randn(1, 3, length, d).to(dtype)
    q = torch.randn(1, 3, 3, d)
    got = attention.decode(q, keys, values, torch.tensor([length - 1]))
    torch.testing.assert_close(got, reference_attention(q, keys, values), atol=1e-5, rtol=1e-4)


def test_decoding_never_makes_a_dequantized_copy_of_the_int8_cache(tiny_loaded, monkeypatch):
    """Prefill may widen the cache once per chunk; a decode step must read it as stored."""
    session = greedy(tiny_loaded, "int8", tokens=12)
    copies = []
    original = QuantizedKV.dequantized  # every widened copy of an int8 cache is made here

    def counted(self, dtype):
        copies.append(self.keys.shape[2])
        return original(self, dtype)

    monkeypatch.setattr(QuantizedKV, "dequantized", counted)
    events = list(session.send(QUESTIONS[0]))
    decoded = sum(1 for e in events if type(e).__name__ == "TokenSampled")
    assert decoded == 12
    assert len(copies) == tiny_loaded.info.layers  # the one prefill chunk's, one per layer; none per step


# -- switching between turns -------------------------------------------------------------------------
def test_switching_between_turns_reprefills_at_the_new_precision(tiny_loaded):
    session = greedy(tiny_loaded)
    answers(session, QUESTIONS[:1])
    notice = session.set_cache_precision("int8")
    assert "int8" in notice and f"{session.info.kv_bytes_per_token:,} B/token" in notice
    assert len(session.cache) == 0 and session.cache.quantized
    events = list(session.send(QUESTIONS[1]))
    prefill = next(e for e in events if isinstance(e, PhaseChanged) and e.phase == "prefill")
    assert prefill.reused == 0  # the whole conversation again, at int8
    assert session.cache.tensor_bytes() == session.info.kv_bytes_per_token * len(session.cache)
    # Back to fp32: the next turn's cache is what a fresh fp32 run computes, so the answer is too.
    session.set_cache_precision("fp32")
    assert session.info.cache_is_default
    mine = answers(session, ["And then?"])
    fresh = greedy(tiny_loaded)
    fresh.messages = list(session.messages[:-1])
    assert mine == [e.text for e in fresh.answer() if isinstance(e, TurnFinished)]


def test_a_precision_the_device_cannot_hold_is_refused_and_the_previous_one_stays(tiny_loaded):
    session = greedy(tiny_loaded, "int8")
    answers(session, QUESTIONS[:1])
    held, info = len(session.cache), session.info
    with pytest.raises(ValueError, match="unknown KV cache precision 'int4'"):
        session.set_cache_precision("int4")
    assert session.info == info and len(session.cache) == held


def test_the_worker_switches_or_says_why_not(tiny_model_dir):
    recorder = Recorder()
    worker = InferenceWorker(recorder, SamplingSettings(temperature=0, max_new_tokens=4))
    try:
        worker.set_cache_precision("bf16")  # before the load: the first cache is made so
        worker.load(str(tiny_model_dir), "fp32", "cpu")
        ready = recorder.until(ModelReady)[-1]
        assert ready.info.cache_dtype == "bfloat16"
        worker.send("hello")
        recorder.until(TurnFinished)
        worker.set_cache_precision("int8")
        changed = recorder.until(CachePrecisionChanged)[-1]
        assert changed.info.cache_dtype == "int8" and changed.info.cache_scale_bytes == 4
        worker.set_cache_precision("fp64")
        failed = recorder.until(Failed)[-1]
        assert "fp64" in failed.message and "it stays int8" in failed.message
        worker.send("again")
        recorder.until(TurnFinished)
        assert worker.session.cache.quantized
    finally:
        worker.shutdown()


def test_the_compiled_step_is_bypassed_for_another_cache_precision(tiny_loaded):
    session = greedy(tiny_loaded, "int8", tokens=4)

    def refuse(*args):
        raise AssertionError("the compiled step was built for the fp32 cache")

    ready = threading.Event()
    ready.set()
    fake = types.SimpleNamespace(ready=ready, step=refuse, cache_dtype=torch.float32, error=None)
    session.compiled = fake
    assert not session.compiled_serves
    assert "eager fast path decodes" in session.decode_path()
    assert answers(session, QUESTIONS[:1])  # decoded eagerly
    session.set_cache_precision("fp32")
    assert session.compiled_serves


# -- saved cache files -----------------------------------------------------------------------------
def test_an_int8_cache_file_round_trips_with_its_scales(tiny_loaded, tmp_path):
    session = greedy(tiny_loaded, "int8", tokens=6)
    answers(session, QUESTIONS[:1])
    path = tmp_path / "c.safetensors"
    save_cache(session.cache, tiny_loaded, path, session.info)
    cache, notice = load_cache(path, tiny_loaded, info=session.info)
    assert cache is not None, notice
    assert cache.quantized and cache.tensor_bytes() == session.cache.tensor_bytes()
    for mine, theirs in zip(cache.layers, session.cache.layers):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.key_scales, theirs.key_scales)
        assert torch.equal(mine.values, theirs.values) and torch.equal(mine.value_scales, theirs.value_scales)


def test_a_cache_file_of_another_precision_is_ignored_with_a_notice(tiny_loaded, tmp_path):
    fp32 = greedy(tiny_loaded, tokens=6)
    answers(fp32, QUESTIONS[:1])
    path = tmp_path / "c.safetensors"
    save_cache(fp32.cache, tiny_loaded, path, fp32.info)
    int8 = greedy(tiny_loaded, "int8")
    cache, notice = load_cache(path, tiny_loaded, info=int8.info)
    assert cache is None
    assert notice == (
        "saved KV cache ignored (its KV cache precision is fp32, this chat's is int8): "
        "the history will be prefilled"
    )
    assert load_cache(path, tiny_loaded, info=fp32.info)[0] is not None


# -- the lesson, flags and config ----------------------------------------------------------------------
def test_context_budget_by_the_formula():
    seven = kv_budget.LLAMA_2_7B
    assert seven.bytes_per_token("fp16") == 2 * 32 * 32 * 128 * 2 == 524_288  # 0.5 MiB per token
    assert seven.tokens_in(16 * kv_budget.GIB, "fp16") == 32_768
    assert kv_budget.LLAMA_2_70B.bytes_per_token("int8") == 2 * 80 * 8 * (128 + 4)


def test_the_budget_table_keeps_its_columns_apart():
    """F8's table for SmolLM2: 1,403,584 tokens of int8 cache ran into the bf16 column
    ('23,040 → 745,65412,240 → 1,403,584')."""
    from tests.tui_fakes import INFO
    from tui.screens.precision import budget_lines

    header, smollm2, seven, seventy = (line.plain for line in budget_lines(INFO)[:4])
    cells = [part.strip() for part in smollm2.split("  ") if part.strip()]
    assert cells == ["fake-135m", "46,080 → 372,827", "23,040 → 745,654", "12,240 → 1,403,584"]
    ends = {len(line.rstrip()) for line in (header, smollm2, seven, seventy)}
    assert len(ends) == 1  # every row as wide as the header: the columns line up


def test_config_and_flags_name_the_engines_precisions(tmp_path, tiny_model_dir, monkeypatch):
    assert KV_CACHE_CHOICES == CACHE_PRECISIONS
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"kv_cache": "int8"}))
    assert load_config(path)[0].kv_cache == "int8"
    path.write_text(json.dumps({"kv_cache": "int3"}))
    config, problem = load_config(path)
    assert config.kv_cache is None and "kv_cache must be one of fp32, bf16, fp16, int8" in problem

    from tui.cli import app

    monkeypatch.setenv("LLMCHAT_DATA_DIR", str(tmp_path / "data"))
    runner = CliRunner()
    bad = runner.invoke(app, ["ask", "-m", str(tiny_model_dir), "--kv-cache", "int3", "hi"])
    assert bad.exit_code == 2 and "--kv-cache must be one of fp32, bf16, fp16, int8" in bad.output
    good = runner.invoke(
        app, ["ask", "-m", str(tiny_model_dir), "--kv-cache", "int8", "-t", "0", "-n", "4", "--json", "hi"]
    )
    assert good.exit_code == 0, good.output
    events = [json.loads(line) for line in good.output.splitlines() if line.startswith("{")]
    ready = next(e for e in events if e["event"] == "ready")
    assert ready["cache_dtype"] == "int8" and ready["cache_scale_bytes"] == 4
    info = tiny_loaded_info(ready)
    assert ready["kv_bytes_per_token"] == 2 * info["layers"] * info["kv_heads"] * (info["head_dim"] + 4)


def tiny_loaded_info(ready: dict) -> dict:
    return {key: ready[key] for key in ("layers", "kv_heads", "head_dim")}


def test_kv_cache_converted_holds_the_same_positions(tiny_loaded):
    session = greedy(tiny_loaded, tokens=6)
    answers(session, QUESTIONS[:1])
    for precision in CACHE_PRECISIONS:
        other: KVCache = session.cache.converted(precision)
        assert len(other) == len(session.cache) and other.precision == precision
        keys, _ = other.layers[0].dequantized(torch.float32)
        torch.testing.assert_close(keys, session.cache.layers[0].keys, atol=0.05, rtol=0.02)


def test_the_kv_panel_formula_shows_the_element_size_and_the_scale(tiny_loaded):
    from engine.kvcache import with_cache_precision
    from tui.widgets.kv_cache import formula

    int8 = with_cache_precision(tiny_loaded.info, "int8")
    d, per_token = int8.head_dim, int8.kv_bytes_per_token
    assert formula(int8).endswith(f"× ({d} dims × 1 B (int8) + 4 B scale) = {per_token:,} B/token")
    bf16 = with_cache_precision(tiny_loaded.info, "bf16")
    assert formula(bf16).endswith(f"× {d} dims × 2 B (bf16) = {bf16.kv_bytes_per_token:,} B/token")


@pytest.mark.real_model
def test_an_int8_cache_agrees_with_the_fp32_cache_on_smollm2(smollm2):
    """Measured, not assumed: SmolLM2's greedy answers teacher-forced with an int8 cache."""
    session = greedy(smollm2)
    steps, agree, kl = 0, 0, 0.0
    for question in ("What is the capital of France?", "Name three rivers in Europe."):
        ids = session.template([types.SimpleNamespace(role="user", content=question)])
        result = compare_kv_cache(smollm2, ids, "int8", 24, session.stop_ids)
        steps += len(result.steps)
        agree += sum(s.agree for s in result.steps)
        kl += sum(s.kl for s in result.steps)
    assert agree / steps >= 0.9 and kl / steps < 0.02, (agree, steps, kl / steps)
