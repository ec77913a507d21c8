"""The fast forward path must match the HF forward (the readable reference)."""

import platform

import pytest
import torch
import torch.nn.functional as F

from engine import models
from engine.events import TokenSampled
from engine.fast import fused, gemm
from engine.kvcache import KVCache
from engine.sampling import SamplingSettings
from engine.session import ChatSession


def _greedy_tokens(loaded, fast: bool, prompts=("How does inference work?", "And then?")) -> list[int]:
    session = ChatSession(loaded, SamplingSettings(temperature=0.0, max_new_tokens=24), fast=fast)
    assert (session.fast is not None) == fast
    tokens = []
    for prompt in prompts:  # the second turn exercises prefill on top of a reused cache
        tokens += [e.id for e in session.send(prompt) if isinstance(e, TokenSampled)]
    return tokens


def test_fast_and_reference_paths_pick_the_same_tokens(tiny_model_dir):
    reference = _greedy_tokens(models.load(str(tiny_model_dir), "fp32", "cpu"), fast=False)
    fast = _greedy_tokens(models.load(str(tiny_model_dir), "fp32", "cpu"), fast=True)
    assert fast == reference
    assert len(set(reference)) > 3  # a real sequence, not one token repeated


@pytest.mark.parametrize("precision, kv_cache", [("bf16", None), ("fp32", "bf16"), ("fp32", "int8")])
def test_a_short_prompt_answers_while_the_attention_kernel_builds(
    tiny_model_dir, precision, kv_cache, monkeypatch
):
    """A fresh machine builds the step's kernels for ~6 s after the model loads. A forward of a few
    tokens meanwhile attends through SDPA, over the cache widened to the queries' float32 (a draft
    of this round's change gave SDPA a bf16 cache beside float32 queries: the prompt failed)."""
    from engine.fast import kernels

    monkeypatch.setattr(kernels, "step_kernel_there", lambda: False)
    session = ChatSession(
        models.load(str(tiny_model_dir), precision, "cpu"), SamplingSettings(), kv_cache=kv_cache, fast=True
    )
    prompt = [10, 11, 12, 13, 14]
    with torch.inference_mode():
        together = session.forward(prompt)
        session.cache.crop(0)
        one_at_a_time = [session.forward([token]) for token in prompt][-1]
    # One token's attention without the kernel runs in the cache's bf16 (`grouped.to(keys.dtype)`).
    assert (together - one_at_a_time).abs().max() < 0.1


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_fast_logits_match_reference_logits(tiny_model_dir, precision):
    loaded = models.load(str(tiny_model_dir), precision, "cpu")
    ids = torch.tensor([loaded.tokenizer("The capital of France is Paris.")["input_ids"]])
    with torch.inference_mode():
        reference_cache = KVCache.for_model(loaded.info)
        reference = (
            loaded.model(input_ids=ids, cache=reference_cache.hf, use_cache=True).logits[0, -1].float()
        )
        fast = fused.FastLlama(loaded.model)
        cache = KVCache.for_model(loaded.info)
        prefill = fast.forward(ids[:, :-1], cache)  # prefill all but one, then one decode step
        cache.appended(ids[0, :-1].tolist())
        step = fast.forward(ids[:, -1:], cache)
        cache.appended(ids[0, -1:].tolist())
        # The HF forward still works on the re-pointed (fused) weights.
        after = (
            loaded.model(input_ids=ids, cache=KVCache.for_model(loaded.info).hf, use_cache=True)
            .logits[0, -1]
            .float()
        )
    tolerance = 1e-3 if precision == "fp32" else 0.1 * reference.abs().max().item()
    assert torch.allclose(step, reference, atol=tolerance)
    assert torch.allclose(after, reference, atol=1e-4 if precision == "fp32" else tolerance)
    assert step.argmax() == reference.argmax()
    assert prefill.shape == step.shape == (loaded.info.vocab_size,)
    # The fast path fills the cache in the weights' dtype, exactly as the formula counts.
    assert cache.tensor_bytes() == len(cache) * loaded.info.kv_bytes_per_token


