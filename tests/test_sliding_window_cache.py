"""A sliding-window layer's KV cache keeps only what a later token can still see (issue 33):
Gemma 3's local layers (and Mistral's, Phi-3's) drop their oldest positions, and every path that
reads the cache by position (the fast path's masks and decode kernel, the compiled step, the HF
forward's mask, a saved cache) gives the same logits as a cache that kept them all."""

from __future__ import annotations

import pytest
import torch

from engine import models
from engine.events import TokenSampled
from engine.fast import fused, steps
from engine.instruments import kv_budget
from engine.kv_windows import CROP_ROOM, most_held
from engine.kvcache import KVCache, with_cache_precision
from engine.sampling import SamplingSettings
from engine.saved.cache_file import load_cache, save_cache
from engine.session import ChatSession
from engine.speculative.drafters import PromptLookup
from engine.speculative.loop import Speculation
from tests.tiny import build_tiny_model
from tui.widgets.kv_cache import held_formula

STEPS = 150
"""Decode steps: past the window (6) plus CROP_ROOM and DROP_EVERY twice, so positions are dropped."""
TEXT = "The capital of France is Paris. How does inference work?"


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """A random-weight Gemma 3: one local layer (window 6) and one global."""
    directory = build_tiny_model(tmp_path_factory.mktemp("gemma"), family="gemma3_text")
    loaded = models.load(str(directory), "fp32", "cpu")
    assert loaded.info.layer_windows == (6, None)
    return loaded


def decode(forward, cache: KVCache, prompt: list[int], steps: int = STEPS) -> tuple[torch.Tensor, list[int]]:
    """Logits after the prompt and after each greedy token (`forward(ids, cache)`), and the tokens."""
    tokens, rows = list(prompt), []
    logits = forward(prompt, cache)
    cache.appended(prompt)
    for _ in range(steps):
        rows.append(logits)
        tokens.append(int(logits.argmax()))
        logits = forward(tokens[-1:], cache)
        cache.appended(tokens[-1:])
    rows.append(logits)
    return torch.stack(rows), tokens


def assert_bounded(cache: KVCache, info) -> None:
    """The local layer holds at most its window and the room the policy gives; the global one all;
    the bytes are the positions held times a layer's bytes per position (`info`: the model's,
    at the cache's precision)."""
    window = info.layer_windows[0]
    local, whole = cache.positions_held()
    assert window - 1 + CROP_ROOM <= local <= most_held(window) and whole == len(cache)
    assert cache.layers[0].start == len(cache) - local > 0
    per_position = info.kv_bytes_per_token // info.layers
    assert cache.tensor_bytes() == (local + whole) * per_position < len(cache) * info.kv_bytes_per_token


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_the_fast_path_over_a_dropping_window_gives_the_logits_of_a_cache_that_kept_all(gemma, precision):
    fast = fused.FastLlama(gemma.model)
    prompt = gemma.tokenizer(TEXT)["input_ids"]

    def forward(ids, cache):
        return fast.forward(torch.tensor([ids]), cache)

    with torch.inference_mode():
        dropping = KVCache(gemma.info.layers, precision=precision, windows=gemma.info.layer_windows)
        got, tokens = decode(forward, dropping, prompt)
        keeping = KVCache(gemma.info.layers, precision=precision)  # no windows: every position kept
        kept, same_tokens = decode(forward, keeping, prompt)
        whole = gemma.model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0, len(prompt) - 1 :]
    assert tokens == same_tokens and len(set(tokens[len(prompt) :])) > 3
    assert torch.allclose(got, kept, atol=1e-4, rtol=1e-5), (got - kept).abs().max()
    if precision == "fp32":
        assert torch.allclose(got, whole, atol=1e-3, rtol=1e-4), (got - whole).abs().max()
    assert_bounded(dropping, with_cache_precision(gemma.info, precision))
    assert keeping.positions_held() == (len(keeping),) * 2


