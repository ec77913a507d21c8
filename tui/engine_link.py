"""How the app reaches the engine: the calls it makes, and starting the engine off the UI thread.

Importing the engine pulls in torch and transformers (seconds), so the app opens first
and imports them on a background thread.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Protocol, TypeVar

from engine.events import Event
from engine.instruments.view import SessionView

if TYPE_CHECKING:
    from engine.remote.target import RemoteTarget
    from engine.sampling import SamplingSettings
    from engine.saved.store import Store
    from engine.session import ChatSession

Emit = Callable[[Event], None]
T = TypeVar("T")


class Engine(Protocol):
    """The part of `engine.worker.InferenceWorker` the app uses; tests inject a fake."""

    @property
    def session(self) -> SessionView | None:
        """What the UI thread may read of the running session; None until a model has loaded."""

    def load(
        self,
        spec: str,
        precision: str = "fp32",
        device: str = "auto",
        raw: bool = False,
        chat_template: str | None = None,
        thinking: bool | None = None,
    ) -> None: ...
    def connect(self, target: "RemoteTarget") -> None: ...
    def send(self, text: str) -> None: ...
    def regenerate(self) -> None: ...
    def edit(self, index: int, text: str) -> None: ...
    def resume(self, ref: int | str, use_cache: bool = True) -> None: ...
    def step_version(self, index: int, step: int) -> None: ...
    def new_chat(self, system_prompt: str | None = None) -> None: ...
    def cancel(self) -> None: ...
    def set_sampling(self, settings: "SamplingSettings", chosen: Iterable[str] = ()) -> None: ...
    def set_speculation(self, choice: str | None, k: int = 4) -> None: ...
    def set_cache_precision(self, precision: str) -> None: ...
    def shutdown(self, timeout: float = 5.0) -> None: ...

    # -- the instruments -----------------------------------------------------------
    def fork(self, step: int, token_id: int, answer: int | None = None) -> None: ...
    def call(self, fn: Callable[[ChatSession], T]) -> Future[T]:
        """Queue `fn(session)` for the inference thread: the way the app runs the model."""

    def call_at_gate(self, fn: Callable[[ChatSession], T]) -> T:
        """Run `fn(session)` now, while a step waits at the step gate (the inference thread is blocked)."""


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
        store = Store()
    except StoreError as e:
        emit(Notice(f"conversations are not being saved: {e}"))
        return None
    if store.damaged:  # never written again; `llmchat conversations` can still read it
        emit(Notice(f"conversations are not being saved: {store.damaged}"))
        store.close()
        return None
    return store


def resolve_sampling(values: Mapping[str, Any]) -> tuple["SamplingSettings", str | None, list[str]]:
    """Settings from config and flags; a bad value is dropped alone (its default used) and named.
    Also the fields set (a model's own defaults take the others)."""
    import dataclasses

    from engine.sampling import SamplingSettings

    defaults = settings = SamplingSettings()
    problems, chosen = [], []
    for name, value in values.items():
        if name not in SamplingSettings.names():
            problems.append(f"{name} is not a sampling setting")
            continue
        try:
            settings = dataclasses.replace(settings, **{name: value})
        except (ValueError, TypeError) as e:
            problems.append(f"{e}: using the default {getattr(defaults, name)}")
            continue
        chosen.append(name)
    return settings, "; ".join(problems) or None, chosen
