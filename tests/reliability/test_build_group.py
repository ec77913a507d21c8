"""Issue 31: quitting during the kernels' C++ build ends the whole build. ninja, c++ and cc1plus ran
on ~5 s after Ctrl+Q, reparented to PID 1 and still writing into the build directory."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD_S = 240
"""Long enough for the build to reach its compiler on the 2-core machines (~5 s when idle)."""

QUIT = """
import json, os, sys, threading, time
from pathlib import Path
from engine.fast import compiled, kernels

COMPILERS = {"ninja", "c++", "cc1plus", "g++", "gcc", "clang++", "sleep"}

def below(pid):
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            pass
    found, level = [], children.get(pid, [])
    while level:
        found += level
        level = [c for p in level for c in children.get(p, [])]
    return found

def name(pid):
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""

compiled._build_in_background("step")
if sys.argv[1] == "compiling":  # the step's compile still runs: the app ends with os._exit
    compile_thread = threading.Thread(target=time.sleep, args=(600,), daemon=True)
    compile_thread.start()
    compiled._compiling.append(compile_thread)
deadline = time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    running = [p for p in below(os.getpid()) if name(p) in COMPILERS]
    if running:
        break
    time.sleep(0.05)
def group(pid):
    try:
        return os.getpgid(pid)
    except OSError:
        return os.getpgid(0)

groups = sorted({group(p) for p in running} | {os.getpgid(0)})
print(json.dumps({"compilers": [name(p) for p in running], "groups": groups}), flush=True)
compiled.exit_if_compiling(0)  # as tui/app.py's run_app does once the app has quit
"""


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of another user took the number
        return False
    return True


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """An empty cache directory: the kernel is built, not loaded from an earlier build."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache" / "inductor"))
    return tmp_path / "cache"


@pytest.mark.parametrize("when", ["compiling", "compiled"])
def test_quitting_during_the_kernel_build_leaves_no_build_process(private_cache, when):
    app = subprocess.Popen(
        [sys.executable, "-c", QUIT, when, str(BUILD_S)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a terminal's job: the app's own group
    )
    try:
        out, _ = app.communicate(timeout=BUILD_S + 60)
        seen = json.loads(out.strip().splitlines()[-1])
        assert seen["compilers"], "the build never reached its compiler"
        deadline = time.monotonic() + 3.0  # killed, then reaped by init
        while any(_group_alive(g) for g in seen["groups"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [g for g in seen["groups"] if _group_alive(g)]
        assert not left, f"the build's processes ran on after the quit: {seen}"
    finally:
        for group in {app.pid, *locals().get("seen", {}).get("groups", [])}:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGKILL)
        app.wait()


ORPHAN = """
import subprocess, sys
from engine.fast import child_sessions
# The child's imports take seconds before it asks who its parent is; this app has quit by then.
child = child_sessions.start(
    [sys.executable, "-c", "import time; time.sleep(2)\\n"
     "from engine.fast import child_sessions; child_sessions.end_with_parent(); time.sleep(120)"],
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
)
print(child.pid, flush=True)
"""


def test_a_child_whose_app_quit_before_it_started_watching_ends_too():
    # Quitting the app as the whole step's compile child started left that child compiling alone
    # for a minute: it asked for its parent's pid after its imports, and got PID 1's.
    app = subprocess.run([sys.executable, "-c", ORPHAN], cwd=ROOT, capture_output=True, text=True, timeout=60)
    child = int(app.stdout.split()[-1])
    deadline = time.monotonic() + 30
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = Path(f"/proc/{child}").exists()
    if alive:
        with contextlib.suppress(OSError):
            os.kill(child, signal.SIGKILL)
    assert not alive, "the child compiled on after its app had quit"