def test_transformers_forward_reads_the_dropping_window_through_the_bridge(gemma):
    prompt = gemma.tokenizer(TEXT)["input_ids"]

    def forward(ids, cache):
        out = gemma.model(input_ids=torch.tensor([ids]), cache=cache.hf, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].float()

    with torch.inference_mode():
        cache = KVCache.for_model(gemma.info)
        got, tokens = decode(forward, cache, prompt)
        whole = gemma.model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0, len(prompt) - 1 :]
    assert torch.allclose(got, whole, atol=1e-3, rtol=1e-4), (got - whole).abs().max()
    assert_bounded(cache, gemma.info)


def test_a_chunk_after_dropped_positions_and_a_rejected_draft_crop(gemma):
    """A several-row forward (a verify, a follow-up prefill) masks by position past the dropped
    ones; cropping its rejected rows keeps the window; a crop deeper than what is held starts over."""
    fast = fused.FastLlama(gemma.model)
    prompt = gemma.tokenizer(TEXT)["input_ids"]
    with torch.inference_mode():
        cache = KVCache.for_model(gemma.info)
        _, tokens = decode(lambda ids, c: fast.forward(torch.tensor([ids]), c), cache, prompt)
        chunk = tokens[3:12]  # 9 rows, as a verify of 8 drafts
        rows = fast.forward(torch.tensor([chunk]), cache, every=True)
        cache.appended(chunk)
        whole = gemma.model(input_ids=torch.tensor([tokens + chunk]), use_cache=False).logits[0]
        assert torch.allclose(rows, whole[len(tokens) :], atol=1e-3, rtol=1e-4)
        cache.crop(len(tokens) + 1)  # 8 drafts rejected
        again = fast.forward(torch.tensor([chunk[1:2]]), cache)
        cache.appended(chunk[1:2])
        expected = gemma.model(input_ids=torch.tensor([tokens + chunk[:2]]), use_cache=False).logits[0, -1]
    assert torch.allclose(again, expected, atol=1e-3, rtol=1e-4)
    # An edit early in the conversation: the window no longer holds what its next token sees.
    assert cache.reuse(tokens[:10] + [1, 2, 3]) == 0 and len(cache) == 0 and cache.positions_held() == (0, 0)
    with pytest.raises(ValueError, match="sliding window"):
        filled = KVCache.for_model(gemma.info)
        decode(lambda ids, c: fast.forward(torch.tensor([ids]), c), filled, prompt)
        filled.crop(10)


@pytest.mark.compile
def test_the_compiled_steps_write_and_read_a_dropping_window_by_its_slots(gemma):
    """Both compiled steps (one block per layer; the whole model) take each layer's first position
    held, and decode as the eager fast path does."""
    fast = fused.FastLlama(gemma.model)
    prompt = gemma.tokenizer(TEXT)["input_ids"]
    eager = KVCache.for_model(gemma.info)
    with torch.inference_mode():
        expected, tokens = decode(lambda ids, c: fast.forward(torch.tensor([ids]), c), eager, prompt)
        for kind in steps.KINDS:
            step = steps.assemble(kind, steps.compile_here(kind, fast, torch.float32))

            def forward(ids, cache, step=step):
                if len(ids) > 1:
                    return fast.forward(torch.tensor([ids]), cache)
                buffers = steps.cache_buffers(cache.layers)
                offsets = steps.cache_offsets(cache.layers)
                logits = step(fast, torch.tensor(ids), torch.tensor([len(cache)]), offsets, *buffers)
                for layer in cache.layers:
                    layer.advance(1)
                return logits

            cache = KVCache.for_model(gemma.info)
            got, same = decode(forward, cache, prompt)
            assert same == tokens, kind
            assert torch.allclose(got, expected, atol=1e-4, rtol=1e-5), (kind, (got - expected).abs().max())
            assert_bounded(cache, gemma.info)


