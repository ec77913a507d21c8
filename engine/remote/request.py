"""One chat request: the conversation, the sampling settings, and the fields that make the
server report what the panels show.

Every setting is sent explicitly, also at its 'off' value: servers have their own defaults
(llama-server samples with top-k 40, top-p 0.95, min-p 0.05), and a setting here must mean the
same on every server. Settings a server does not accept are not sent; `unsupported` names them.
"""

from __future__ import annotations

from typing import Any

from engine.remote.dialects import Dialect
from engine.sampling import SamplingSettings

OFF = {"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
"""Our settings outside the OpenAI API, at the value that turns them off."""

TOP_LOGPROBS_CAP = 20
"""The OpenAI API's limit on top_logprobs; vLLM's default --max-logprobs is also 20."""


def chat_request(
    model: str,
    messages: list[dict[str, str]],
    settings: SamplingSettings,
    dialect: Dialect,
    top_k_shown: int,
) -> dict[str, Any]:
    """Keyword arguments for `openai.chat.completions.create`."""
    request: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "stream": True,
        "logprobs": True,
        "top_logprobs": max(1, min(top_k_shown, TOP_LOGPROBS_CAP)),
        "stream_options": {"include_usage": True},
        "temperature": settings.temperature,
        "top_p": settings.top_p,
        "max_tokens": settings.max_new_tokens,
    }
    if settings.seed is not None:
        request["seed"] = settings.seed
    extra = dict(dialect.reporting)
    for name, wire in dialect.sampling_fields.items():
        value = getattr(settings, name)
        extra[wire] = dialect.top_k_off if name == "top_k" and value == 0 else value
    if extra:
        request["extra_body"] = extra
    return request


def unsupported(settings: SamplingSettings, dialect: Dialect) -> list[str]:
    """Settings in use (not at their 'off' value) that this server does not accept."""
    return [
        name
        for name, off in OFF.items()
        if name not in dialect.sampling_fields and getattr(settings, name) != off
    ]
