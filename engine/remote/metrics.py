"""The server-wide KV cache usage, read from a Prometheus /metrics page.

vLLM exports `vllm:kv_cache_usage_perc` (0..1; `vllm:gpu_cache_usage_perc` before v0.10) and
SGLang `sglang:token_usage` (0..1, with --enable-metrics). A data-parallel server has one
series per engine: their mean is the fill of the server as a whole.

llama.cpp's /metrics has no such gauge, but its /slots lists each slot's context (`n_ctx`) and,
once a slot has served a request, `n_prompt_tokens`: the length of the token sequence whose K/V
that slot holds (`prompt.tokens.size()` in tools/server/server-context.cpp, kept after the
request for the next one's prefix). Their sum over the sum of `n_ctx` is the fill.
"""

from __future__ import annotations

import math
from typing import Iterable

from engine.remote.client import RemoteClient, RemoteError
from engine.remote.dialects import Dialect


def gauge(text: str, name: str) -> float | None:
    """The mean of the series named `name` (any labels) in a Prometheus text page, read by the
    Prometheus project's parser; None where the page has none, or is no Prometheus page."""
    values = (series(text, (name,)) or {}).get(name)
    return sum(values) / len(values) if values else None


def series(text: str, names: Iterable[str]) -> dict[str, list[float]] | None:
    """The finite values of each of `names` in a Prometheus text page, one per series (any labels:
    a data-parallel server has one per engine), the page parsed once; a name the page lacks is
    absent, and None means the text is no Prometheus page."""
    from prometheus_client.parser import text_string_to_metric_families  # ~0.1 s: only when asked

    wanted = set(names)
    found: dict[str, list[float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in wanted and math.isfinite(sample.value):
                    found.setdefault(sample.name, []).append(sample.value)
    except Exception:  # the parser's errors are many kinds (ValueError, IndexError, ...): not a page
        return None
    return found


def slots_fill(slots: object) -> tuple[float | None, str]:
    """llama.cpp's /slots: (tokens held in all slots / their total context, what it was summed from)."""
    if not isinstance(slots, list) or not slots:
        return None, ""
    held = capacity = 0
    for slot in slots:
        n_ctx = slot.get("n_ctx") if isinstance(slot, dict) else None
        if not isinstance(n_ctx, int) or n_ctx <= 0:
            return None, ""
        capacity += n_ctx
        tokens = slot.get("n_prompt_tokens", 0)  # absent until the slot has served a request
        held += tokens if isinstance(tokens, int) and tokens > 0 else 0
    count = f"{len(slots)} slot{'s' if len(slots) != 1 else ''}"
    return held / capacity, f"/slots: {held:,} tokens held / {capacity:,} in {count}"


def cache_fill(client: RemoteClient, dialect: Dialect) -> tuple[float | None, str]:
    """(fraction of the server's KV cache in use, the metric it came from), or (None, '')."""
    if dialect.fill_slots:
        try:
            return slots_fill(client.get_json("/slots"))
        except RemoteError:
            return None, ""
    if not dialect.fill_metrics:
        return None, ""
    try:
        text = client.get_text("/metrics")
    except RemoteError:
        return None, ""
    for name in dialect.fill_metrics:
        value = gauge(text, name)
        if value is not None:
            return (value / 100 if dialect.fill_is_percent else value), name
    return None, ""


def counters(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Each of `names` the page has, summed over its series (a counter per engine sums to the
    server's); empty for a page that is no Prometheus page."""
    return {name: sum(values) for name, values in (series(text, names) or {}).items()}
