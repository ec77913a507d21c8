"""What each kind of server accepts beyond the OpenAI fields, and what it reports.

One table, so the README's "which panel each server feeds" and the code say the same thing.
Fields a server does not know are never sent to it: a strict server rejects them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Dialect:
    kind: str
    sampling_fields: dict[str, str] = field(default_factory=dict)
    """Our setting -> the server's request field, for settings outside the OpenAI API."""
    top_k_off: int = 0
    """The top_k value that means 'keep all tokens' on this server."""
    reporting: dict[str, Any] = field(default_factory=dict)
    """Request fields that make the server report more (token ids, timings, cache hits)."""
    top_k_note: str = "as the server reports them (before or after its temperature: not documented)"
    """Which distribution the alternatives come from; short, it is the top-k panel's caption."""
    unreported: tuple[str, ...] = ()
    """What the panels cannot show from this server, and the server flag that would enable it."""
    fill_metrics: tuple[str, ...] = ()
    """/metrics gauges of the server-wide KV cache usage, newest name first."""
    fill_is_percent: bool = False
    """The gauge is 0..100 rather than 0..1."""
    fill_slots: bool = False
    """The fill is summed from llama.cpp's /slots instead (its /metrics has no gauge)."""
    tokenize: str | None = None
    """How to get the prompt's token ids: 'llama.cpp' (/apply-template + /tokenize), 'vllm'
    (/tokenize with messages), or None."""
    ignore_eos: bool = False
    """Takes `ignore_eos`, so a benchmark's every answer is exactly as long as asked."""


LLAMA_CPP = Dialect(
    kind="llama.cpp",
    sampling_fields={"top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repeat_penalty"},
    reporting={"timings_per_token": True, "return_progress": True},
    top_k_note="the model's own (T 1), before llama.cpp's samplers",
    unreported=(
        "the KV cache's element type: not in /props, so bytes per token assume llama-server's default f16",
    ),
    fill_slots=True,
    tokenize="llama.cpp",
    ignore_eos=True,
)

VLLM = Dialect(
    kind="vllm",
    sampling_fields={"top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty"},
    top_k_off=-1,
    reporting={"return_token_ids": True},
    top_k_note="raw, before vLLM's temperature and penalties (its default --logprobs-mode)",
    unreported=(
        "prompt tokens from the prefix cache: start vLLM with --enable-prompt-tokens-details",
        "more than 20 alternatives per token: start vLLM with --max-logprobs N",
        "server timings per request: vLLM does not put them in the stream (its /metrics has histograms)",
        "model shape (layers, KV heads): not exposed, so KV bytes per token are not computed",
        "prefill progress: not reported",
    ),
    fill_metrics=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    tokenize="vllm",
    ignore_eos=True,
)

SGLANG = Dialect(
    kind="sglang",
    sampling_fields={"top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty"},
    top_k_off=-1,
    reporting={"return_cached_tokens_details": True},
    unreported=(
        "cached prompt tokens and cache usage: start SGLang with --enable-cache-report --enable-metrics",
        "token ids: not sent in the stream (pieces shown without ids)",
        "model shape (layers, KV heads): not exposed, so KV bytes per token are not computed",
        "prefill progress: not reported",
    ),
    fill_metrics=("sglang:token_usage",),
    ignore_eos=True,
)

OLLAMA = Dialect(
    kind="ollama",
    unreported=(
        "top-k, min-p and repetition penalty: not accepted by Ollama's OpenAI API",
        "token ids, cached prompt tokens, server timings, cache usage: not in its OpenAI API",
        "model shape (layers, KV heads): not exposed, so KV bytes per token are not computed",
        "prefill progress: not reported",
    ),
)

GENERIC = Dialect(
    kind="openai-compatible",
    unreported=(
        "top-k, min-p and repetition penalty: not part of the OpenAI API",
        "token ids, server timings, cache usage, model shape, prefill progress: not reported",
    ),
)

BY_OWNER = {"llamacpp": LLAMA_CPP, "vllm": VLLM, "sglang": SGLANG}
"""/v1/models `owned_by` -> dialect."""

ALL = (LLAMA_CPP, VLLM, SGLANG, OLLAMA, GENERIC)
