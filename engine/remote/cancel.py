"""Esc for a remote answer: a `threading.Event` that also cuts the open stream when set.

Checking the flag between chunks is not enough: a server can be silent for seconds (a long
prefill, a queue) and the answer would not stop until it spoke. Setting this event shuts the
connection down at once, from the thread that pressed Esc; the server sees the client leave
and stops generating.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator


class CancelEvent(threading.Event):
    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.RLock()  # `set` may run in a signal handler on the thread inside `cutting`
        self._abort: Callable[[], None] | None = None

    def set(self) -> None:
        super().set()
        with self._lock:
            abort = self._abort
        if abort is not None:
            abort()

    @contextmanager
    def cutting(self, abort: Callable[[], None]) -> Iterator[None]:
        """While inside, setting the event calls `abort` (at once if it is already set)."""
        with self._lock:
            self._abort = abort
        if self.is_set():
            abort()
        try:
            yield
        finally:
            with self._lock:
                self._abort = None
