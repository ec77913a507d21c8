"""A readable, fast forward pass for Llama-family models (in the spirit of gpt-fast); the
families it runs, and how each differs from Llama, are records in engine/fast/families.py.

It runs on the Hugging Face model's own weights, fused where batch-1 decode gains from
fewer, larger matmuls: q/k/v become one [q+k+v, hidden] matrix and gate/up one
[2*intermediate, hidden] matrix. The HF modules' weights are then re-pointed at views of the
fused tensors, so nothing is stored twice and the HF forward (the readable reference, and the
eager-attention path of the attention view) keeps working on the same cache.

One step for each layer, on `n` new tokens at positions p..p+n-1:

    a = rmsnorm(h);  q, k, v = a @ Wqkv.T;  rotate q, k by position (RoPE)
    K, V = cache + k, v;  h += softmax(q K.T / sqrt(d) + causal) V @ Wo.T
    m = rmsnorm(h);  g, u = m @ Wgu.T;  h += (silu(g) * u) @ Wdown.T

(plus what a family's record says differs, engine/fast/families.py: each projection's bias where
the checkpoint has one; an RMSNorm of each q and k head before the rotation (Qwen3, Gemma 3);
Gemma's norms of the attention's and the MLP's outputs, (1 + w) norm weights, GELU, scaled
embeddings; layers that attend over a sliding window of the last positions only, with a RoPE
base of their own.)

On a CPU without native 16-bit matmul, 16-bit weights make batch-1 decode fast (half the
bytes to read) but prefill slow; prefill therefore upcasts each weight to float32 on the fly
(reading 16-bit weights once per chunk costs far less than the chunk's arithmetic).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.cpu_features import cpu_matmul_native
from engine.fast import attention, gemm, huge_pages, matvec, norm, pages
from engine.fast.families import Family, covered, family_of, layer_facts
from engine.kvcache import KVCache
from engine.kvcache_layers import QuantizedKV, quantize
from engine.quant.int8 import Int8Linear
from engine.quant.w4 import W4Linear
from engine.quant.w8 import W8Linear

UPCAST_ABOVE = 4
"""Feeds of more tokens than this run in float32 on a CPU (see module docstring)."""


def supports(model: nn.Module) -> str | None:
    """None if the fast path can run this model, else why not."""
    return config_problem(model.config) or _rope_problem(model.model.rotary_emb, model.config)


def config_problem(config: Any) -> str | None:
    """What in a model's config the fast path cannot run, if anything (the RoPE aside: `supports`)."""
    if family_of(config) is None:
        return f"model type {getattr(config, 'model_type', '?')} (fast path covers {covered()})"
    facts = layer_facts(config)
    if facts.activation not in ACTIVATIONS:
        return f"activation {facts.activation}"
    if getattr(config, "attn_logit_softcapping", None):
        return "attention logits soft-capped (Gemma 2)"
    if getattr(config, "quantization_config", None) is not None:
        return "quantized (bitsandbytes) weights"
    return None


ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
}
"""The MLP's activations the fast path computes, by their transformers names."""


def _rope_problem(rotary: nn.Module, config: Any) -> str | None:
    """Why the model's RoPE is not the fixed table per layer kind the fast path rotates by, if it is not."""
    kinds = rotary.rope_type.values() if isinstance(rotary.rope_type, dict) else [rotary.rope_type]
    changing = sorted({k for k in kinds if k in ("dynamic", "longrope")})
    if changing:  # their frequencies change with the sequence's length
        return f"RoPE scaling {', '.join(changing)}"
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if any(inv_freq.numel() * 2 != head_dim for inv_freq, _ in _rope_tables(rotary).values()):
        return "RoPE over part of each head (partial_rotary_factor)"
    return None


def _rope_tables(rotary: nn.Module) -> dict[str | None, tuple[torch.Tensor, float]]:
    """(inverse frequencies, cos/sin scale) of the model's rotary embedding per layer kind, or
    under None where every layer rotates alike."""
    if isinstance(rotary.rope_type, dict):  # Gemma 3: `{kind}_inv_freq` per layer kind
        return {
            kind: (
                getattr(rotary, f"{kind}_inv_freq").float(),
                float(getattr(rotary, f"{kind}_attention_scaling")),
            )
            for kind in rotary.rope_type
        }
    return {None: (rotary.inv_freq.float(), float(getattr(rotary, "attention_scaling", 1.0)))}


