"""Esc for a remote answer: a `threading.Event` that also cuts the HTTP calls in flight when set.

Checking the flag between chunks is not enough: a server can be silent for seconds (a long
prefill, a queue, a slow /apply-template while the prompt is prepared, a chat request it took
and never answers) and the answer would not stop until it spoke. Setting this event shuts the
connections down at once, from the thread that pressed Esc; the server sees the client leave
and stops generating.
"""

from __future__ import annotations

import socket
import threading
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterator


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


class OpenConnections:
    """The sockets of an HTTP client, so that a stop can cut whatever call is in flight on them.

    `track` is an httpx2 request event hook: it asks httpcore2 (through the `trace` request
    extension) to report each connection it opens. Shutting a socket down, unlike closing it,
    wakes the thread blocked reading it; a cut idle keep-alive connection is dropped by the pool
    when next taken.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()  # `cut` may run in a signal handler on the thread in `_traced`
        self._sockets: weakref.WeakSet[socket.socket] = weakref.WeakSet()
        self._stop: threading.Event | None = None
        self._closed = False

    def track(self, request: Any) -> None:
        request.extensions["trace"] = self._traced

    def _traced(self, name: str, info: dict[str, Any]) -> None:
        if not name.endswith(("connect_tcp.complete", "start_tls.complete")):
            return
        stream = info.get("return_value")
        sock = stream.get_extra_info("socket") if stream is not None else None
        if not isinstance(sock, socket.socket):
            return
        with self._lock:  # ordered with `cut`: a socket opened after it sees the stop set
            self._sockets.add(sock)
            stopped = self._closed or (self._stop is not None and self._stop.is_set())
        if stopped:
            _shut(sock)

    def cut(self) -> None:
        """Shut down every connection now, from any thread: the calls on them fail at once."""
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            _shut(sock)

    def close(self) -> None:
        """Cut every connection, and each one opened from now on: the client is given up (a quit)."""
        with self._lock:
            self._closed = True
        self.cut()

    @contextmanager
    def cut_on(self, stop: CancelEvent) -> Iterator[None]:
        """While inside, setting `stop` cuts every connection, and any opened after it (a call that
        was starting as the stop came)."""
        with self._lock:
            self._stop = stop
        try:
            with stop.cutting(self.cut):
                yield
        finally:
            with self._lock:
                self._stop = None


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed (or handed over to TLS): nothing left to cut
