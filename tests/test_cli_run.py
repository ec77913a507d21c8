"""`llmchat` ends without Python's teardown of torch's modules (~1 s after the answer), and
nothing a normal exit does is lost: threads finish, atexit handlers run, output is flushed."""

import subprocess
import sys

SCRIPT = """
import atexit, sys, threading, time
import torch  # the teardown skipped is torch's
from tui import cli
atexit.register(lambda: print("atexit handler ran", flush=True))
def late():
    time.sleep(0.3)
    print("thread finished", flush=True)
threading.Thread(target=late).start()
sys.argv = ["llmchat", *sys.argv[1:]]
print("buffered, not flushed", end="")
cli.run()
print("never reached")
"""


def _llmchat(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True, timeout=120)


def test_a_command_ends_with_its_status_after_threads_atexit_and_buffered_output():
    done = _llmchat("conversations", "--help")
    assert done.returncode == 0, done.stderr
    for line in ("buffered, not flushed", "thread finished", "atexit handler ran", "conversations"):
        assert line in done.stdout
    assert "never reached" not in done.stdout
    refused = _llmchat("no-such-command")
    assert refused.returncode == 2 and "No such command" in refused.stderr
    assert "atexit handler ran" in refused.stdout


FAILING = """
import sys
from tui import cli
def app():
    raise RuntimeError(sys.argv[1])
cli.app = app
cli.run()
"""


def test_running_out_of_memory_in_cs_allocator_is_the_one_line_too():
    """Under `ulimit -v` 600 MiB, torch's import once failed in C++ (RuntimeError: std::bad_alloc),
    not with MemoryError: an 80-line traceback, typer's error printer failing in it too."""

    def run_failing(message: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-c", FAILING, message]
        return subprocess.run(command, capture_output=True, text=True, timeout=120)

    out_of_memory = run_failing("std::bad_alloc")
    assert out_of_memory.returncode == 1
    assert out_of_memory.stderr == "llmchat: not enough memory to start (raise the limit: ulimit -v)\n"
    a_real_bug = run_failing("shape mismatch")
    assert a_real_bug.returncode == 1 and "RuntimeError: shape mismatch" in a_real_bug.stderr
