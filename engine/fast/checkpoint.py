"""A Llama checkpoint read without transformers, for a start that runs only the fast path.

transformers' imports and `from_pretrained` are ~2 s of a ~3.5 s `llmchat ask` (docs/benchmarks-history.md).
The fast path (engine/fast/fused.py) needs only the config and the weights, in modules named as
the HF model names them; this module reads config.json and the memory-mapped safetensors into
exactly that tree (`LlamaWeights`), and the tokenizer with engine/chat_tokenizer.py.

It covers what it can reproduce exactly: a Llama or Mistral checkpoint in safetensors, plain
RoPE, no biases, SiLU, no sliding window. For anything else `load` returns None, and the caller
loads through transformers. The tree has no forward of its own: a session on it decodes with
the fast path only (no reference forward, no attention hooks).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from engine.fast import fused


class _Linear(nn.Linear):
    """An nn.Linear made from its stored weight. The usual constructor draws random weights first,
    and on the meta device that alone imports torch._dynamo (~0.9 s)."""

    def __init__(self, weight: torch.Tensor):
        nn.Module.__init__(self)
        self.out_features, self.in_features = weight.shape
        self.weight = (
            weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        )
        self.register_parameter("bias", None)


class _Weight(nn.Module):
    """A module holding one stored tensor as `weight` (a norm, the embedding table)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)


class _Attention(nn.Module):
    def __init__(self, stored: dict[str, torch.Tensor], prefix: str):
        super().__init__()
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self, name, _Linear(stored[f"{prefix}.{name}.weight"]))


class _MLP(nn.Module):
    def __init__(self, stored: dict[str, torch.Tensor], prefix: str):
        super().__init__()
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(self, name, _Linear(stored[f"{prefix}.{name}.weight"]))


class _Block(nn.Module):
    def __init__(self, stored: dict[str, torch.Tensor], prefix: str):
        super().__init__()
        self.self_attn = _Attention(stored, f"{prefix}.self_attn")
        self.mlp = _MLP(stored, f"{prefix}.mlp")
        self.input_layernorm = _Weight(stored[f"{prefix}.input_layernorm.weight"])
        self.post_attention_layernorm = _Weight(stored[f"{prefix}.post_attention_layernorm.weight"])


class _Rotary(nn.Module):
    """RoPE's inverse frequencies, computed as transformers computes the default rope (its copy
    of them too, so the weight bytes shown equal those of the model loaded through it)."""

    attention_scaling = 1.0
    rope_type = "default"

    def __init__(self, c: SimpleNamespace):
        super().__init__()
        exponents = torch.arange(0, c.head_dim, 2, dtype=torch.int64).float() / c.head_dim
        inv_freq = 1.0 / (c.rope_theta**exponents)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)


class _Inner(nn.Module):
    def __init__(self, c: SimpleNamespace, stored: dict[str, torch.Tensor]):
        super().__init__()
        self.embed_tokens = _Weight(stored["model.embed_tokens.weight"])
        self.layers = nn.ModuleList(_Block(stored, f"model.layers.{i}") for i in range(c.num_hidden_layers))
        self.norm = _Weight(stored["model.norm.weight"])
        self.rotary_emb = _Rotary(c)


class LlamaWeights(nn.Module):
    """The weights of a Llama-family model under transformers' names, and its config."""

    def __init__(
        self, config: SimpleNamespace, generation_config: SimpleNamespace, stored: dict[str, torch.Tensor]
    ):
        super().__init__()
        self.config = config
        self.generation_config = generation_config
        self.model = _Inner(config, stored)
        # Tied: one Parameter for both, as transformers ties them.
        head = self.model.embed_tokens.weight if config.tie_word_embeddings else stored["lm_head.weight"]
        self.lm_head = _Linear(head)

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def get_memory_footprint(self) -> int:
        """Bytes of the parameters and buffers, as transformers' method of the same name counts."""
        tensors = [*self.parameters(), *self.buffers()]
        return sum(t.nelement() * t.element_size() for t in tensors)

    def forward(self, *args, **kwargs):
        raise RuntimeError("this model was loaded for the fast path only; load it with transformers")


