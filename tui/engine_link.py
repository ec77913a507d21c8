"""How the app reaches the engine: the calls it makes, and starting the engine off the UI thread.

Importing the engine pulls in torch and transformers (seconds), so the app opens first
and imports them on a background thread.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

from engine.events import Event

if TYPE_CHECKING:
    from engine.remote.target import RemoteTarget
    from engine.sampling import SamplingSettings
    from engine.saved.store import Store

Emit = Callable[[Event], None]


class Engine(Protocol):
    """The part of `engine.worker.InferenceWorker` the app uses; tests inject a fake."""

    def load(self, spec: str, precision: str = "fp32", device: str = "auto") -> None: ...
    def connect(self, target: "RemoteTarget") -> None: ...
    def send(self, text: str) -> None: ...
    def regenerate(self) -> None: ...
    def edit(self, index: int, text: str) -> None: ...
    def resume(self, ref: int | str, use_cache: bool = True) -> None: ...
    def step_version(self, index: int, step: int) -> None: ...
    def new_chat(self, system_prompt: str | None = None) -> None: ...
    def cancel(self) -> None: ...
    def set_sampling(self, settings: "SamplingSettings") -> None: ...
    def shutdown(self, timeout: float = 5.0) -> None: ...


EngineFactory = Callable[[Emit, "SamplingSettings", "str | None", "int | None"], Engine]
"""(emit, sampling, system prompt, context limit) -> a started engine."""


def inference_worker(
    emit: Emit, sampling: "SamplingSettings", system: str | None, context: int | None
) -> Engine:
    """The real engine: one inference thread owning the model and the KV cache, saving turns to the store.

    A store that cannot be opened (corrupt, newer, locked, unwritable) is left alone: the chat
    runs without saving and says why.
    """
    from engine.worker import InferenceWorker

    store = open_store(emit)
    # `llmchat --no-compile` (or LLMCHAT_COMPILE=0) keeps the eager decode step.
    compile_decode = os.environ.get("LLMCHAT_COMPILE", "1") != "0"
    return InferenceWorker(emit, sampling, system, context, store=store, compile=compile_decode)


def open_store(emit: Emit) -> "Store | None":
    """The conversation store, or None after emitting a notice that says why not."""
    from engine.events import Notice
    from engine.saved.store import Store, StoreError

    try:
        return Store()
    except StoreError as e:
        emit(Notice(f"conversations are not being saved: {e}"))
        return None


def resolve_sampling(values: Mapping[str, Any]) -> tuple["SamplingSettings", str | None]:
    """Settings from config and flags; on a bad value, the defaults and the reason."""
    from engine.sampling import SamplingSettings

    try:
        return SamplingSettings(**values), None
    except (ValueError, TypeError) as e:
        return SamplingSettings(), f"sampling settings: {e}; using the defaults"