def transposed_is_faster(dtype: torch.dtype, device: torch.device, compiled: bool) -> bool:
    """Weight layout. Without oneDNN, eager batch-1 matmul on a CPU reads float32 [in, out]
    ~1.5x faster than [out, in] (the 16-bit kernels are fast only as [out, in]); oneDNN is as
    fast either way (scripts/gemm.py), and the compiled step's matvec streams [out, in] rows
    faster still (measured: docs/benchmarks-history.md)."""
    cpu_float32 = device.type == "cpu" and dtype == torch.float32
    return cpu_float32 and not compiled and not gemm.onednn_works()


class _Layer:
    def __init__(self, block: nn.Module, fuse: "_Fuser", family: Family, window: int | None, rope: int):
        attn, mlp = block.self_attn, block.mlp
        qkv = [getattr(attn, name) for name in family.qkv]
        gate_up = [getattr(mlp, name) for name in family.gate_up]
        # Biases first: fusing re-points each module's weight, never its bias.
        self.bqkv = _biases(*qkv)
        self.bo = _biases(attn.o_proj)
        self.bgu = _biases(*gate_up)
        self.bdown = _biases(mlp.down_proj)
        self.wqkv = fuse(*qkv)
        self.wo = fuse(attn.o_proj)
        self.wgu = fuse(*gate_up)
        self.wdown = fuse(mlp.down_proj)
        self.ln1 = _weight(block.input_layernorm)
        self.ln2 = _weight(getattr(block, family.pre_mlp_norm))
        self.q_norm = _weight(attn.q_norm) if family.qk_norm else None
        self.k_norm = _weight(attn.k_norm) if family.qk_norm else None
        post = family.post_norms or (None, None)
        self.post_attn, self.post_mlp = (_weight(getattr(block, name)) if name else None for name in post)
        self.window = window
        """A sliding window's length, or None for attention over the whole context."""
        self.rope = rope
        """Which of the fast path's RoPE tables this layer rotates by."""

    NORMS = ("ln1", "ln2", "q_norm", "k_norm", "post_attn", "post_mlp")
    SMALL = NORMS + ("bqkv", "bo", "bgu", "bdown")
    """The vectors (norm weights, biases): kept in the activations' dtype, each its own copy."""

    def own_small(self, dtype: torch.dtype, norm_offset: float) -> None:
        """Each vector its own copy in `dtype`; a family's norm offset (Gemma's 1 + w) added once here."""
        for name in self.SMALL:
            value = getattr(self, name)
            if value is not None:
                offset = norm_offset if name in self.NORMS else 0.0
                setattr(self, name, (value.detach().float() + offset).to(dtype))


def _weight(module: nn.Module) -> torch.Tensor:
    return module.weight.detach()


def _biases(*linears: nn.Module) -> torch.Tensor | None:
    """The modules' biases end to end, as their fused matrix's rows are; None where they have none."""
    biases = [getattr(linear, "bias", None) for linear in linears]
    if all(b is None for b in biases):
        return None
    if any(b is None for b in biases):
        raise ValueError("a fused projection with a bias on some of its parts only")
    return torch.cat([b.detach() for b in biases])


class _Fuser:
    """Stacks [out, in] weights into one matrix (stored [in, out] if `transposed`) and points
    each module at its slice of it, so the HF forward still works and nothing is stored twice.
    w8a8, w8 and w4 modules fuse their rows the same way (engine/quant/int8.py, w8.py, w4.py).

    Each source is copied straight into its place in the fused matrix and its pages of the
    weight file are handed back at once, so the file and the copies are never resident together.
    A lone matrix already in the process's own memory (narrowed to 16 bits) is kept as it is.
    """

    def __init__(self, transposed: bool):
        self.transposed = transposed
        self.mappings = pages.weight_file_mappings()

    def __call__(self, *linears: nn.Module) -> torch.Tensor | Int8Linear | W8Linear | W4Linear:
        if isinstance(linears[0], (Int8Linear, W8Linear, W4Linear)):
            kind = type(linears[0])
            fused = linears[0] if len(linears) == 1 else kind.fuse(list(linears))
            if kind is Int8Linear:
                fused.packed  # pack at load time, not inside the first answer's TTFT
            return fused
        first = linears[0].weight
        if len(linears) == 1 and not self.transposed and not pages.mapped(first, self.mappings):
            # The process's own memory already (narrowed to 16 bits): a copy would only add a peak.
            return first.detach()
        rows = sum(linear.weight.shape[0] for linear in linears)
        shape = (first.shape[1], rows) if self.transposed else (rows, first.shape[1])
        fused = torch.empty(shape, dtype=first.dtype, device=first.device)
        start = 0
        for linear in linears:
            source = linear.weight.detach()
            stop = start + source.shape[0]
            if self.transposed:
                fused[:, start:stop].copy_(source.t())
                view = fused[:, start:stop].t()
            else:
                fused[start:stop].copy_(source)
                view = fused[start:stop]
            linear.weight = nn.Parameter(view, requires_grad=False)
            pages.release(source, self.mappings)
            start = stop
        return fused


