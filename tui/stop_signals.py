"""SIGTERM and a closed terminal (SIGHUP) end the app as Ctrl+Q does, so the answer in progress is saved.

Without handlers either signal kills the process at once and the partial answer with it.
The handler runs on the main thread between two bytecodes, so it only does what is safe
there: it leaves a terminal that is gone (later writes go to /dev/null instead of failing
and stopping Textual's writer thread) and calls back, and the callback schedules the quit.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import Callable

STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))
HANGUP_GRACE_S = 10.0
"""After a hangup, how long the quit may take once the engine has saved before the process ends itself."""


def catch_stop_signals(on_stop: Callable[[int, bool], None]) -> Callable[[], None]:
    """Call `on_stop(signum, hung_up)` on SIGTERM and SIGHUP (`hung_up`: the terminal is gone and was
    left); returns a function that puts the old handlers back.

    Off the main thread (an app embedded in another program's thread) nothing is installed.
    """
    previous = {}

    def handler(signum: int, frame: FrameType | None) -> None:
        on_stop(signum, signum == getattr(signal, "SIGHUP", None) and leave_terminal_if_gone())

    try:
        for signum in STOP_SIGNALS:
            previous[signum] = signal.signal(signum, handler)
    except ValueError:  # not the main thread
        pass

    def restore() -> None:
        for signum, old in previous.items():
            signal.signal(signum, old)

    return restore


def leave_terminal_if_gone() -> bool:
    """Point stdin, stdout and stderr at /dev/null if the terminal has hung up; say whether it had.

    A SIGHUP may also come from `kill` with the terminal still there: it is then restored on the
    way out as usual."""
    if not _hung_up(sys.__stderr__):
        return False
    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        for descriptor in (0, 1, 2):
            os.dup2(devnull, descriptor)
    finally:
        os.close(devnull)
    return True


def _hung_up(stream) -> bool:
    import errno
    import termios

    try:
        termios.tcgetattr(stream.fileno())
    except termios.error as e:
        return e.args[0] == errno.EIO  # what a hung-up terminal answers (not a terminal at all: ENOTTY)
    except (AttributeError, OSError, ValueError):  # no stream, or a closed one
        return False
    return False


def end_later(code: int, save: Callable[[], None] | None, grace_s: float = HANGUP_GRACE_S) -> None:
    """On a daemon thread: run `save`, give the quit `grace_s` to end the process, else end it with `code`.

    With the terminal gone, Textual can block on output its writer thread will never take (the
    thread stops at its first failed write, which can come before the SIGHUP handler runs)."""

    def run() -> None:
        if save is not None:
            save()
        time.sleep(grace_s)
        compiled = sys.modules.get("engine.fast.compiled")  # only if torch was ever loaded
        if compiled is not None:
            compiled.exit_if_compiling(code)  # stops a compiling child process too
        os._exit(code)

    threading.Thread(target=run, name="llmchat-end-after-hangup", daemon=True).start()
