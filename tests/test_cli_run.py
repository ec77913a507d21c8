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
