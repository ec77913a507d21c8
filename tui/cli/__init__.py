"""The `llmchat` command line: the app by default, plus headless `ask`, `bench` and
`conversations`. Nothing here imports Textual until the app starts."""

from __future__ import annotations

import atexit
import errno
import os
import sys
import threading

from tui.cli.main import app

try:  # imported now: at the memory limit's edge an import is what fails
    import resource
except ImportError:  # not on Windows
    resource = None

__all__ = ["app", "run"]


def _out_of_memory(error: BaseException | None) -> bool:
    """Python's MemoryError, an import that could not list its folder (ENOMEM), a library that could
    not map itself, or C++'s std::bad_alloc (torch's import registering its ops under a tight limit):
    which comes first varies run to run, and any of them may be the cause of the error raised."""
    while error is not None:
        if isinstance(error, MemoryError) or (isinstance(error, OSError) and error.errno == errno.ENOMEM):
            return True
        if "failed to map" in str(error) or "bad_alloc" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def _at_the_memory_limit(margin: int = 256 * 2**20) -> bool:
    """Within `margin` bytes of an address-space limit (`ulimit -v`): there an import can also fail
    as a SystemError or an error with no cause (CPython losing its MemoryError), not a bug to show."""
    if resource is None:
        return False
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    try:
        with open("/proc/self/statm", "rb") as statm:
            mapped = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except MemoryError:  # even this read
        return True
    except (OSError, ValueError):  # no /proc (macOS)
        return False
    return limit != resource.RLIM_INFINITY and limit - mapped < margin


def run() -> None:
    """The `llmchat` command. Once a command that loaded torch is done, the process ends
    without Python's teardown of torch's and transformers' modules, ~1 s on this project's CPU
    machine after the answer was shown (`ask`: 4.5 s wall, first byte at 3.4 s). Threads are
    joined and atexit handlers run as on any exit, and the exit status is the command's."""
    try:
        app()
        code: int | str | None = 0
    except SystemExit as e:
        code = e.code
    except Exception as e:  # `ulimit -v` below what even the imports need
        if not (_out_of_memory(e) or _at_the_memory_limit()):
            raise
        print("llmchat: not enough memory to start (raise the limit: ulimit -v)", file=sys.stderr)
        code = 1
    if "torch" not in sys.modules:
        sys.exit(code)
    if isinstance(code, str):  # sys.exit("message"): printed, status 1
        print(code, file=sys.stderr)
        code = 1
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # noqa: SLF001 (what sys.exit would run; os._exit below skips it)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`| head`): nothing more can reach it
            pass
    os._exit(code or 0)
