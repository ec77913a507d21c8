"""The fast forward path must match the HF forward (the readable reference)."""

import pytest
import torch

from engine import models
from engine.events import TokenSampled
from engine.fast import fused
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
