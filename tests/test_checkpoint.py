"""A checkpoint read without transformers (engine/fast/checkpoint.py) runs exactly as one loaded
through it, `llmchat ask` takes that path, and anything it cannot reproduce loads as before."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from engine import models
from engine.fast import checkpoint, fused
from engine.kvcache import KVCache
from tests.tiny import build_tiny_model

PROMPT = [1, 5, 9, 42, 7, 300, 12, 3]


def _logits(loaded: models.LoadedModel) -> list[torch.Tensor]:
    """The fast path's logits for a prompt, then for two decode steps on its cache."""
    fast = fused.for_model(loaded.model)
    cache = KVCache.for_model(loaded.info)
    out = []
    with torch.inference_mode():
        for ids in (PROMPT, [17], [23]):
            out.append(fast.forward(torch.tensor([ids]), cache))
            cache.appended(ids)
    return out


@pytest.mark.parametrize("precision", ["fp32", "bf16", "w8", "w4"])
def test_a_checkpoint_read_without_transformers_computes_what_transformers_loads(tiny_model_dir, precision):
    direct = models.load(str(tiny_model_dir), precision, "cpu", fast_only=True)
    through = models.load(str(tiny_model_dir), precision, "cpu")
    assert isinstance(direct.model, checkpoint.CheckpointModel)
    assert not isinstance(through.model, checkpoint.CheckpointModel)
    # What the panels show: parameters, weight bytes, shapes, context.
    assert dataclasses.replace(direct.info, load_s=0) == dataclasses.replace(through.info, load_s=0)
    torch.testing.assert_close(
        direct.model.model.rotary_emb.inv_freq, through.model.model.rotary_emb.inv_freq, rtol=0, atol=0
    )
    for mine, theirs in zip(_logits(direct), _logits(through)):
        assert torch.equal(mine, theirs)


@pytest.fixture(scope="module", params=["mistral", "qwen2", "qwen3", "gemma3_text"])
def family_dir(request, tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp(request.param), family=request.param)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "w8"])
def test_each_family_read_without_transformers_computes_what_transformers_loads(family_dir, precision):
    """What the compile child reads (the weights alone): Qwen2's q/k/v biases, Qwen3's and Gemma 3's
    q/k norms, Gemma's sandwich norms, scaled embeddings and RoPE base per kind of layer."""
    direct = models.load(str(family_dir), precision, "cpu", fast_only=True, chat=False, tokenizer=False)
    through = models.load(str(family_dir), precision, "cpu", chat=False, tokenizer=False)
    assert isinstance(direct.model, checkpoint.CheckpointModel)
    assert dataclasses.replace(direct.info, load_s=0) == dataclasses.replace(through.info, load_s=0)
    for mine, theirs in zip(_logits(direct), _logits(through)):
        assert torch.equal(mine, theirs)


def test_a_family_config_that_leaves_its_defaults_to_transformers_is_left_to_it(tmp_path):
    """An older config (no list of layer kinds: transformers fills it in), a Qwen sliding window,
    Phi-3's fused projections: read by transformers, as before."""
    gemma = build_tiny_model(tmp_path / "gemma", family="gemma3_text")
    assert checkpoint.load(gemma) is not None
    older = json.loads((gemma / "config.json").read_text())
    del older["layer_types"]
    (gemma / "config.json").write_text(json.dumps(older))
    assert checkpoint.load(gemma) is None
    qwen = build_tiny_model(tmp_path / "qwen", family="qwen2")
    windowed = json.loads((qwen / "config.json").read_text()) | {"use_sliding_window": True}
    (qwen / "config.json").write_text(json.dumps(windowed))
    assert checkpoint.load(qwen) is None
    assert checkpoint.load(build_tiny_model(tmp_path / "phi3", family="phi3")) is None


