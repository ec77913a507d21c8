"""The one interface both kinds of session offer: engine/session.py `ChatSession` (weights here)
and engine/remote/session.py `RemoteSession` (a model on a server).

The worker, the saved chat and the UI hold a `Session` and ask `capabilities`
(engine/capabilities.py) before anything only one kind can do: step mode and forks, a
precision or a KV cache file. What a kind cannot do it still answers, with a `Failed` event.
"""

from __future__ import annotations

import threading
from typing import Iterator, Protocol

from engine.capabilities import Capabilities
from engine.conversation import Message
from engine.events import CacheChanged, Event, ModelInfo
from engine.instruments.trace import AnswerTrace
from engine.sampling import SamplingSettings


class Session(Protocol):
    """A conversation with one model: its turns yield events; the model is here or on a server."""

    capabilities: Capabilities
    """What this kind of session can do (engine/capabilities.py LOCAL or ON_SERVER)."""
    info: ModelInfo
    messages: list[Message]
    system_prompt: str | None
    sampling: SamplingSettings
    """Swapped whole (never mutated); each kind says from when a change applies."""
    cancel: threading.Event
    """Set to stop the answer in progress; the partial answer stays."""
    trace: AnswerTrace | None
    """The steps of the answer in progress, or of the last one (the token inspector reads them)."""

    @property
    def context(self) -> int | None:
        """The window a conversation must fit (None: a server that does not say)."""
        ...

    def send(self, text: str) -> Iterator[Event]: ...

    def regenerate(self) -> Iterator[Event]: ...

    def edit(self, index: int, text: str) -> Iterator[Event]: ...

    def fork(self, step: int, token_id: int, answer: int | None = None) -> Iterator[Event]:
        """Continue an answer from a chosen token (`capabilities.can_fork`; else one Failed)."""
        ...

    def answer(self) -> Iterator[Event]: ...

    def reset(self, system_prompt: str | None = None) -> None: ...

    def is_user_message(self, index: int) -> bool: ...

    def last_answer_index(self) -> int: ...

    def cache_event(self) -> CacheChanged: ...

    def sampled_ids(self, message: Message) -> list[int] | None:
        """The ids an answer was sampled as, where a follow-up's prompt holds them as they are."""
        ...
