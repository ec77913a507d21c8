"""The KV cache file: self-describing, atomic, and loaded only into the model that made it."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine.kvcache import KVCache
from engine.sampling import SamplingSettings
from engine.saved.cache_file import FORMAT, CacheFileError, load_cache, save_cache, weights_fingerprint
from engine.session import ChatSession


@pytest.fixture(scope="module")
def warm_session(tiny_loaded):
    """A session whose cache holds one finished turn."""
    session = ChatSession(tiny_loaded, SamplingSettings(temperature=0.0, max_new_tokens=8))
    list(session.send("What is the capital of France?"))
    assert len(session.cache) > 8
    return session


@pytest.fixture
def saved(tmp_path, warm_session, tiny_loaded):
    path = tmp_path / "kv" / "conversation-1.safetensors"
    save_cache(warm_session.cache, tiny_loaded, path)
    return path


def rewrite(path, tensors=None, **metadata_changes):
    """Save the file again with some tensors or metadata fields replaced (None deletes a field)."""
    with safe_open(str(path), "pt") as f:
        metadata = dict(f.metadata())
    all_tensors = load_file(str(path))
    all_tensors.update(tensors or {})
    for key, value in metadata_changes.items():
        if value is None:
            metadata.pop(key, None)
        else:
            metadata[key] = value
    save_file(all_tensors, str(path), metadata=metadata)


def test_round_trip_gives_back_the_same_ids_and_tensors(saved, warm_session, tiny_loaded):
    cache, notice = load_cache(saved, tiny_loaded)
    assert cache is not None
    assert notice == f"KV cache loaded from disk: {len(warm_session.cache)} tokens, no prefill needed"
    assert cache.ids == warm_session.cache.ids
    assert cache.tensor_bytes() == warm_session.cache.tensor_bytes()
    for mine, theirs in zip(cache.layers, warm_session.cache.layers):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
    # The loaded cache grows like any other.
    cache.layers[0].update(torch.zeros(1, 2, 300, 16), torch.zeros(1, 2, 300, 16))
    assert cache.layers[0].get_seq_length() == len(warm_session.cache) + 300


def test_the_file_describes_itself(saved, warm_session, tiny_loaded):
    info = tiny_loaded.info
    with safe_open(str(saved), "pt") as f:
        metadata = f.metadata()
        names = set(f.keys())
        first = f.get_tensor("layers.0.keys")
    assert metadata["format"] == FORMAT and metadata["format_version"] == "1"
    assert metadata["model_spec"] == info.spec and metadata["model_name"] == info.name
    assert metadata["precision"] == "fp32" and metadata["dtype"] == "float32"
    assert metadata["weights"] == weights_fingerprint(tiny_loaded.model)
    assert (metadata["layers"], metadata["kv_heads"], metadata["head_dim"]) == ("2", "2", "16")
    assert json.loads(metadata["token_ids"]) == warm_session.cache.ids
    assert names == {f"layers.{i}.{kind}" for i in range(2) for kind in ("keys", "values")}
    # Only the used positions are written, not the buffer's spare room.
    assert first.shape == (1, 2, len(warm_session.cache), 16)
    assert os.path.getsize(saved) < warm_session.cache.reserved_bytes()


def test_saving_replaces_the_old_file_atomically(saved, warm_session, tiny_loaded):
    shorter = KVCache(2)
    for layer, full in zip(shorter.layers, warm_session.cache.layers):
        layer.update(full.keys[:, :, :5].clone(), full.values[:, :, :5].clone())
    shorter.appended(warm_session.cache.ids[:5])
    save_cache(shorter, tiny_loaded, saved)
    assert sorted(p.name for p in saved.parent.iterdir()) == [saved.name]  # no temp file left
    cache, _ = load_cache(saved, tiny_loaded)
    assert cache.ids == warm_session.cache.ids[:5]


def test_save_errors_are_one_line(tmp_path, warm_session, tiny_loaded):
    with pytest.raises(CacheFileError, match="empty"):
        save_cache(KVCache(2), tiny_loaded, tmp_path / "empty.safetensors")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(CacheFileError, match="cannot save the KV cache") as error:
        save_cache(warm_session.cache, tiny_loaded, blocker / "cache.safetensors")
    assert "\n" not in str(error.value)


def test_a_missing_file_means_prefill(tmp_path, tiny_loaded):
    cache, notice = load_cache(tmp_path / "nothing.safetensors", tiny_loaded)
    assert cache is None and "no saved KV cache" in notice


@pytest.mark.parametrize(
    "field, value, reason",
    [
        ("precision", "bf16", "it was made at bf16 precision, the model is loaded at fp32"),
        ("dtype", "bfloat16", "its KV cache precision is bf16, this chat's is fp32"),
        ("model_spec", "smollm2-135m", "it was made by another model (smollm2-135m), not the loaded "),
        ("model_name", "other", "it was made by another model (other)"),
        # In words (it said "made with weights '686168d8dc657335', the loaded model has 'a6538931…'"):
        ("weights", "0123456789abcdef", "the loaded model's weights are not the ones it was made with"),
        ("layers", "3", "it was made for a model of 3 layers, the loaded one has 2"),
        ("kv_heads", "4", "it was made for a model of 4 K/V heads, the loaded one has 2"),
        ("head_dim", "8", "it was made for heads of 8 dimensions, the loaded model's have 16"),
        ("format", "something-else", "not an llmchat KV cache"),
        ("format_version", "2", "format version 2"),
        ("token_ids", "[1, 2", "token ids are missing or damaged"),
        ("token_ids", None, "token ids are missing or damaged"),
        ("token_ids", "[1, 2, 3]", "token count does not match"),
        ("token_ids", json.dumps([10**6] * 3), "not ids of this model's vocabulary"),
        ("tokens", "1", "token count does not match"),
    ],
)
def test_metadata_that_does_not_match_is_ignored(saved, tiny_loaded, field, value, reason):
    rewrite(saved, **{field: value})
    cache, notice = load_cache(saved, tiny_loaded)
    assert cache is None
    assert notice.startswith("saved KV cache ignored (") and reason in notice
    assert notice.endswith("the history will be prefilled")


def test_tensors_that_do_not_add_up_are_ignored(saved, warm_session, tiny_loaded):
    n = len(warm_session.cache)
    cases = {
        "shape": ({"layers.1.values": torch.zeros(1, 2, n - 1, 16)}, "shape"),
        "dtype": ({"layers.0.keys": torch.zeros(1, 2, n, 16, dtype=torch.float16)}, "float16"),
        "nan": ({"layers.1.keys": torch.full((1, 2, n, 16), float("nan"))}, "NaN"),
        "extra": ({"layers.2.keys": torch.zeros(1, 2, n, 16)}, "one K and one V per layer"),
    }
    original = saved.read_bytes()
    for tensors, reason in cases.values():
        saved.write_bytes(original)
        rewrite(saved, tensors)
        cache, notice = load_cache(saved, tiny_loaded)
        assert cache is None and reason in notice, notice


def test_another_model_with_the_same_shapes_is_told_apart(tmp_path, saved, tiny_loaded):
    impostor = dataclasses.replace(tiny_loaded, model=_perturbed(tiny_loaded.model))
    cache, notice = load_cache(saved, impostor)
    assert cache is None and "weights" in notice


def _perturbed(model):
    import copy

    other = copy.deepcopy(model)
    with torch.no_grad():
        other.get_input_embeddings().weight[0, 0] += 1.0
    return other


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty", "header"])
def test_a_damaged_file_is_ignored_never_trusted(saved, tiny_loaded, damage):
    data = saved.read_bytes()
    if damage == "truncate":
        saved.write_bytes(data[: len(data) - 100])
    elif damage == "garbage":
        saved.write_bytes(os.urandom(len(data)))
    elif damage == "empty":
        saved.write_bytes(b"")
    else:
        saved.write_bytes(data[:8] + b"{not json" + data[17:])
    cache, notice = load_cache(saved, tiny_loaded)
    assert cache is None
    assert notice.startswith("saved KV cache ignored (unreadable") and "\n" not in notice
