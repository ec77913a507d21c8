"""FLOPs and bytes of one batched step, counted as the phases instrument counts them
(engine/instruments/phases.py), so its arithmetic intensity sits on the same roofline:

    FLOPs = 2·P·T + 2·hidden·vocab·F + Σ_feeds 4·layers·heads·d·pairs(n, start)
    bytes = W + Σ_feeds kv·(start + 2n)

T tokens in the step, F feeds (one logits row each), W the weight bytes a pass streams, kv
the K/V bytes per position. The weights are read once however many sequences share the step:
B decode tokens do B times the arithmetic for about the same bytes, so the intensity grows
with B until it crosses the machine's balance point and the step turns compute-bound.
"""

from __future__ import annotations

from engine.instruments.phases import ModelShape
from engine.lab.batched import Feed


def step_flops(shape: ModelShape, feeds: list[Feed]) -> int:
    tokens = sum(len(f.tokens) for f in feeds)
    attention = sum(shape.attention_flops(len(f.tokens), f.start) for f in feeds)
    return 2 * shape.matmul_params * tokens + 2 * shape.head_params * len(feeds) + attention


def step_bytes(shape: ModelShape, feeds: list[Feed], kv_token_bytes: int) -> int:
    return shape.streamed_weight_bytes + sum(kv_token_bytes * (f.start + 2 * len(f.tokens)) for f in feeds)
