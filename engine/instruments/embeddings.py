"""Embeddings: one token's row of the embedding table, its nearest tokens, and what RoPE does to it.

Everything is read from the live model (call on the inference thread):

* the row e = E[token] of the input embedding table E [vocab, hidden]: its size and L2 norm
  ‖e‖ = sqrt(Σ e_i²), and the norm's rank among all the vocabulary's rows;
* the nearest tokens by cosine similarity cos(e, E[v]) = e·E[v] / (‖e‖ ‖E[v]‖), the token
  itself left out (its cosine with itself is 1 by definition);
* RoPE: layer 0 turns the row into a query q = W_q · rmsnorm(e) (and a key k = W_k · ...; plus
  the bias where the family has one, Qwen2's; Qwen3 then puts each head's q and k through an
  RMSNorm of its own), then rotates each pair of q's dimensions (i, i + d/2) by the angle p·θ_i,
  θ_i = base^(−2i/d), where p is the position. The same token's q at position p and at p + Δ then has

      cos(R_p q, R_{p+Δ} q) = Σ_i |q_i|² cos(Δ·θ_i) / ‖q‖²

  which depends on Δ only, never on p: the rotation is how attention's q·k learns relative
  position. It is computed here by really rotating with the model's own rotary embedding
  (its base and head size from the config), averaged over the heads.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.session import ChatSession

NEIGHBOURS = 10
DISTANCES = (0, 1, 2, 4, 8, 16, 64, 256, 1024, 4096)
"""Δ, in positions, for the RoPE rows (those past the context window are left out)."""
LATER_START = 1000
"""The second starting position p (a quarter of the window if that is less): equal rows at p = 0
and p show that only Δ matters."""
_CHUNK = 8192
"""Rows of the table read at a time (a 16-bit table is widened to float32 a chunk at a time)."""


@dataclass(frozen=True)
class Neighbour:
    id: int
    piece: str
    cosine: float


@dataclass(frozen=True)
class RopeRow:
    vector: str
    """"q" or "k"."""
    start: int
    """p: the first of the two positions."""
    cosines: tuple[float, ...]
    """cos(R_p x, R_{p+Δ} x) for each of `RopeEffect.distances`, mean over heads."""


@dataclass(frozen=True)
class RopeEffect:
    base: float
    """rope_theta: the base of the rotation frequencies."""
    head_dim: int
    heads: int
    kv_heads: int
    distances: tuple[int, ...]
    rows: tuple[RopeRow, ...]
    fastest_rad: float
    """θ_0: radians per position of the fastest-turning pair."""
    slowest_period: float
    """2π/θ_last: positions for one whole turn of the slowest pair."""
    layer_kind: str | None = None
    """Layer 0's kind where each kind has its own base (Gemma 3: "sliding_attention"), else None."""


@dataclass(frozen=True)
class TokenEmbedding:
    token_id: int
    piece: str
    dim: int
    dtype: str
    row_bytes: int
    norm: float
    norm_rank: int
    """1 = the largest norm in the vocabulary."""
    vocab: int
    median_norm: float
    min_norm: float
    max_norm: float
    tied: bool
    """The input embedding table is also the LM head (its logit for a token is h · E[token])."""
    neighbours: tuple[Neighbour, ...]
    rope: RopeEffect


def embedding_table(session: ChatSession) -> torch.Tensor:
    return session.model.get_input_embeddings().weight


def tied(session: ChatSession) -> bool:
    """True when the model's config ties the input embedding to the LM head (one matrix for both)."""
    return bool(getattr(session.model.config, "tie_word_embeddings", False))


_norms: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def row_norms(session: ChatSession) -> torch.Tensor:
    """‖E[v]‖ for every token v (float32), computed once per model."""
    norms = _norms.get(session.model)
    if norms is None:
        table = embedding_table(session)
        norms = torch.cat([c.float().norm(dim=1) for c in table.split(_CHUNK)])
        _norms[session.model] = norms
    return norms


def nearest(session: ChatSession, token_id: int, k: int = NEIGHBOURS) -> tuple[Neighbour, ...]:
    """The `k` tokens whose rows have the highest cosine similarity with the token's, itself left out."""
    table, norms = embedding_table(session), row_norms(session)
    row = table[token_id].float()
    dots = torch.cat([c.float() @ row for c in table.split(_CHUNK)])
    cosines = dots / (norms * norms[token_id]).clamp_min(1e-12)
    cosines[token_id] = -2.0  # below any cosine: never its own neighbour
    values, ids = torch.topk(cosines, min(k, len(cosines) - 1))
    namer = session.namer
    return tuple(Neighbour(int(i), namer.piece(int(i)), float(v)) for v, i in zip(values, ids))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """As the Llama code rotates: (x1, x2) -> (−x2, x1) for the two halves of each head."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _projections(session: ChatSession, token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 0's query and key of the token alone: [heads, d] and [kv_heads, d], not yet rotated
    (as the model computes them: after the per-head q/k norms where the family has them)."""
    info = session.info
    block = session.model.model.layers[0]
    attn = block.self_attn
    norm = block.input_layernorm
    x = embedding_table(session)[token_id][None, None]
    scale = getattr(session.model.get_input_embeddings(), "embed_scale", None)  # Gemma: sqrt(hidden)
    h = norm((x if scale is None else x * scale.to(x.dtype)).to(norm.weight.dtype))
    q_in = getattr(attn, "q_proj", None) or attn.qkv_proj  # Phi-3 stores q, k and v as one matrix
    dtype = getattr(q_in, "weight", None)
    if isinstance(dtype, torch.Tensor) and dtype.is_floating_point():
        h = h.to(dtype.dtype)
    q, k = _query_and_key(attn, h, info.heads * info.head_dim, info.kv_heads * info.head_dim)
    q = _head_normed(attn, "q_norm", q.view(info.heads, info.head_dim))
    k = _head_normed(attn, "k_norm", k.view(info.kv_heads, info.head_dim))
    return q.float(), k.float()


