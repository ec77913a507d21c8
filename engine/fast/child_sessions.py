"""Child processes that build (the kernels' C++ build, the decode step's compile), each the leader
of a session of its own, so that ending one ends everything it started.

Killing the child alone left its work running: after Ctrl+Q during a kernel build, ninja, c++ and
cc1plus ran on, reparented to PID 1. Its process group is not enough either: ninja starts each
compiler in a group of its own. A session holds them all (none of them starts another), so the
whole session is killed, found by its id in /proc. A child also ends its session when the app
is gone without saying so (SIGKILL): `end_with_parent`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

END_WAIT_S = 2.0
"""How long `end` keeps killing what is left of a session (a process forking as it is killed)."""
PARENT_POLL_S = 0.1
"""How often a child looks whether the app that started it is still there."""
PARENT_ENV = "LLMCHAT_PARENT_PID"
"""The app's pid, told to each child: the one it must outlive no longer than a poll."""


def start(command: list[str], **popen: object) -> subprocess.Popen:
    """`command` as a child in a session of its own. Not preexec_fn: the session is made by the
    fork's C code, with no Python at-fork hooks (which waited on another thread's logging lock)."""
    env = popen.pop("env", None)
    env = {**(os.environ if env is None else env), PARENT_ENV: str(os.getpid())}
    return subprocess.Popen(command, start_new_session=True, env=env, **popen)


def end(child: subprocess.Popen) -> None:
    """Kill the child and everything in its session, then reap it: no process left, no zombie."""
    if child.poll() is None:  # not reaped yet: its pid, and so its session's id, is still its own
        kill_session(child.pid)
    child.kill()
    child.wait()


def kill_session(session: int) -> None:
    """SIGKILL every live process of `session` but this one (where there is no /proc: its leader's
    group only)."""
    if session != os.getsid(0):
        with contextlib.suppress(OSError):
            os.killpg(session, signal.SIGKILL)  # the leader's group first: nothing new is started
    deadline = time.monotonic() + END_WAIT_S
    while time.monotonic() < deadline:
        left = [pid for pid in _members(session) if pid != os.getpid()]
        if not left:
            return
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


def _members(session: int) -> list[int]:
    """The live (not zombie) processes of `session`, from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if fields[0] != "Z" and int(fields[3]) == session:  # state, ppid, pgrp, session
                found.append(int(stat.parent.name))
    return found


def end_with_parent() -> None:
    """In a child `start` made: end this whole session once the app that started it is gone.
    The app's pid comes from `start`: a child asks after its imports (seconds), and one whose app
    had quit meanwhile saw PID 1 as its parent, waited for that to change, and compiled on alone."""
    parent = int(os.environ.get(PARENT_ENV) or os.getppid())

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        kill_session(os.getsid(0))
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="llmchat-end-with-parent", daemon=True).start()
