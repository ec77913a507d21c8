"""Nothing stuck: a kernel build killed mid-way, a build that waits on a live one, a compile child past
its time limit and a precision switch each leave no process waiting, compiling or unreaped."""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from engine import bench, models
from engine.events import ModelReady, TokenSampled
from engine.fast import child_sessions, compiled, kernels, steps
from engine.sampling import SamplingSettings
from engine.session import ChatSession
from engine.worker import InferenceWorker

ROOT = Path(__file__).resolve().parents[2]
HANG_S = 300
"""Only a process that waits forever gets here: a kernel build takes ~20 s on the 2-core machines."""

BUILD = """
import json, sys
from engine.fast import kernels
if len(sys.argv) > 1:
    kernels.LOCK_WAIT_S = float(sys.argv[1])
problem = kernels.load("step")
print(json.dumps({"problem": problem, "notes": kernels.take_notes()}), flush=True)
"""


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """llmchat's cache directory (kernels, Inductor's artifacts) in a fresh temporary directory."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache" / "inductor"))
    return tmp_path / "cache"


def _build(*args: str) -> subprocess.Popen:
    """A process that builds the kernels, in its own process group (as a terminal's job)."""
    return subprocess.Popen(
        [sys.executable, "-c", BUILD, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _finish(process: subprocess.Popen, timeout: float) -> dict:
    """The build's result; fails the test if it is still waiting after `timeout`."""
    try:
        out, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        pytest.fail(f"the kernel build was still waiting after {timeout:.0f} s")
    return json.loads(out.strip().splitlines()[-1])


def _kill_at_once(process: subprocess.Popen) -> None:
    """SIGKILL a process building the kernels, and its build child's session (ninja, the compilers)
    first: a build child told its parent had died ends in order and removes torch's lock file."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if parent == process.pid:
            child_sessions.kill_session(int(stat.parent.name))
    os.killpg(process.pid, signal.SIGKILL)


def _wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"no {what} after {timeout:.0f} s"
        time.sleep(0.05)


def _batons(cache: Path) -> list[Path]:
    """torch's lock files (FileBaton) in the kernel build directories."""
    return list((cache / "llmchat" / "kernels").glob("*/lock"))


def test_a_build_after_a_build_killed_midway_finishes(private_cache):
    killed = _build()
    _wait_for(lambda: _batons(private_cache), HANG_S, "kernel build started")
    time.sleep(1.0)  # the compiler is running
    assert _batons(private_cache), "the build ended before it could be killed"
    _kill_at_once(killed)  # the build and its compiler die, with no time to clean up
    killed.communicate()
    assert _batons(private_cache)  # torch's lock file stays behind: the next build waited on it forever

    result = _finish(_build(), HANG_S)
    assert result["problem"] is None  # a compiler and ninja are here: the kernel builds
    assert any("stale" in note for note in result["notes"]), result
    assert not _batons(private_cache)


def test_a_build_waiting_on_a_live_build_gives_up_with_a_reason(private_cache):
    holder = _build()
    _wait_for(lambda: _batons(private_cache), HANG_S, "kernel build started")
    os.killpg(holder.pid, signal.SIGSTOP)  # alive but going nowhere (Ctrl+Z on a first start)
    try:
        result = _finish(_build("1"), 120)
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        os.killpg(holder.pid, signal.SIGCONT)
        holder.communicate()
    problem = result["problem"]
    assert problem is not None and "gave up" in problem and f"pid {holder.pid}" in problem, result
    assert "\n" not in problem


def test_a_stale_lock_is_named_in_the_compile_notice_and_eager_serves(
    tiny_model_dir, private_cache, monkeypatch
):
    directory = kernels._build_directory("step")  # under the private cache
    directory.mkdir(parents=True)
    (directory / "lock").touch()  # as a build killed mid-way leaves it
    # As on a first start: the app builds the kernel (an earlier test may have loaded it here).
    monkeypatch.setattr(kernels, "_loaded", {name: threading.Event() for name in kernels.KERNELS})
    monkeypatch.setattr(kernels, "_error", {})
    # The child process compiles and saves the step for real; the app meets the lock, then loads it.
    settings = SamplingSettings(temperature=0.0, max_new_tokens=4)
    session = ChatSession(models.load(str(tiny_model_dir), "fp32", "cpu"), settings, compile=True)
    try:
        finished = threading.Event()
        session.compiled.when_done(lambda c: finished.set())
        answer = [e for e in session.send("How does inference work?") if isinstance(e, TokenSampled)]
        assert len(answer) == 4  # eager answers meanwhile
        assert finished.wait(HANG_S), "the compile still waits on the stale lock"
        note = session.compiled.describe()
        assert "stale" in note and "\n" not in note, note
        assert session.compiled.ready.is_set(), note
        assert not (directory / "lock").exists()
    finally:
        getattr(session.compiled, "stop", lambda: None)()
        compiled._stop_children()


def test_a_compile_child_past_its_time_limit_is_killed_and_reaped(monkeypatch):
    monkeypatch.setattr(compiled, "CHILD_TIMEOUT_S", 1)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    monkeypatch.setattr(compiled, "_child_command", lambda *args: sleeper)
    children: list[subprocess.Popen] = []
    timed_out = compiled._compile_in_a_subprocess("model", "fp32", "regional", torch.float32, children.append)
    assert len(children) == 1
    assert children[0].returncode is not None  # waited for: no zombie left
    assert not Path(f"/proc/{children[0].pid}").exists()
    assert timed_out


def test_a_failure_after_the_child_started_kills_and_reaps_it(monkeypatch):
    # The hook that runs once the child exists raised (an import racing another thread's): the
    # compile thread died, and the child, when it finished, was left a zombie.
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    monkeypatch.setattr(compiled, "_child_command", lambda *args: sleeper)
    children: list[subprocess.Popen] = []

    def started(child: subprocess.Popen) -> None:
        children.append(child)
        raise ImportError("cannot import name 'compile_fx' (a partially initialized module)")

    with pytest.raises(ImportError):
        compiled._compile_in_a_subprocess("model", "fp32", "regional", torch.float32, started)
    assert children[0].returncode is not None  # killed and waited for
    assert not Path(f"/proc/{children[0].pid}").exists()


def test_a_compile_thread_that_fails_says_why_instead_of_compiling_for_good(tiny_model_dir, monkeypatch):
    # The app showed "compiling 1:20…" with no compile thread left: nothing would ever end it.
    from engine.fast import fused

    def broken(self):
        raise RuntimeError("an error nobody expected")

    monkeypatch.setattr(compiled.CompiledDecode, "_build_steps", broken)
    loaded = models.load(str(tiny_model_dir), "fp32", "cpu")
    fast = fused.for_model(loaded.model, compiled=True)
    compile = compiled.CompiledDecode(fast, torch.float32)
    heard: list[compiled.CompiledDecode] = []
    compile.when_done(heard.append)  # the app's listener: the chat and the Phase panel
    assert compile.wait_settled(30)
    assert heard == [compile] and not compile.ready.is_set()
    assert "the compile thread failed: RuntimeError: an error nobody expected" in compile.describe()


def test_the_compile_child_starts_while_another_thread_is_inside_logging(monkeypatch):
    # The child was started with preexec_fn, which runs Python's at-fork hooks in the forking
    # thread; logging's waits for logging's lock. With the kernel build importing setuptools on
    # another thread (inside logging.getLogger) the start hung for good: a clean CI run, Python 3.11.2.
    import logging

    quick = [
        sys.executable,
        "-c",
        "import os, sys, time; time.sleep(0.5); sys.exit(os.nice(0))",
    ]
    monkeypatch.setattr(compiled, "_child_command", lambda *args: quick)
    inside, leave = threading.Event(), threading.Event()

    def hold_logging() -> None:
        with logging._lock:
            inside.set()
            leave.wait(60)

    threading.Thread(target=hold_logging, daemon=True).start()
    assert inside.wait(10)
    started = time.monotonic()
    children: list[subprocess.Popen] = []
    try:
        timed_out = compiled._compile_in_a_subprocess(
            "model", "fp32", "regional", torch.float32, children.append
        )
    finally:
        leave.set()
    assert time.monotonic() - started < 30, "the child's start waited for another thread's lock"
    assert children[0].returncode == 19 and not timed_out  # still the lowest priority


def _compile_children() -> list[int]:
    """This process's live (not zombie) children running `python -m engine.fast.compiled`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            state, parent = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            command = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue
        if int(parent) == os.getpid() and state != "Z" and b"engine.fast.compiled" in command:
            found.append(int(entry.name))
    return found


def test_switching_precision_stops_the_previous_compile(tiny_model_dir, private_cache):
    events: queue.Queue = queue.Queue()
    worker = InferenceWorker(events.put, compile=True)
    left: list[compiled.CompiledDecode] = []
    seen: set[int] = set()
    try:
        for precision in ["fp32", "bf16", "w8", "fp32"]:
            if worker.session is not None:
                left.append(worker.session.compiled)
            worker.load(str(tiny_model_dir), precision, "cpu")
            _wait_for(lambda: isinstance(events.get(timeout=60), ModelReady), 120, "model ready")
            # the new compile's child has started (the one before it still compiles, if not stopped)
            _wait_for(lambda: set(_compile_children()) - seen, 60, "new compile child")
            seen.update(_compile_children())
        _wait_for(lambda: len(_compile_children()) <= 1, 30, "single compile child")
        for old in left:
            old._thread.join(60)  # abandoned: no in-process compile after its child was killed
            assert not old._thread.is_alive() and not old.ready.is_set()
    finally:
        getattr(worker.session.compiled, "stop", lambda: None)()
        compiled._stop_children()
        worker.shutdown()


def test_bench_does_not_wait_out_a_failed_compile(tiny_model_dir, monkeypatch):
    def broken(*args):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(steps, "compile_here", broken)
    monkeypatch.setattr(steps, "saved_path", lambda *args: None)  # nothing saved by an earlier test
    monkeypatch.setattr(compiled, "_compile_in_a_subprocess", lambda *args: False)
    monkeypatch.setattr(kernels, "load", lambda name: "no compiler")
    loaded = models.load(str(tiny_model_dir), "fp32", "cpu")
    result: list[dict] = []
    thread = threading.Thread(target=lambda: result.append(bench.compile_decode(loaded)), daemon=True)
    thread.start()
    thread.join(120)  # it waited 900 s for a `ready` that a failed compile never sets
    assert result and result[0]["compiled"] is False
    assert "no C++ compiler found" in result[0]["note"]


def test_an_empty_inductor_cache_variable_keeps_the_artifacts_out_of_the_working_directory(tmp_path):
    # TORCHINDUCTOR_CACHE_DIR set but empty: Inductor wrote its cache into the working directory
    # (a user's project folder filled with fxgraph/, aotautograd/ and hashes).
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": "", "PYTHONPATH": str(ROOT)}
    code = "import os, engine.fast.compiled; print(os.environ['TORCHINDUCTOR_CACHE_DIR'])"
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith(os.path.join("llmchat", "inductor"))