@pytest.mark.real_model
def test_the_built_in_model_read_without_transformers_is_the_same_model(smollm2):
    """Its LM head is tied to the embedding: one matrix, counted once, as transformers has it."""
    direct = models.load(models.DEFAULT_MODEL, "fp32", "cpu", fast_only=True)
    assert direct.model.lm_head.weight is direct.model.model.embed_tokens.weight
    assert dataclasses.replace(direct.info, load_s=0) == dataclasses.replace(smollm2.info, load_s=0)
    assert direct.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    ) == smollm2.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    for mine, theirs in zip(_logits(direct), _logits(smollm2)):
        assert torch.equal(mine, theirs)


def _variant(tiny_model_dir, tmp_path, **config_changes):
    target = tmp_path / "variant"
    shutil.copytree(tiny_model_dir, target)
    config = json.loads((target / "config.json").read_text())
    config.update(config_changes)
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize(
    "change",
    [
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
        {"attention_bias": True},
        {"model_type": "gpt2"},
        {"hidden_size": None},
        {"rope_parameters": "default"},
        {"head_dim": "64"},
    ],
    ids=["scaled-rope", "biases", "not-llama", "broken-config", "rope-not-a-table", "head-dim-not-a-number"],
)
def test_what_it_cannot_reproduce_is_left_to_transformers(tiny_model_dir, tmp_path, change):
    assert checkpoint.load(_variant(tiny_model_dir, tmp_path, **change)) is None


def test_a_weights_file_that_does_not_match_the_config_is_left_to_transformers(tiny_model_dir, tmp_path):
    wider = _variant(tiny_model_dir, tmp_path, intermediate_size=256)
    assert checkpoint.load(wider) is None
    loaded = models.load(str(tiny_model_dir), "fp32", "cpu", fast_only=True)
    assert isinstance(loaded.model, checkpoint.CheckpointModel)
    with pytest.raises(RuntimeError, match="fast path only"):
        loaded.model(torch.tensor([PROMPT]))


def test_ask_answers_without_importing_transformers():
    """The whole command in a fresh interpreter: the built-in model's answer, and transformers never
    imported (`-X importtime` lists every module a process imports)."""
    env = dict(os.environ, LLMCHAT_COMPILE="0")
    ask = ["ask", "--no-save", "-t", "0", "--max-new-tokens", "8", "What is the capital of France?"]
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "tui.cli", *ask],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Paris" in done.stdout
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if "|" in line]
    assert "torch" in imported and "engine.fast.checkpoint" in imported
    assert not [name for name in imported if name.split(".")[0] == "transformers"]


def test_weights_the_fast_path_copies_leave_none_of_the_file_resident(tmp_path):
    """The tensors the fast path does not fuse (w8's float embedding, the norms) are copied into
    memory of their own; the file's pages they were read from went on being resident beside the
    copies (113 MB of w8's peak on the built-in model)."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from torch import nn

    from tests.test_pages import _resident_kib

    path = tmp_path / "embedding.safetensors"
    original = torch.randn(2048, 1024)  # 8 MiB
    save_file({"weight": original}, str(path))
    with safe_open(str(path), framework="pt") as f:
        mapped = f.get_tensor(
            "weight"
        )  # the mapping lives on meanwhile, as the model's other weights keep it
        holder = nn.Module()
        holder.weight = nn.Parameter(mapped, requires_grad=False)
        fused._own_remaining_weights(holder, [])
        assert _resident_kib(path) < 512
    assert holder.weight.data_ptr() != mapped.data_ptr()
    assert torch.equal(holder.weight, original)


def test_a_single_16_bit_matrix_is_used_where_it_lies(tiny_model_dir):
    """Narrowed weights are the process's own memory already: the fast path takes them as they are
    instead of copying each (the copies were peak memory)."""
    loaded = models.load(str(tiny_model_dir), "bf16", "cpu", fast_only=True)
    before = {name: p.data_ptr() for name, p in loaded.model.named_parameters()}
    fast = fused.for_model(loaded.model)
    assert fast.lm_head.data_ptr() == before["lm_head.weight"]
    assert fast.layers[0].wo.data_ptr() == before["model.layers.0.self_attn.o_proj.weight"]
