"""The persistent KV cache: reuse and crop semantics, byte accounting, growth."""

import pytest
import torch
from transformers.cache_utils import DynamicCache

from engine import models
from engine.kvcache import KVCache, common_prefix
from engine.kvcache_layers import PreallocatedLayer

PROMPT = [1, 87, 85, 267, 201, 262, 78, 78, 81, 2, 201, 1, 67, 85]


def feed(model, cache: KVCache, ids: list[int]) -> torch.Tensor:
    """Run `ids` through the model with the cache; the last position's logits."""
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), cache=cache.hf, use_cache=True)
    cache.appended(ids)
    return out.logits[0, -1]


def greedy(model, cache: KVCache, prompt_rest: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    logits = feed(model, cache, prompt_rest)
    ids, all_logits = [], []
    for _ in range(steps):
        all_logits.append(logits)
        ids.append(int(torch.argmax(logits)))
        logits = feed(model, cache, [ids[-1]])
    return ids, all_logits


def reference_keys(model, ids: list[int]) -> DynamicCache:
    """What a fresh prefill of `ids` leaves in a plain transformers cache."""
    fresh = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids]), cache=fresh, use_cache=True)
    return fresh


def assert_holds(model, cache: KVCache) -> None:
    """The cache tensors are exactly what feeding cache.ids from scratch produces."""
    fresh = reference_keys(model, cache.ids)
    for ours, ref in zip(cache.layers, fresh.layers):
        assert ours.get_seq_length() == len(cache.ids)
        torch.testing.assert_close(ours.keys, ref.keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ours.values, ref.values, atol=1e-4, rtol=1e-4)


@pytest.fixture
def model(tiny_loaded):
    return tiny_loaded.model


@pytest.fixture
def cache(tiny_loaded):
    return KVCache.for_model(tiny_loaded.info)


@pytest.mark.parametrize(
    "a, b, n",
    [
        ([], [1], 0),
        ([1, 2, 3], [1, 2, 3], 3),
        ([1, 2, 3], [1, 2], 2),
        ([1, 2, 3], [1, 9, 3], 1),
        ([5], [6], 0),
    ],
)
def test_common_prefix(a, b, n):
    assert common_prefix(a, b) == n


@pytest.mark.parametrize(
    "held, wanted, reused",
    [
        (PROMPT, PROMPT + [300, 301], len(PROMPT)),  # a follow-up: everything reused
        (PROMPT, PROMPT, len(PROMPT) - 1),  # identical: one token is still fed, for its logits
        (PROMPT, PROMPT[:5], 4),  # shorter: at least one to feed
        (PROMPT, PROMPT[:6] + [9, 9], 6),  # an edit: the prefix up to the change
        (PROMPT, [9] + PROMPT, 0),  # nothing in common
        ([], PROMPT, 0),
    ],
)
def test_reuse_keeps_the_longest_prefix_leaving_one_token(model, cache, held, wanted, reused):
    if held:
        feed(model, cache, held)
    assert cache.reuse(wanted) == reused
    assert cache.ids == wanted[:reused]
    assert all(layer.get_seq_length() == reused for layer in cache.layers)
    assert len(cache) == reused


def test_crop_keeps_the_first_positions(model, cache):
    feed(model, cache, PROMPT)
    cache.crop(5)
    assert cache.ids == PROMPT[:5]
    assert_holds(model, cache)
    cache.crop(50)  # beyond the end: nothing to drop
    assert cache.ids == PROMPT[:5]
    cache.clear()
    assert cache.ids == [] and cache.tensor_bytes() == 0
    assert cache.hf.get_seq_length() == 0