def test_unsupported_models_say_why(tiny_model_dir):
    loaded = models.load(str(tiny_model_dir), "fp32", "cpu")
    assert fused.supports(loaded.model) is None
    loaded.model.config.hidden_act = "gelu"
    assert "activation" in fused.supports(loaded.model)


def test_a_fresh_prefill_and_one_on_top_of_a_cache_match_the_reference(tiny_model_dir):
    # A fresh prefill attends plainly causally (no mask built); a chunk after cached tokens
    # masks by position. Both must score every token as the HF forward over the whole text does.
    loaded = models.load(str(tiny_model_dir), "fp32", "cpu")
    ids = torch.tensor(
        [loaded.tokenizer("Prefill fills the cache; decode reads it, one token at a time.")["input_ids"]]
    )
    half = ids.shape[1] // 2
    with torch.inference_mode():
        reference = loaded.model(input_ids=ids, use_cache=False).logits[0].float()
        fast = fused.FastLlama(loaded.model)
        cache = KVCache.for_model(loaded.info)
        first = fast.forward(ids[:, :half], cache, every=True)
        cache.appended(ids[0, :half].tolist())
        second = fast.forward(ids[:, half:], cache, every=True)
    assert torch.allclose(torch.cat([first, second]), reference, atol=1e-3)


def test_float32_matmuls_run_on_onednn_with_torchs_results():
    # torch's default BLAS (MKL) runs float32 at half speed on AMD CPUs (scripts/gemm.py);
    # x86 torch wheels carry oneDNN, and the fast path must use it there.
    if platform.machine() in ("x86_64", "AMD64"):
        assert gemm.onednn_works()
    weight = torch.randn(48, 32)
    for x in (torch.randn(1, 32), torch.randn(7, 32), torch.randn(2, 5, 32)):
        assert torch.allclose(gemm.linear(x, weight), F.linear(x, weight), atol=1e-5)
        as_in_out = weight.t().contiguous().t()  # the [in, out] layout's view
        assert torch.allclose(gemm.linear(x, as_in_out), F.linear(x, weight), atol=1e-5)
    x16, w16 = torch.randn(3, 32).bfloat16(), weight.bfloat16()
    assert torch.equal(gemm.linear(x16, w16), F.linear(x16, w16))  # 16-bit: torch's own path


def test_a_16_bit_prefill_widens_its_weights_a_block_of_rows_at_a_time(tiny_model_dir, monkeypatch):
    """A prefill on a CPU without 16-bit matmuls widens each weight to float32; SmolLM2's LM head
    widened whole was a 113 MB temporary, the peak memory of a 16-bit answer."""
    loaded = models.load(str(tiny_model_dir), "fp16", "cpu")
    fast = fused.for_model(loaded.model)
    monkeypatch.setattr(fast, "upcast_prefill", True)  # as on a CPU without native fp16
    monkeypatch.setattr(gemm, "WIDEN_ROWS", 64)  # the tiny model's LM head has 400 rows
    widened_rows = []
    real = gemm.linear

    def spy(x, weight):
        if weight.dtype == torch.float32:
            widened_rows.append(weight.shape[0])
        return real(x, weight)

    monkeypatch.setattr(gemm, "linear", spy)
    prompt = torch.tensor([list(range(3, 3 + 2 * fused.UPCAST_ABOVE))])
    with torch.inference_mode():
        logits = fast.forward(prompt, KVCache.for_model(loaded.info))
        monkeypatch.setattr(gemm, "WIDEN_ROWS", 10**9)  # each weight widened whole, as before
        whole = fast.forward(prompt, KVCache.for_model(loaded.info))
    assert widened_rows and max(widened_rows[: len(widened_rows) // 2]) <= 64
    torch.testing.assert_close(logits, whole, rtol=1e-5, atol=1e-5)
