"""Stopping `llmchat ask` from outside without losing the answer.

Ctrl+C (SIGINT), SIGTERM and a closed terminal (SIGHUP) stop the answer after the current
token: its part so far is saved, and the process exits with 128 + the signal (130, 143,
129). Ctrl+C while the answer is already stopping quits at once; a repeated SIGTERM or
SIGHUP changes nothing (the save takes milliseconds, and a closing terminal may send SIGHUP
twice).

A closed output stops the answer the same way: stdout whose reader has gone (`llmchat ask
... | head -c 20`: EPIPE) exits 141, what a shell reports for a process ended by SIGPIPE; a
terminal gone (EIO) or a full disk exits 1 unless a signal came first. The stream is then
pointed at /dev/null, so what is still to be said (the stats line, the save notice) goes
nowhere instead of failing.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
from types import FrameType
from typing import Callable, TextIO

STOP_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)
)
CLOSED_PIPE_EXIT = 128 + 13
"""128 + SIGPIPE: the exit code when stdout's reader has gone."""
WRITE_FAILED_EXIT = 1
_SIGNAL_REASONS = {signal.SIGINT: "interrupted"}
if hasattr(signal, "SIGHUP"):
    _SIGNAL_REASONS[signal.SIGHUP] = "stopped: the terminal closed (SIGHUP)"


class Stops:
    """Notes stop signals and a closed output, and keeps the exit code of the first.

    The caller cancels the answer when `code` is set (at the next event, so a stop that came
    before a turn began still ends it). A context manager: the handlers are installed inside
    the `with` block only; `write` works with or without them.
    """

    def __init__(self, on_stop: Callable[[], None] | None = None) -> None:
        self.code: int | None = None
        """The exit code, once something stopped the answer."""
        self.reason = ""
        """What stopped it, in words."""
        self.on_stop = on_stop
        """Called once, at the first stop (in the signal handler): an answer from a server cuts the
        call in flight at once (the stream, or the prompt's tokenizing), since a silent server sends
        no next event to stop at."""
        self._previous: dict[int, object] = {}

    def __enter__(self) -> Stops:
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.code is not None:
            raise KeyboardInterrupt  # Ctrl+C while already stopping: quit at once
        self.stop(128 + signum, _SIGNAL_REASONS.get(signum, f"stopped by {signal.Signals(signum).name}"))

    def stop(self, code: int, reason: str) -> None:
        """Ask for the answer to stop; the first cause decides the exit code."""
        if self.code is None:
            self.code, self.reason = code, reason
            if self.on_stop is not None:
                self.on_stop()

    def write(self, stream: TextIO, text: str) -> None:
        """Write and flush; if the stream's reader is gone, silence the stream and stop the answer."""
        try:
            stream.write(text)
            stream.flush()
        except OSError as e:  # BrokenPipeError (EPIPE), EIO after a hangup, ENOSPC
            _silence(stream)
            if e.errno == errno.EPIPE and stream is sys.stdout:
                self.stop(CLOSED_PIPE_EXIT, "stopped: the output was closed")
            else:
                self.stop(WRITE_FAILED_EXIT, f"stopped: cannot write to {_name(stream)} ({e.strerror or e})")


def _silence(stream: TextIO) -> None:
    """Point the stream's file descriptor at /dev/null: later writes, and the flush at exit, go nowhere."""
    try:
        descriptor = stream.fileno()
    except (OSError, ValueError):  # not a real file (a test's capture): nothing to redirect
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, descriptor)
    finally:
        os.close(devnull)


def _name(stream: TextIO) -> str:
    return {id(sys.stdout): "stdout", id(sys.stderr): "stderr"}.get(id(stream), "the output")
