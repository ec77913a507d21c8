"""Each family of the fast path (engine/fast/families.py) against transformers' own forward, on a
random-weight model built here from the family's config: a prefill, then 32 greedy decode steps,
give transformers' logits (fp32 to a tight tolerance, the same top-1 at every precision), and the
KV cache holds the bytes its formula says."""

from __future__ import annotations

import pytest
import torch

from engine import models
from engine.events import TokenSampled
from engine.fast import fused
from engine.fast.families import FAMILIES, family_of
from engine.kvcache import KVCache
from engine.sampling import SamplingSettings
from engine.session import ChatSession
from tests.tiny import build_tiny_model

MODEL_TYPES = [f.model_types[0] for f in FAMILIES]
STEPS = 32
TEXT = "The capital of France is Paris. How does inference work?"


@pytest.fixture(scope="module", params=MODEL_TYPES)
def family_dir(request, tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp(request.param), family=request.param)


def fast_logits(loaded, prompt: list[int]) -> tuple[torch.Tensor, list[int], KVCache]:
    """The fast path's logits after the prompt and after each of STEPS greedy tokens, the tokens,
    and the cache it filled."""
    fast = fused.FastLlama(loaded.model)
    cache = KVCache.for_model(loaded.info)
    tokens, rows = list(prompt), []
    logits = fast.forward(torch.tensor([prompt]), cache)
    cache.appended(prompt)
    for _ in range(STEPS):
        rows.append(logits)
        tokens.append(int(logits.argmax()))
        logits = fast.forward(torch.tensor([tokens[-1:]]), cache)
        cache.appended(tokens[-1:])
    rows.append(logits)
    return torch.stack(rows), tokens, cache


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16", "w8", "w4"])
def test_prefill_and_decode_steps_give_transformers_logits(family_dir, precision):
    loaded = models.load(str(family_dir), precision, "cpu")
    assert fused.supports(loaded.model) is None
    prompt = loaded.tokenizer(TEXT)["input_ids"]
    with torch.inference_mode():
        fast, tokens, cache = fast_logits(loaded, prompt)
        whole = loaded.model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0].float()
    reference = whole[len(prompt) - 1 :]  # the logits that chose each generated token, and the next
    assert fast.shape == reference.shape == (STEPS + 1, loaded.info.vocab_size)
    if precision == "fp32":
        assert torch.allclose(fast, reference, atol=1e-3, rtol=1e-4), (fast - reference).abs().max()
        assert torch.equal(fast.argmax(-1), reference.argmax(-1))
    else:  # transformers rounds its activations to 16 bits, the fast path keeps them in fp32 on a CPU
        assert_same_choices(fast, reference, tie=0.05 * reference.abs().max().item())
    # A real sequence, not one token repeated (w4's 16 levels settle qwen2's random weights into
    # a repeat; its steps still match transformers' above).
    assert len(set(tokens[len(prompt) :])) > (1 if precision == "w4" else 3)
    assert cache.tensor_bytes() == len(cache) * loaded.info.kv_bytes_per_token


def assert_same_choices(fast: torch.Tensor, reference: torch.Tensor, tie: float) -> None:
    """The same top-1 at every step, except where the reference's own top two are within `tie`
    (its rounding decides those)."""
    for step, (mine, theirs) in enumerate(zip(fast.argmax(-1).tolist(), reference.argmax(-1).tolist())):
        gap = (reference[step, theirs] - reference[step, mine]).item()
        assert mine == theirs or gap <= tie, (step, mine, theirs, gap)


def test_each_family_is_named_in_the_decode_step_line(family_dir):
    loaded = models.load(str(family_dir), "fp32", "cpu")
    fast = fused.FastLlama(loaded.model)
    assert fast.family is family_of(loaded.model.config)
    loaded.model.config.model_type = "gemma2"  # one the fast path does not cover says which it does
    why = fused.supports(loaded.model)
    assert why.startswith("model type gemma2") and all(f.name in why for f in FAMILIES)


@pytest.mark.compile
@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "gemma3_text", "phi3"])
def test_the_compiled_step_picks_transformers_tokens(tmp_path, model_type):
    """The compiled step (one block for every layer, then the whole model) runs the family's
    biases and q/k norms as the eager fast path does."""
    loaded = models.load(str(build_tiny_model(tmp_path, family=model_type)), "fp32", "cpu")
    settings = SamplingSettings(temperature=0.0, max_new_tokens=24)
    session = ChatSession(loaded, settings, compile=True)
    assert session.compiled.wait_settled(600) and session.compiled.kind == "whole", (
        session.compiled.describe()
    )
    compiled = [e.id for e in session.send("How does inference work?") if isinstance(e, TokenSampled)]
    assert session.decoded_by[1] == "compiled"
    reference = ChatSession(loaded, settings, fast=False)
    expected = [e.id for e in reference.send("How does inference work?") if isinstance(e, TokenSampled)]
    assert compiled == expected and len(set(expected)) > 3


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
    "rope_theta": 500000.0,
}
"""Llama 3.1's RoPE scaling, its original context shrunk so that the scaling bends frequencies
a tiny model's head uses."""


def test_llama3_rope_scaling_gives_transformers_logits(tmp_path):
    directory = build_tiny_model(tmp_path, config={"rope_parameters": LLAMA3_ROPE})
    loaded = models.load(str(directory), "fp32", "cpu")
    rotary = loaded.model.model.rotary_emb
    d = loaded.info.head_dim
    plain = 1.0 / LLAMA3_ROPE["rope_theta"] ** (torch.arange(0, d, 2).float() / d)
    assert rotary.rope_type == "llama3" and not torch.allclose(rotary.inv_freq, plain)  # scaled
    prompt = loaded.tokenizer(TEXT)["input_ids"]
    with torch.inference_mode():
        fast, tokens, _ = fast_logits(loaded, prompt)
        whole = loaded.model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0].float()
    assert torch.allclose(fast, whole[len(prompt) - 1 :], atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize(
    "family, config, why",
    [
        ("phi3", {"partial_rotary_factor": 0.5}, "RoPE over part of each head"),
        ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "dynamic"),
        ("gemma3_text", {"hidden_activation": "gelu"}, "activation gelu"),
    ],
)
def test_what_the_fast_path_cannot_run_is_named_in_one_line(tmp_path, family, config, why):
    loaded = models.load(str(build_tiny_model(tmp_path, family=family, config=config)), "fp32", "cpu")
    reason = fused.supports(loaded.model)
    assert reason is not None and why in reason and "\n" not in reason