def _own_remaining_weights(model: nn.Module, fused: list[torch.Tensor]) -> None:
    """Copy the small tensors still backed by the loader's memory map (the norms).

    HF maps the safetensors file and every weight is a view of that one mapping; once the
    big matrices live in fused copies, these views alone would keep all of it resident.
    """
    ours = {t.untyped_storage().data_ptr() for t in fused}
    mappings = pages.weight_file_mappings()
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.untyped_storage().data_ptr() not in ours:
                own = pages.owned_copy(param.detach(), mappings)
                setattr(module, name, nn.Parameter(own, requires_grad=False))


_built: "weakref.WeakKeyDictionary[nn.Module, FastLlama]" = weakref.WeakKeyDictionary()


def for_model(model: nn.Module, compiled: bool = False, in_huge_pages: bool = True) -> "FastLlama":
    """The model's fast path, built (and its weights fused) once however many sessions use it;
    `compiled` lays the weights out for the compiled step. The first build fixes the layout, and
    starts moving the weights into huge pages (engine/fast/huge_pages.py) unless `in_huge_pages`
    is false (the compile child, which only traces)."""
    fast = _built.get(model)
    if fast is None:
        with pages.each_block_mapped():
            fast = _built[model] = FastLlama(model, compiled)
        if in_huge_pages:
            fast.settling = huge_pages.settle(fast.weight_tensors())
    return fast