def stored_shapes(c: SimpleNamespace) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint must hold, and its shape, from the config."""
    hidden = c.hidden_size
    shapes = {"model.embed_tokens.weight": (c.vocab_size, hidden), "model.norm.weight": (hidden,)}
    for i in range(c.num_hidden_layers):
        shapes |= _block_shapes(c, f"model.layers.{i}")
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, hidden)
    return shapes


def _block_shapes(c: SimpleNamespace, block: str) -> dict[str, tuple[int, ...]]:
    """The tensors of one decoder block (named under `block`), and their shapes."""
    hidden, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return {
        f"{block}.self_attn.q_proj.weight": (q, hidden),
        f"{block}.self_attn.k_proj.weight": (kv, hidden),
        f"{block}.self_attn.v_proj.weight": (kv, hidden),
        f"{block}.self_attn.o_proj.weight": (hidden, q),
        f"{block}.mlp.gate_proj.weight": (c.intermediate_size, hidden),
        f"{block}.mlp.up_proj.weight": (c.intermediate_size, hidden),
        f"{block}.mlp.down_proj.weight": (hidden, c.intermediate_size),
        f"{block}.input_layernorm.weight": (hidden,),
        f"{block}.post_attention_layernorm.weight": (hidden,),
    }


def read_config(directory: Path) -> SimpleNamespace | None:
    """config.json as attributes, with head_dim and rope_theta filled in; None where this module
    cannot reproduce the model exactly."""
    try:
        raw = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict):
        return None
    if raw.get("model_type") not in ("llama", "mistral") or raw.get("attention_bias") or raw.get("mlp_bias"):
        return None  # the tree below is Llama's, without biases
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(rope, dict):  # a damaged config: transformers says what is wrong with it
        return None
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = rope.get("rope_theta", raw.get("rope_theta"))
    if rope_type != "default" or not isinstance(theta, (int, float)):
        return None
    if raw.get("partial_rotary_factor", 1.0) != 1.0:
        return None
    needed = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    if not all(isinstance(raw.get(name), int) and raw[name] > 0 for name in needed):
        return None
    config = SimpleNamespace(**raw)
    config.num_key_value_heads = raw.get("num_key_value_heads") or config.num_attention_heads
    config.head_dim = raw.get("head_dim") or config.hidden_size // config.num_attention_heads
    if not isinstance(config.num_key_value_heads, int) or not isinstance(config.head_dim, int):
        return None
    config.rope_theta = float(theta)
    config.rms_norm_eps = raw.get("rms_norm_eps", 1e-6)
    config.tie_word_embeddings = raw.get("tie_word_embeddings", True)
    config.max_position_embeddings = raw.get("max_position_embeddings", 2048)
    return config if fused.config_problem(config) is None else None


def _generation_config(directory: Path, config: SimpleNamespace) -> SimpleNamespace:
    try:
        raw = json.loads((directory / "generation_config.json").read_text())
    except (OSError, ValueError):
        raw = {}
    return SimpleNamespace(eos_token_id=raw.get("eos_token_id", getattr(config, "eos_token_id", None)))


def load(directory: Path) -> LlamaWeights | None:
    """The checkpoint in `directory` as stored (its tensors views of the memory-mapped file), or
    None where it is not one this module covers: one safetensors file holding exactly the tensors
    the config describes (a tied LM head may be stored too), in those shapes."""
    config = read_config(directory)
    weights_file = directory / "model.safetensors"
    if config is None or not weights_file.is_file():
        return None
    from safetensors import SafetensorError, safe_open

    shapes = stored_shapes(config)
    try:
        with safe_open(str(weights_file), framework="pt") as f:
            names = set(f.keys())
            if not set(shapes) <= names or names - set(shapes) - {"lm_head.weight"}:
                return None
            stored = {name: f.get_tensor(name) for name in shapes}
    except (OSError, SafetensorError):
        return None
    if any(tuple(stored[name].shape) != shape for name, shape in shapes.items()):
        return None
    return LlamaWeights(config, _generation_config(directory, config), stored)
