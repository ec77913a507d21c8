"""Where a model is served and how to reach it: plain settings, importable without the HTTP
stack (the app builds one on its UI thread), and the checks that a URL and a timeout are ones a
client can use (the command line runs them before anything connects)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from urllib.parse import urlsplit

MAX_TIMEOUT_S = 86_400.0
"""A day: longer is no timeout at all, and past ~1e9 s the socket layer overflows."""


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


def url_problem(url: str) -> str | None:
    """Why `url` cannot be a server's base (a phrase that never repeats the URL, whose query may
    hold a key), or None. Python's URL parser drops tabs and line breaks and raises on bad ports,
    so the text is checked before it is parsed."""
    url = url.strip()
    if bad := next((c for c in url if not c.isprintable() or c.isspace()), None):
        kind = "a space" if bad == " " else f"a control character (U+{ord(bad):04X})"
        return f"the URL holds {kind}"
    if "?" in url or "#" in url:
        return (
            "a URL with a query (?…) or fragment (#…) is not a server's base; "
            "pass a key with --api-key-env VAR"
        )
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        return _parse_problem(str(e))
    if parts.scheme not in ("http", "https"):
        return "expected an http:// or https:// URL, e.g. http://host:8000/v1"
    if not parts.hostname:
        return "the URL names no host; expected http(s)://host:port/v1"
    if port == 0:
        return "the port must be a number from 1 to 65535, got 0"
    return None


def _parse_problem(error: str) -> str:
    """The URL parser's complaint (bad port, unclosed IPv6 bracket) as the user's fix."""
    if "IPv6" in error:
        return "an IPv6 host must be written whole in brackets, e.g. http://[::1]:8000/v1"
    return "the port must be a number from 1 to 65535"


def shown_url(url: str) -> str:
    """The URL as it may be shown and saved: no user:password, query or fragment (built from
    the text, so even a URL the parser refuses can be named)."""
    scheme, sep, rest = url.strip().partition("://")
    if not sep:
        scheme, rest = "", scheme
    rest = rest.split("?", 1)[0].split("#", 1)[0]
    netloc, slash, path = rest.partition("/")
    netloc = netloc.rpartition("@")[2]
    return f"{scheme}{sep}{netloc}{slash}{path}".rstrip("/")


def read_timeout_problem(seconds: float) -> str | None:
    """Why `seconds` cannot be the read timeout (0 would make the socket non-blocking), or None."""
    if not (math.isfinite(seconds) and 0 < seconds <= MAX_TIMEOUT_S):
        limit = f"{MAX_TIMEOUT_S:.0f}"
        return f"--read-timeout must be a number of seconds above 0 and at most {limit}, got {seconds}"
    return None


def target_problem(target: RemoteTarget) -> str | None:
    """The first of the target's settings no client can use, named by its flag, or None."""
    problem = url_problem(target.url)
    return f"--server: {problem}" if problem else read_timeout_problem(target.read_timeout_s)
