"""The server-wide KV cache usage, read from a Prometheus /metrics page.

vLLM exports `vllm:kv_cache_usage_perc` (0..1; `vllm:gpu_cache_usage_perc` before v0.10) and
SGLang `sglang:token_usage` (0..1, with --enable-metrics). A data-parallel server has one
series per engine: their mean is the fill of the server as a whole.
"""

from __future__ import annotations

import math

from engine.remote.client import RemoteClient, RemoteError
from engine.remote.dialects import Dialect


def gauge(text: str, name: str) -> float | None:
    """The mean of the series named `name` (any labels) in a Prometheus text page."""
    values = []
    for line in text.splitlines():
        if not line.startswith(name) or line[len(name) : len(name) + 1] not in ("{", " "):
            continue
        try:
            value = float(line.rsplit(None, 1)[-1])
        except ValueError:
            continue
        if math.isfinite(value):
            values.append(value)
    return sum(values) / len(values) if values else None


def cache_fill(client: RemoteClient, dialect: Dialect) -> tuple[float | None, str]:
    """(fraction of the server's KV cache in use, the metric it came from), or (None, '')."""
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
