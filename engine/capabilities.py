"""What a kind of session can do, declared once per kind.

The local engine (engine/session.py) holds the weights, the KV cache and the decode loop; a
session with a model on a server (engine/remote/session.py) holds only the conversation. Each
kind declares a `Capabilities` record, as harlequin's adapters declare `implements_copy`, and
the worker and the UI ask it (`session.capabilities`, `ModelInfo.capabilities`) instead of
asking which class a session is or whether it has some attribute.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Capabilities:
    has_weights: bool
    """The weights and the KV cache are in this process: a precision and a KV cache precision can
    be chosen, and the instruments that read weights, cache or decode loop work."""
    can_step: bool
    """Step mode: each drawn token waits at the session's `step_gate` for the caller's choice."""
    can_fork: bool
    """An answer can continue from a token chosen at one of its steps."""
    can_speculate: bool
    """Speculative decoding (engine/speculative/) can replace the plain decode loop."""
    saves_cache: bool
    """The KV cache can be written to a file and loaded on resume (engine/saved/chat.py)."""

    @property
    def on_server(self) -> bool:
        """The model answers from a server: the session's `client` holds the connections."""
        return not self.has_weights


LOCAL = Capabilities(has_weights=True, can_step=True, can_fork=True, can_speculate=True, saves_cache=True)
"""engine/session.py ChatSession: everything runs here."""

ON_SERVER = Capabilities(
    has_weights=False, can_step=False, can_fork=False, can_speculate=False, saves_cache=False
)
"""engine/remote/session.py RemoteSession: the server keeps the weights, the cache and the loop."""
