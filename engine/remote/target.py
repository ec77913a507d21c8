"""Where a model is served and how to reach it: plain settings, importable without the HTTP
stack (the app builds one on its UI thread)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RemoteTarget:
    """Where the model is served and how to reach it."""

    url: str
    """The server's OpenAI-compatible base, e.g. http://host:8000/v1 (/v1 is added when missing)."""
    model: str | None = None
    """One of the server's models; None takes the first that /v1/models lists."""
    api_key_env: str | None = None
    """The environment variable that holds the API key (never the key itself)."""
    read_timeout_s: float = 120.0
    """How long the server may stay silent mid-answer before the turn fails."""
    connect_timeout_s: float = 10.0