def test_a_chat_past_the_window_speculates_saves_and_resumes(gemma, tmp_path):
    """The session's own paths: a lookup-speculated answer equals plain decoding's over a dropping
    window, its cache saves with each layer's first position and loads back to the same next step."""
    settings = SamplingSettings(temperature=0, max_new_tokens=120)
    plain = ChatSession(gemma, settings)
    expected = [e.id for e in plain.send(TEXT) if isinstance(e, TokenSampled)]
    speculating = ChatSession(gemma, settings)
    speculating.speculation = Speculation(PromptLookup(), k=8)
    assert [e.id for e in speculating.send(TEXT) if isinstance(e, TokenSampled)] == expected
    assert_bounded(plain.cache, gemma.info)

    path = tmp_path / "conversation.safetensors"
    save_cache(plain.cache, gemma, path)
    loaded, notice = load_cache(path, gemma)
    assert loaded is not None and "no prefill needed" in notice, notice
    assert loaded.positions_held() == plain.cache.positions_held()
    assert [layer.start for layer in loaded.layers] == [layer.start for layer in plain.cache.layers]
    fast = fused.FastLlama(gemma.model)
    with torch.inference_mode():
        after_saved = fast.forward(torch.tensor([[5]]), loaded)
        after_live = fast.forward(torch.tensor([[5]]), plain.cache)
    assert torch.equal(after_saved, after_live)


def test_the_panel_formula_counts_each_layer_by_the_positions_it_holds():
    assert held_formula(100, 4096, 2, ()) == "100 × 4,096 B = 400.0 KiB"
    # Gemma 3 270M's shape: 3 global layers hold all 1,500, 15 local ones 591.
    line = held_formula(1500, 18 * 2048, 18, (1500,) * 3 + (591,) * 15)
    assert line.startswith("(3 × 1,500 + 15 × 591) positions × 2,048 B = ")


def test_the_context_budget_counts_a_windowed_layer_at_its_window(gemma):
    """F8's tokens that fit: a local layer's positions stop at its window, the global one's grow;
    the live cache after a long answer holds no more than that and the room the policy keeps."""
    shape, info = kv_budget.shape_of(gemma.info), gemma.info
    per_layer = info.kv_bytes_per_token // info.layers
    for memory in (per_layer * 9, per_layer * 12, per_layer * 13, per_layer * 1_000):
        fits = max(n for n in range(2_000) if per_layer * (min(n, 6) + n) <= memory)
        assert shape.tokens_in(memory, "fp32") == fits
    assert shape.tokens_in(per_layer * 1_000, "fp32") == 994 > per_layer * 1_000 // info.kv_bytes_per_token
    cache, fast = KVCache.for_model(gemma.info), fused.FastLlama(gemma.model)
    with torch.inference_mode():
        decode(lambda ids, cache: fast.forward(torch.tensor([ids]), cache), cache, [1, 2, 3])
    most = per_layer * (most_held(6) + len(cache))
    assert shape.bytes_at(len(cache), "fp32") < cache.tensor_bytes() <= most
    every_layer_windowed = kv_budget.Shape("mistral-like", 2, 1, 8, "test", (6, 6))
    assert every_layer_windowed.tokens_in(10 * 2 * 2 * 8 * 4 * 6, "fp32") is None
    assert every_layer_windowed.tokens_in(2 * 2 * 8 * 4 * 5, "fp32") == 5


def test_the_budget_table_for_gemma_3_counts_its_global_layers_per_token():
    """Gemma 3 270M's shape (18 layers, 1 kv head of 256; 15 local of window 512): 16 GiB holds
    466,033 tokens keeping every layer's, 2,793,642 with the windows."""
    from dataclasses import replace

    from tests.tui_fakes import INFO
    from tui.screens.precision import budget_lines

    windows = tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18))
    gemma_shape = replace(INFO, name="gemma-3-270m", layers=18, kv_heads=1, head_dim=256)
    gemma_shape = replace(gemma_shape, layer_windows=windows)
    lines = [line.plain for line in budget_lines(gemma_shape)]
    cells = [part.strip() for part in lines[1].split("  ") if part.strip()]
    assert (
        cells[:2]
        == ["gemma-3-270m", f"6,144 → {(16 * 2**30 - 15 * 512 * 2_048) // 6_144:,}"]
        == [
            "gemma-3-270m",
            "6,144 → 2,793,642",
        ]
    )
    assert lines[4].startswith("15 of its 18 layers attend over a sliding window (512 positions)")