class FastLlama:
    """forward(ids, cache) -> the last position's logits, same contract as the HF path."""

    def __init__(self, model: nn.Module, compiled: bool = False):
        config = model.config
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eps = config.rms_norm_eps
        self.family = family_of(config)
        facts = layer_facts(config)
        self.activation = facts.activation
        self.act = ACTIVATIONS[facts.activation]
        self.query_scale = 1.0 if facts.query_scale is None else facts.query_scale * self.head_dim**0.5
        """What q is multiplied by so that attention's usual 1/sqrt(head_dim) scales it as the model does."""
        self.logit_softcap = facts.logit_softcap
        inner = model.model
        weight = inner.embed_tokens.weight
        self.transposed = transposed_is_faster(weight.dtype, weight.device, compiled)
        self.norm = inner.norm.weight
        tied = getattr(model.lm_head, "weight", None) is weight
        fuse = _Fuser(self.transposed)
        self.lm_head = fuse(model.lm_head)
        if tied:  # one matrix serves both: embedding rows are lm_head's output rows
            inner.embed_tokens.weight = model.lm_head.weight
        self.embed = inner.embed_tokens.weight  # [vocab, hidden], possibly a transposed view
        tables = _rope_tables(inner.rotary_emb)
        kinds = list(tables)
        rope_of = [kinds.index(kind if kind in tables else None) for kind in facts.layer_types]
        self.layers = [
            _Layer(block, fuse, self.family, window, rope)
            for block, window, rope in zip(inner.layers, facts.windows, rope_of)
        ]
        self.windows = sorted({w for w in facts.windows if w})
        """The sliding windows the layers attend over (none, or one or two lengths)."""
        _own_remaining_weights(model, [m for m in self.matrices() if isinstance(m, torch.Tensor)])
        self.ropes = [tables[kind] for kind in kinds]
        """(inverse frequencies, cos/sin scale) per RoPE table; one, or one per layer kind (Gemma 3)."""
        self.weight_dtype = self.embed.dtype
        on_cpu = self.embed.device.type == "cpu"
        # 16-bit arithmetic is native on GPUs; on a CPU keep activations in float32.
        self.act_dtype = torch.float32 if on_cpu else self.weight_dtype
        self.upcast_prefill = (
            on_cpu and self.weight_dtype != torch.float32 and not cpu_matmul_native(self.weight_dtype)
        )
        # Norm weights are tiny: keep them in the activations' dtype for the fused rms_norm.
        offset = self.family.norm_offset
        self.norm = (self.norm.detach().float() + offset).to(self.act_dtype)
        for layer in self.layers:
            layer.own_small(self.act_dtype, offset)
        scale = inner.embed_tokens.embed_scale if self.family.scaled_embedding else None
        self.embed_scale = None if scale is None else scale.detach().to(self.weight_dtype).clone()
        """Gemma's sqrt(hidden size), rounded to the weights' dtype as transformers rounds it."""
        self.settling = None
        """The thread moving the weights into huge pages (`for_model`), or None."""

    def matrices(self) -> list:
        """The LM head and every layer's matrices: tensors, or quantized modules holding theirs."""
        per_layer = (w for layer in self.layers for w in (layer.wqkv, layer.wo, layer.wgu, layer.wdown))
        return [self.lm_head, *per_layer]

    def weight_tensors(self) -> list[torch.Tensor]:
        """The tensors a decode step streams (a quantized matrix's buffers)."""
        tensors = []
        for matrix in self.matrices():
            tensors += [matrix] if isinstance(matrix, torch.Tensor) else list(matrix.buffers())
        return tensors

    def linear(self, x: torch.Tensor, weight: torch.Tensor, upcast: bool) -> torch.Tensor:
        """x @ W.T for a weight stored [out, in] (or x @ W for one stored [in, out]). A forward of
        at most 16 rows (a decode step, a verify, the lab's batch, a short prefill) goes through the
        matvec kernel once it is loaded (engine/fast/matvec.py): torch's matmul reads W well below
        the memory's speed for so few rows."""
        rows = x.shape[:-1].numel()
        if 1 < rows <= matvec.MAX_ROWS and _rows_dtype(x, weight) and not self.transposed:
            product = self._rows_product(x, weight)
            if product is not None:
                return product
        one_row = rows == 1 and not self.transposed
        if isinstance(weight, (W8Linear, W4Linear)) and one_row and x.dtype == torch.float32:
            product = _quantized_product(x.reshape(1, -1), weight, matvec.can_multiply_now)
            if product is not None:
                return product.view(*x.shape[:-1], -1)
        if isinstance(weight, nn.Module):  # w8a8, w8, w4: the module multiplies
            return weight(x)
        if weight.dtype != x.dtype:
            if upcast:  # [out, in]: only float32 weights are ever stored transposed
                return gemm.widened(x, weight)
            return self.linear(x.to(weight.dtype), weight, upcast).to(x.dtype)
        if one_row and matvec.can_multiply_now(weight):
            return matvec.multiply(x.reshape(1, -1), weight).view(*x.shape[:-1], -1)
        return gemm.linear(x, weight.t() if self.transposed else weight)

    @staticmethod
    def _rows_product(x: torch.Tensor, weight) -> torch.Tensor | None:
        """x [.., in] (2 to 16 rows, float32 or W's dtype) @ W.T by the matvec kernel, each weight
        row read once for every row of x; None where the kernel is not loaded or does not stream W
        (w8a8's). Against 16-bit weights, x is rounded to their dtype and so is the product, as a
        one-row step and the compiled verify round them: a verify scores each token as the step
        would, and bf16 rows go through `vdpbf16ps` (9 float32 rows against bf16 W took 1.6x as long)."""
        rows = x.reshape(-1, x.shape[-1])
        if isinstance(weight, (W8Linear, W4Linear)):
            product = _quantized_product(rows, weight, matvec.can_multiply_now)
        elif isinstance(weight, torch.Tensor) and matvec.can_multiply_now(weight):
            product = matvec.multiply(rows.to(weight.dtype), weight).to(x.dtype)
        else:
            return None
        return None if product is None else product.view(*x.shape[:-1], -1)

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return norm.rms_norm(x, weight, self.eps)

    def embedded(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of `ids` [n] in the activations' dtype: h [n, hidden]."""
        h = self.embed[ids]
        if self.embed_scale is not None:  # in the weights' dtype, as transformers multiplies
            h = h * self.embed_scale
        return h.to(self.act_dtype)

    def rope(self, positions: torch.Tensor, table: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for `positions` [n] by RoPE table `table`, shaped [n, 1, head_dim].

        HF's rotate_half(x) = cat(-x2, x1) equals roll(x, d/2) * [-1.., +1..], so the sign
        goes into sin and one rotation is roll, two multiplies and an add.
        """
        inv_freq, scale = self.ropes[table]
        freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
        cos = torch.cat((freqs.cos(), freqs.cos()), dim=-1) * scale
        sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1) * scale
        return cos[:, None].to(self.act_dtype), sin[:, None].to(self.act_dtype)

    def ropes_at(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`rope(positions, t)` for each table t: what each layer's `layer.rope` picks from."""
        return [self.rope(positions, table) for table in range(len(self.ropes))]

    def window_starts(self, position: torch.Tensor) -> dict[int | None, torch.Tensor]:
        """The first position a decode step at `position` ([n] tensor: one token, or a verify's
        few) attends to, per window length (None: the whole context, from 0)."""
        starts = {None: torch.zeros_like(position)}
        for window in self.windows:
            starts[window] = (position - (window - 1)).clamp(min=0)
        return starts

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin

    def _matvec(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [n, in] @ W.T for torch.compile (one row; a verify's few): where the CPU has AVX-512
        or AVX2, the matvec kernel (engine/fast/matvec.py); else written as multiply-and-sum,
        which Inductor turns into one loop that streams W's [out, in] rows once, faster than
        aten's batch-1 matmul (16-bit weights are widened inside the loop;
        docs/benchmarks-history.md). A fast path built for eager use may keep float32 as
        [in, out], which aten multiplies faster than this loop."""
        if isinstance(weight, (W8Linear, W4Linear)):
            product = _quantized_product(x, weight, matvec.can_multiply) if x.dtype == torch.float32 else None
            return weight.matvec(x) if product is None else product
        if weight.device.type != "cpu":  # a GPU's own matmul: the loop is for Inductor's CPU code
            return self.linear(x, weight, upcast=False)
        if self.transposed:
            return x @ weight
        if weight.dtype != x.dtype:  # rounded as the eager path rounds: in and out in W's dtype
            return self._matvec(x.to(weight.dtype), weight).to(x.dtype)
        if matvec.can_multiply(weight):
            return matvec.multiply(x, weight)
        return (x[:, None, :] * weight[None]).sum(-1)

    def attention(self, q: torch.Tensor, keys, values, mask, position, first=None) -> torch.Tensor:
        """softmax(q K.T / sqrt(d) + mask) V for q [1, heads, n, d] over the cached K/V; token i
        attends to positions first[i]..position[i] ([n] tensors: a sliding window's start, or
        None: 0), which `mask` says too. `position` None (a prefill's chunk): by `mask`, or plainly
        causal. `keys` is a QuantizedKV for an int8 cache (then `values` is unused).

        The query heads that share a K/V head (grouped-query attention) go in as that head's
        queries, so each cached K/V is read once rather than once per query head
        (docs/benchmarks-history.md); once built, the decode kernel of engine/fast/attention.py
        does it at close to the memory bandwidth, reading a 16-bit or int8 cache as stored, for
        one token or a verify's few at once."""
        _, heads, n, d = q.shape
        kernel = attention.can_attend(keys.keys if isinstance(keys, QuantizedKV) else keys)
        if n > 1 and (position is None or not kernel):
            if isinstance(keys, QuantizedKV):  # no kernel reads it as stored: a float copy
                keys, values = keys.dequantized(q.dtype)
            elif keys.dtype != q.dtype:  # a 16-bit cache under float32 queries
                keys, values = keys.to(q.dtype), values.to(q.dtype)
            # no mask: the cache held nothing before these queries, plainly causal
            return F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, is_causal=mask is None, enable_gqa=True
            )
        # Each token's query heads that share a K/V head go in together, token after token.
        kv_heads, group = self.kv_heads, heads // self.kv_heads
        grouped = q.reshape(1, kv_heads, group, n, d).transpose(2, 3).reshape(1, kv_heads, n * group, d)
        if isinstance(keys, QuantizedKV):
            out = attention.decode_int8(grouped.float(), keys, position, first)
        elif kernel:
            out = attention.decode(grouped.float(), keys, values, position, first)
        else:
            out = F.scaled_dot_product_attention(grouped.to(keys.dtype), keys, values, attn_mask=mask)
        return out.reshape(1, kv_heads, n, group, d).transpose(2, 3).reshape(1, heads, n, d)

    def block(self, layer: _Layer, h: torch.Tensor, cos, sin, linear, attend) -> torch.Tensor:
        """One transformer layer on h [n, hidden]; `linear(x, W)` is x @ W.T, `attend(q, k, v)`
        stores k, v and attends."""
        n = h.shape[0]
        heads, qk_heads = self.heads, self.heads + self.kv_heads
        a = self.rmsnorm(h, layer.ln1)
        qkv = _plus(linear(a, layer.wqkv), layer.bqkv).view(n, qk_heads + self.kv_heads, self.head_dim)
        qk = self._rotate(self._qk_normed(layer, qkv[:, :qk_heads]), cos, sin)  # q and k rotate together
        q = qk[:, :heads] if self.query_scale == 1.0 else qk[:, :heads] * self.query_scale
        q, k, v = (x.transpose(0, 1)[None] for x in (q, qk[:, heads:], qkv[:, qk_heads:]))
        attn = attend(q, k, v)  # [1, heads, n, head_dim]
        attn = attn[0].transpose(0, 1).reshape(n, heads * self.head_dim).to(h.dtype)
        h = h + self._normed(_plus(linear(attn, layer.wo), layer.bo), layer.post_attn)
        m = self.rmsnorm(h, layer.ln2)
        gate, up = _plus(linear(m, layer.wgu), layer.bgu).chunk(2, dim=-1)
        return h + self._normed(_plus(linear(self.act(gate) * up, layer.wdown), layer.bdown), layer.post_mlp)

    def _normed(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """A sublayer's output normalized before it joins the residual, where the family does so."""
        return x if weight is None else self.rmsnorm(x, weight)

    def _qk_normed(self, layer: _Layer, qk: torch.Tensor) -> torch.Tensor:
        """q and k [n, heads + kv_heads, d], each head normalized over d where the family does so."""
        if layer.q_norm is None:
            return qk
        q, k = qk[:, : self.heads], qk[:, self.heads :]
        return torch.cat((self.rmsnorm(q, layer.q_norm), self.rmsnorm(k, layer.k_norm)), dim=1)

    def _logits(self, h: torch.Tensor, linear) -> torch.Tensor:
        return self.all_logits(h[-1:], linear)[0]

    def all_logits(self, h: torch.Tensor, linear) -> torch.Tensor:
        """Logits [n, vocab] of each row of h [n, hidden] (soft-capped where the family does so)."""
        logits = linear(self.rmsnorm(h, self.norm), self.lm_head).float()
        if self.logit_softcap:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits

    def forward(self, ids: torch.Tensor, cache: KVCache, every: bool = False) -> torch.Tensor:
        """Feed ids [1, n] after the cache's tokens; returns logits [vocab] of the last one, or with
        `every` logits [n, vocab] of each (a speculative verify scores every drafted token)."""
        n = ids.shape[1]
        start = len(cache)
        upcast = self.upcast_prefill and n > UPCAST_ABOVE
        h = self.embedded(ids[0])  # [n, hidden]
        ropes = self.ropes_at(torch.arange(start, start + n, device=h.device))
        # A few new tokens (a step, a verify, a short prefill): each one's position, for the
        # attention kernel, which reads the cache once for all of them, as stored.
        few = n <= matvec.MAX_ROWS
        positions = torch.arange(start, start + n) if few else None
        firsts = self.window_starts(positions) if few else {}
        masks = _Masks(start, n, h.device)

        def attend(cache_layer, window, q, k, v):
            # Stored in the cache's own precision (engine/kvcache.py); a few tokens' attention
            # reads it as stored, a prefill chunk's queries a copy of it in their dtype
            # (`attention`). The cache's slot 0 holds position `cache_layer.start` (a sliding
            # window drops the oldest).
            stored = cache_layer.append(k, v)
            offset = cache_layer.start
            slot, first = (positions, firsts[window]) if few else (None, None)
            if few and offset:
                slot, first = slot - offset, first - offset
            return self.attention(q, *_pair(stored), masks.get(window, offset), slot, first)

        linear = functools.partial(self.linear, upcast=upcast)
        for layer, cache_layer in zip(self.layers, cache.layers):
            layer_attend = functools.partial(attend, cache_layer, layer.window)
            h = self.block(layer, h, *ropes[layer.rope], linear, layer_attend)
        return self.all_logits(h, linear) if every else self._logits(h, linear)

    def block_on_buffers(
        self,
        layer: _Layer,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        position: torch.Tensor,
        first: torch.Tensor,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        k_scales: torch.Tensor | None = None,
        v_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One layer of a decode step, written for torch.compile (engine/fast/compiled.py), which
        compiles it once and runs it for every layer: h is [n, hidden] (one token, or a verify's
        few), position [n] their slots, first [n] the first slot each attends to (0, or a sliding
        window's start; cos, sin and first come in per layer, as a model's kinds of layer differ
        in them), k/v_buffer the layer's whole cache buffer [1, kv_heads, capacity, d] (int8 with
        its k/v_scales [1, kv_heads, capacity] for an int8 cache). The new K/V go in at
        `position`; row i attends to the slots first[i]..position[i]."""
        slots = torch.arange(k_buffer.shape[2], device=h.device)[None, :]
        mask = (slots <= position[:, None]) & (slots >= first[:, None])  # [n, capacity]

        def attend(q, k, v):
            if k_scales is not None:  # each new row quantized as engine/kvcache.py stores it
                (k, k_scale), (v, v_scale) = quantize(k), quantize(v)
                k_scales.index_copy_(2, position, k_scale)
                v_scales.index_copy_(2, position, v_scale)
            k_buffer.index_copy_(2, position, k.to(k_buffer.dtype))
            v_buffer.index_copy_(2, position, v.to(v_buffer.dtype))
            if k_scales is not None:
                stored = QuantizedKV(k_buffer, k_scales, v_buffer, v_scales)
                return self.attention(q, stored, None, mask, position, first)
            return self.attention(q.to(k_buffer.dtype), k_buffer, v_buffer, mask, position, first)

        return self.block(layer, h, cos, sin, self._matvec, attend)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """The logits [vocab] of a decode step's h [1, hidden], for torch.compile as above."""
        return self._logits(h, self._matvec)

    def head_rows(self, h: torch.Tensor) -> torch.Tensor:
        """The logits [n, vocab] of each row of a verify's h [n, hidden], for torch.compile as above."""
        return self.all_logits(h, self._matvec)


def _quantized_product(x: torch.Tensor, weight: W8Linear | W4Linear, can) -> torch.Tensor | None:
    """x [n, in] (float32) @ W.T by the matvec kernel for w8's int8 rows (then their scales) or
    w4's Q4_0 blocks; None where `can` (matvec.can_multiply[_now]) says the kernel cannot."""
    if not can(weight.q):
        return None
    if isinstance(weight, W4Linear):
        return matvec.multiply_q4(x, weight.q, weight.scale)
    return matvec.multiply(x, weight.q) * weight.scale


def _rows_dtype(x: torch.Tensor, weight) -> bool:
    """Whether the kernel takes these rows of x as they are: float32 against any weight, or a
    16-bit x against a weight of its own dtype (a bf16 model's activations: one read of W where
    torch's matmul took ~2 steps' time for 5 rows)."""
    return x.dtype == torch.float32 or (isinstance(weight, torch.Tensor) and weight.dtype == x.dtype)


def _plus(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x if bias is None else x + bias


class _Masks:
    """The masks of a forward of n tokens after `start` cached ones, per window length (None: the
    whole context) and first position held (a sliding window may have dropped the oldest): query i
    (at start+i) sees the keys up to itself, a window's only the last `window` of those. None where
    that is plain causal attention (for one token: every key). Made when first asked for."""

    def __init__(self, start: int, n: int, device: torch.device):
        self.start, self.n, self.device = start, n, device
        self._made: dict[tuple[int | None, int], torch.Tensor | None] = {}

    def get(self, window: int | None, offset: int) -> torch.Tensor | None:
        if (window, offset) not in self._made:
            self._made[window, offset] = self._make(window, offset)
        return self._made[window, offset]

    def _make(self, window: int | None, offset: int) -> torch.Tensor | None:
        start, n = self.start, self.n
        if n == 1 and (window is None or start < window):
            return None
        queries = start + torch.arange(n, device=self.device)[:, None]
        keys = torch.arange(offset, start + n, device=self.device)[None, :]
        if window is None or start + n <= window:
            return keys <= queries if start else None
        return (keys <= queries) & (keys > queries - window)


def _pair(stored) -> tuple:
    """(keys, values) as `_attention` takes them: an int8 cache's QuantizedKV goes whole as keys."""
    return (stored, None) if isinstance(stored, QuantizedKV) else stored
