"""A checkpoint read without transformers, for a start that runs only the fast path.

transformers' imports and `from_pretrained` are ~2 s of a ~3.5 s `llmchat ask` (docs/benchmarks-history.md),
and ~2 s of the compile child's start on Gemma 3 (its step is ready that much sooner).
The fast path (engine/fast/fused.py) needs only the config and the weights, in modules named as
the HF model names them; this module reads config.json and the memory-mapped safetensors into
exactly that tree (`CheckpointModel`), shaped by the family's record (engine/fast/families.py),
and the tokenizer with engine/chat_tokenizer.py.

It covers what it can reproduce exactly: a Llama, Mistral, Qwen2, Qwen3 or Gemma 3 checkpoint in
safetensors, plain RoPE (Gemma 3's: a base per kind of layer), no biases but Qwen2's q/k/v. A
family other than Llama's and Mistral's must have its config as transformers 5 writes it (every
layer's kind listed): an older config's defaults are transformers' to fill in. For anything else
`load` returns None, and the caller loads through transformers. The tree has no forward of its
own: a session on it decodes with the fast path only (no reference forward, no attention hooks).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from engine.fast import fused
from engine.fast.families import Family, family_of

READ_HERE = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
"""The model types this module reads (Phi-3's fused projections are left to transformers)."""
BIASES = {"qwen2": ("q_proj", "k_proj", "v_proj")}
"""The projections transformers builds with a bias whatever the config says. A config asking for
more (`attention_bias`, `mlp_bias`) is left to transformers."""
STATED = ("layer_types", "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings")
"""What a config beyond Llama's and Mistral's must state (transformers 5 writes it), not leave to
transformers' defaults, which differ by family; Gemma's also `GEMMA_STATED`, the others `hidden_act`."""
GEMMA_STATED = ("hidden_activation", "query_pre_attn_scalar", "sliding_window")


class _Linear(nn.Linear):
    """An nn.Linear made from its stored weight (and bias). The usual constructor draws random
    weights first, and on the meta device that alone imports torch._dynamo (~0.9 s)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        nn.Module.__init__(self)
        self.out_features, self.in_features = weight.shape
        self.weight = (
            weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        )
        if bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = nn.Parameter(bias, requires_grad=False)


class _Weight(nn.Module):
    """A module holding one stored tensor as `weight` (a norm, the embedding table)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)


class _ScaledEmbedding(_Weight):
    """Gemma's embedding table and the sqrt(hidden size) its rows are multiplied by, a buffer as
    transformers holds it."""

    def __init__(self, weight: torch.Tensor):
        super().__init__(weight)
        self.register_buffer("embed_scale", torch.tensor(weight.shape[1] ** 0.5), persistent=False)


def _linears(stored: dict[str, torch.Tensor], prefix: str, names) -> dict[str, _Linear]:
    """The projections `names` under `prefix`, each with its bias where the checkpoint has one."""
    weights = {name: stored[f"{prefix}.{name}.weight"] for name in names}
    return {name: _Linear(weight, stored.get(f"{prefix}.{name}.bias")) for name, weight in weights.items()}


class _Attention(nn.Module):
    def __init__(self, stored: dict[str, torch.Tensor], prefix: str, family: Family):
        super().__init__()
        for name, linear in _linears(stored, prefix, (*family.qkv, "o_proj")).items():
            setattr(self, name, linear)
        if family.qk_norm:
            self.q_norm = _Weight(stored[f"{prefix}.q_norm.weight"])
            self.k_norm = _Weight(stored[f"{prefix}.k_norm.weight"])


class _MLP(nn.Module):
    def __init__(self, stored: dict[str, torch.Tensor], prefix: str, family: Family):
        super().__init__()
        for name, linear in _linears(stored, prefix, (*family.gate_up, "down_proj")).items():
            setattr(self, name, linear)


class _Block(nn.Module):
    def __init__(self, stored: dict[str, torch.Tensor], prefix: str, family: Family):
        super().__init__()
        self.self_attn = _Attention(stored, f"{prefix}.self_attn", family)
        self.mlp = _MLP(stored, f"{prefix}.mlp", family)
        for name in _norm_names(family):
            setattr(self, name, _Weight(stored[f"{prefix}.{name}.weight"]))


def _norm_names(family: Family) -> tuple[str, ...]:
    """A block's norms by their checkpoint names: before attention and the MLP, and after each
    where the family has them (Gemma 3)."""
    names = ("input_layernorm", family.pre_mlp_norm, *(family.post_norms or ()))
    return tuple(dict.fromkeys(names))


