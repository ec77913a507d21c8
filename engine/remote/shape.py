"""The model's KV-cache shape when the server's weights can be read here.

No OpenAI-compatible server reports layers, KV heads and head size. llama.cpp's /props names
the GGUF file it serves; when that path is readable on this machine (a server on this host or
a shared disk) its header holds them, and the bytes-per-token formula can be filled in.
Anywhere else the KV panel says the shape is not known rather than guess.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from engine.gguf_header import gguf_metadata

LLAMA_SERVER_CACHE_BYTES = 2
"""llama-server keeps K and V in f16 unless started with --cache-type-k/--cache-type-v,
which it does not report: the formula says it assumes the default."""


@dataclass(frozen=True)
class GgufShape:
    """The KV-cache shape a GGUF header gives (engine/instruments/phases.py `ModelShape` is the
    loaded model's fuller one, for the phase counts)."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int | None
    context_trained: int | None


def gguf_shape(path: str | None) -> GgufShape | None:
    """The shape from a GGUF file's header, or None when it is not readable here."""
    if not path or not Path(path).is_file():
        return None
    try:
        meta = gguf_metadata(Path(path))
    except (OSError, ValueError, struct.error):  # not a GGUF we can read: the shape stays unknown
        return None
    arch = meta.get("general.architecture")
    layers, heads, hidden = (
        meta.get(f"{arch}.{k}") for k in ("block_count", "attention.head_count", "embedding_length")
    )
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", heads)
    head_dim = meta.get(f"{arch}.attention.key_length") or (
        hidden // heads if _whole(hidden) and _whole(heads) else None
    )
    if not all(_whole(v) for v in (layers, heads, kv_heads, head_dim, hidden)):
        return None  # per-layer head counts (a list) and the like: not one formula
    vocab, trained = meta.get(f"{arch}.vocab_size"), meta.get(f"{arch}.context_length")
    return GgufShape(
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=hidden,
        vocab_size=vocab if _whole(vocab) else None,
        context_trained=trained if _whole(trained) else None,
    )


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