def test_crop_then_generate_equals_fresh_generate(model, tiny_loaded):
    """Reusing a cropped cache gives the same tokens and logits as prefilling from scratch."""
    shared, old_tail, new_tail = PROMPT, [300, 301, 302, 303], [201, 1, 67, 85, 85]
    reused_cache = KVCache.for_model(tiny_loaded.info)
    feed(model, reused_cache, shared + old_tail)
    greedy(model, reused_cache, [201], 6)  # an old answer that the edit throws away
    keep = reused_cache.reuse(shared + new_tail)
    assert keep == len(shared)
    ids_a, logits_a = greedy(model, reused_cache, new_tail, 12)

    fresh_cache = KVCache.for_model(tiny_loaded.info)
    ids_b, logits_b = greedy(model, fresh_cache, shared + new_tail, 12)
    assert ids_a == ids_b
    assert len(set(ids_a)) > 1  # a real sequence, not one token repeated
    for a, b in zip(logits_a, logits_b):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert reused_cache.ids == fresh_cache.ids


def _formula(config, element_bytes: int, tokens: int) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * element_bytes * tokens


# A 16-bit model keeps an fp32 cache on a CPU (engine/quant/precision.py).
@pytest.mark.parametrize("precision, element_bytes", [("fp32", 4), ("bf16", 4)])
def test_tensor_bytes_equal_the_formula(tiny_model_dir, precision, element_bytes):
    loaded = models.load(str(tiny_model_dir), precision, "cpu")
    config = loaded.model.config
    cache = KVCache.for_model(loaded.info)
    assert cache.tensor_bytes() == 0
    feed(loaded.model, cache, PROMPT)
    assert cache.tensor_bytes() == _formula(config, element_bytes, len(PROMPT))
    feed(loaded.model, cache, [300])
    assert cache.tensor_bytes() == _formula(config, element_bytes, len(PROMPT) + 1)
    cache.crop(3)
    assert cache.tensor_bytes() == _formula(config, element_bytes, 3)
    assert loaded.info.kv_bytes_per_token == _formula(config, element_bytes, 1)
    assert cache.reserved_bytes() >= cache.tensor_bytes()


def test_hf_forward_reads_a_cache_stored_in_another_dtype(tiny_model_dir):
    """fp32 storage under a bf16 model: the HF forward gets bf16 views, the same logits as a bf16 cache."""
    loaded = models.load(str(tiny_model_dir), "bf16", "cpu")
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        logits = {}
        for dtype in (torch.float32, torch.bfloat16):
            cache = KVCache(loaded.info.layers, dtype)
            loaded.model(input_ids=ids[:, :-1], cache=cache.hf, use_cache=True)
            logits[dtype] = loaded.model(input_ids=ids[:, -1:], cache=cache.hf, use_cache=True).logits[0, -1]
            assert cache.layers[0].keys.dtype == dtype
    assert torch.equal(
        logits[torch.float32], logits[torch.bfloat16]
    )  # bf16 values survive fp32 storage exactly


def test_growth_past_initial_capacity_keeps_contents(model, cache, monkeypatch):
    monkeypatch.setattr(PreallocatedLayer, "initial_capacity", 8)
    feed(model, cache, PROMPT[:5])
    reserved = cache.reserved_bytes()
    ids, _ = greedy(model, cache, [201], 40)  # one token at a time across several doublings
    feed(model, cache, PROMPT)  # and a multi-token chunk that crosses a boundary
    assert cache.reserved_bytes() >= 8 * reserved
    assert len(cache) == 5 + 1 + 40 + len(PROMPT)
    assert_holds(model, cache)
    # The model still sees the whole history: next-token logits match a no-cache forward.
    cached = feed(model, cache, [300])
    with torch.inference_mode():
        full = model(input_ids=torch.tensor([cache.ids])).logits[0, -1]
    torch.testing.assert_close(cached, full, atol=1e-4, rtol=1e-4)


def test_crop_then_grow_overwrites_the_dropped_positions(model, cache, monkeypatch):
    monkeypatch.setattr(PreallocatedLayer, "initial_capacity", 8)
    feed(model, cache, PROMPT)
    cache.crop(3)
    feed(model, cache, [300, 301, 302, 303, 304, 305, 306, 307, 308, 309])
    assert cache.ids == PROMPT[:3] + list(range(300, 310))
    assert_holds(model, cache)