def _query_and_key(attn: torch.nn.Module, h: torch.Tensor, q_size: int, k_size: int) -> tuple:
    """The attention's q and k projections of h, from their own matrices or Phi-3's fused one."""
    if hasattr(attn, "q_proj"):
        return attn.q_proj(h), attn.k_proj(h)
    qkv = attn.qkv_proj(h)
    return qkv[..., :q_size], qkv[..., q_size : q_size + k_size]


def _head_normed(attn: torch.nn.Module, name: str, x: torch.Tensor) -> torch.Tensor:
    """x [heads, d] through the attention's per-head RMSNorm `name` (Qwen3's q_norm, k_norm), if any."""
    norm = getattr(attn, name, None)
    return x if norm is None else norm(x)


def rope_effect(session: ChatSession, token_id: int) -> RopeEffect:
    """How similar the token's own q (and k) stay when it sits Δ positions further on."""
    info = session.info
    rotary = session.model.model.rotary_emb
    later = min(LATER_START, info.context // 4)
    distances = tuple(d for d in DISTANCES if later + d < info.context)
    q, k = _projections(session, token_id)
    rows = []
    kind = _first_layer_kind(session.model.config, rotary)
    for vector, x, starts in (("q", q, (0, later)), ("k", k, (0,))):
        for start in starts:
            positions = torch.tensor([[start] + [start + d for d in distances]], device=x.device)
            by_kind = () if kind is None else (kind,)
            cos, sin = rotary(x, positions, *by_kind)  # [1, 1 + len(distances), d]
            rotated = x[None] * cos[0, :, None].float() + _rotate_half(x[None]) * sin[0, :, None].float()
            similarity = torch.nn.functional.cosine_similarity(rotated[:1], rotated[1:], dim=-1)
            rows.append(RopeRow(vector, start, tuple(similarity.mean(dim=1).tolist())))
    inv_freq = getattr(rotary, "inv_freq" if kind is None else f"{kind}_inv_freq").float()
    config = session.model.config
    params = getattr(config, "rope_parameters", None) or {}
    params = params.get(kind, params) if kind is not None else params
    base = params.get("rope_theta", getattr(config, "rope_theta", float("nan")))
    return RopeEffect(
        float(base),
        info.head_dim,
        info.heads,
        info.kv_heads,
        distances,
        tuple(rows),
        float(inv_freq[0]),
        float(2 * torch.pi / inv_freq[-1]),
        kind,
    )


def _first_layer_kind(config, rotary: torch.nn.Module) -> str | None:
    """Layer 0's kind where the model rotates each kind by its own base (Gemma 3's local layers:
    10k, its global ones: 1M), else None."""
    if not isinstance(getattr(rotary, "rope_type", None), dict):
        return None
    return config.layer_types[0]


def token_embedding(session: ChatSession, token_id: int) -> TokenEmbedding:
    """Everything the embeddings view shows for one token (on the inference thread)."""
    table = embedding_table(session)
    if not 0 <= token_id < table.shape[0]:
        raise ValueError(f"token id {token_id} is outside the vocabulary (0 to {table.shape[0] - 1})")
    with torch.inference_mode():
        norms = row_norms(session)
        norm = float(norms[token_id])
        return TokenEmbedding(
            token_id=token_id,
            piece=session.namer.piece(token_id),
            dim=table.shape[1],
            dtype=str(table.dtype).removeprefix("torch."),
            row_bytes=table.shape[1] * table.element_size(),
            norm=norm,
            norm_rank=1 + int((norms > norm).sum()),
            vocab=table.shape[0],
            median_norm=float(norms.median()),
            min_norm=float(norms.min()),
            max_norm=float(norms.max()),
            tied=tied(session),
            neighbours=nearest(session, token_id),
            rope=rope_effect(session, token_id),
        )


def tokens_of(session: ChatSession, text: str) -> list[int]:
    """The ids the tokenizer makes of `text` (no special tokens added); empty text is refused."""
    if not text.strip():
        raise ValueError("type some text to see its tokens")
    return session.tokenizer(text, add_special_tokens=False)["input_ids"]