def _inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    """RoPE's inverse frequencies, computed as transformers computes the default rope."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta**exponents)


class _Rotary(nn.Module):
    """RoPE's inverse frequencies as transformers holds them (its copy of them too, so the weight
    bytes shown equal those of the model loaded through it): one table, or one per kind of layer
    (Gemma 3's `{kind}_inv_freq`)."""

    def __init__(self, c: SimpleNamespace):
        super().__init__()
        if c.rope_thetas is None:
            self.rope_type, self.attention_scaling = "default", 1.0
            tables = {"": _inv_freq(c.rope_theta, c.head_dim)}
        else:
            kinds = sorted(c.rope_thetas)
            self.rope_type = dict.fromkeys(kinds, "default")
            tables = {f"{kind}_": _inv_freq(c.rope_thetas[kind], c.head_dim) for kind in kinds}
        for prefix, inv_freq in tables.items():
            self.register_buffer(f"{prefix}inv_freq", inv_freq, persistent=False)
            self.register_buffer(f"{prefix}original_inv_freq", inv_freq.clone(), persistent=False)
            if prefix:
                setattr(self, f"{prefix}attention_scaling", 1.0)


class _Inner(nn.Module):
    def __init__(self, c: SimpleNamespace, stored: dict[str, torch.Tensor]):
        super().__init__()
        embedding = _ScaledEmbedding if c.family.scaled_embedding else _Weight
        self.embed_tokens = embedding(stored["model.embed_tokens.weight"])
        self.layers = nn.ModuleList(
            _Block(stored, f"model.layers.{i}", c.family) for i in range(c.num_hidden_layers)
        )
        self.norm = _Weight(stored["model.norm.weight"])
        self.rotary_emb = _Rotary(c)


class CheckpointModel(nn.Module):
    """The weights of a model of the fast path's families under transformers' names, and its config."""

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
    attn, mlp = f"{block}.self_attn", f"{block}.mlp"
    outputs = {"q_proj": q, "k_proj": kv, "v_proj": kv}
    shapes = {f"{attn}.{name}.weight": (rows, hidden) for name, rows in outputs.items()}
    shapes |= {f"{attn}.{name}.bias": (outputs[name],) for name in BIASES.get(c.model_type, ())}
    shapes[f"{attn}.o_proj.weight"] = (hidden, q)
    if c.family.qk_norm:
        shapes |= {f"{attn}.q_norm.weight": (c.head_dim,), f"{attn}.k_norm.weight": (c.head_dim,)}
    shapes |= {
        f"{mlp}.gate_proj.weight": (c.intermediate_size, hidden),
        f"{mlp}.up_proj.weight": (c.intermediate_size, hidden),
        f"{mlp}.down_proj.weight": (hidden, c.intermediate_size),
    }
    return shapes | {f"{block}.{name}.weight": (hidden,) for name in _norm_names(c.family)}


def read_config(directory: Path) -> SimpleNamespace | None:
    """config.json as attributes, with head_dim and the RoPE bases filled in; None where this
    module cannot reproduce the model exactly."""
    try:
        raw = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or raw.get("model_type") not in READ_HERE:
        return None
    if raw.get("attention_bias") or raw.get("mlp_bias") or raw.get("use_sliding_window"):
        return None  # biases beyond BIASES; Qwen's windows, set by more than the window's length
    family = family_of(SimpleNamespace(model_type=raw["model_type"]))
    if family.name not in ("Llama", "Mistral"):
        stated = STATED + (GEMMA_STATED if family.scaled_embedding else ("hidden_act",))
        if not all(key in raw for key in stated):
            return None
        if len(raw["layer_types"] or ()) != raw.get("num_hidden_layers"):
            return None
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    thetas = _rope_thetas(rope, raw)
    if thetas is None:
        return None
    if raw.get("partial_rotary_factor", 1.0) != 1.0:
        return None
    needed = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    if not all(isinstance(raw.get(name), int) and raw[name] > 0 for name in needed):
        return None
    config = SimpleNamespace(**raw)
    config.family = family
    config.num_key_value_heads = raw.get("num_key_value_heads") or config.num_attention_heads
    config.head_dim = raw.get("head_dim") or config.hidden_size // config.num_attention_heads
    if not isinstance(config.num_key_value_heads, int) or not isinstance(config.head_dim, int):
        return None
    if family.name.startswith("Qwen"):  # transformers keeps a Qwen window only where it is used
        config.sliding_window = None
    config.rope_theta, config.rope_thetas = thetas.get(None), thetas if None not in thetas else None
    config.rms_norm_eps = raw.get("rms_norm_eps", 1e-6)
    config.tie_word_embeddings = raw.get("tie_word_embeddings", True)
    config.max_position_embeddings = raw.get("max_position_embeddings", 2048)
    return config if fused.config_problem(config) is None else None


def _rope_thetas(rope: object, raw: dict) -> dict[str | None, float] | None:
    """RoPE's base: {None: theta}, or Gemma 3's {layer kind: theta} (a table per kind of layer);
    None unless every table is the plain, unscaled rope."""
    if not isinstance(rope, dict):  # a damaged config: transformers says what is wrong with it
        return None
    kinds = set(raw.get("layer_types") or ())
    per_kind = bool(kinds) and set(rope) == kinds and all(isinstance(v, dict) for v in rope.values())
    tables = rope if per_kind else {None: rope}
    thetas = {}
    for kind, table in tables.items():
        theta = table.get("rope_theta", raw.get("rope_theta"))
        if table.get("rope_type", table.get("type", "default")) != "default":
            return None
        if not isinstance(theta, (int, float)) or isinstance(theta, bool):
            return None
        thetas[kind] = float(theta)
    return thetas


def _generation_config(directory: Path, config: SimpleNamespace) -> SimpleNamespace:
    try:
        raw = json.loads((directory / "generation_config.json").read_text())
    except (OSError, ValueError):
        raw = {}
    return SimpleNamespace(eos_token_id=raw.get("eos_token_id", getattr(config, "eos_token_id", None)))


def load(directory: Path) -> CheckpointModel | None:
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
    return CheckpointModel(config, _generation_config(directory, config), stored)
