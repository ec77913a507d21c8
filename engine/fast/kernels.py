"""llmchat's C++ kernels, built once per machine in the background and loaded as torch ops.

- "step", what a compiled decode step calls (`decode_step.cpp`, one library): one new token's
  attention over the KV cache (`decode_attention.cpp`, engine/fast/attention.py) and its
  matrix-vector products (`matvec.cpp`, engine/fast/matvec.py).
- "sampling": a step's draw and what the panels show of it, in one pass over the logits
  (`sample_summary.cpp`, engine/sampling.py).

They are compiled with the C++ compiler torch.compile needs anyway, once per machine, into
llmchat's cache directory, by the background job that compiles the decode step
(engine/fast/compiled.py); `ask`, which compiles nothing, loads a finished build only
(`load_built`). Until they are loaded, or where they cannot be built, torch's own ops do the
same sums. The ops are declared here, not in the C++, so that job's child process
can trace a step calling them while the kernels are still building (`stand_in`).

torch's builder guards the directory with a `lock` file that only the build that made it
removes: a build killed mid-way (a closed terminal) left it, and every later build waited on it
forever. So a build first takes a lock of our own (`flock`, which the OS drops when its holder
dies); whoever holds that lock knows any `lock` file is stale and removes it. A build that
waits longer than LOCK_WAIT_S on a live one gives up with the reason, and torch's ops serve.

The build itself (torch's builder, ninja, the compilers) runs in a child process, in a session of
its own (engine/fast/child_sessions.py): quitting the app mid-build ends all of it (`stop_builds`),
where a build on a thread of the app's left ninja and cc1plus running after it.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Callable, Iterator

import platformdirs
import torch

from engine.errors import one_line
from engine.fast import child_sessions

try:
    import fcntl
except ImportError:  # not on Windows: no lock of ours there
    fcntl = None

FLAGS = [
    "-O3",
    "-march=native",
    "-fopenmp",
    "-ffast-math",
    *os.environ.get("LLMCHAT_KERNEL_CFLAGS", "").split(),
]
"""-ffast-math lets the compiler vectorize exp and the reductions (docs/benchmarks-history.md).
LLMCHAT_KERNEL_CFLAGS adds flags: `-mno-avx512f` builds (beside the usual build) and tests the
AVX2 kernels on an AVX-512 CPU (scripts/test_avx2_kernels.sh)."""

_HERE = Path(__file__).parent
KERNELS = {"step": _HERE / "decode_step.cpp", "sampling": _HERE / "sample_summary.cpp"}
"""Each kernel's source, built into a library of its own: the app loads the step's before the
compiled step, and builds sampling's after that step is ready (engine/fast/compiled.py)."""

SOURCES = sorted(_HERE.glob("*.cpp"))
"""Every C++ source, included ones too; with the headers, a change to any builds each kernel anew."""
HEADERS = sorted(_HERE.glob("*.h"))

LOCK_FILE = "llmchat-build.lock"
"""Our lock in the build directory: held (flock) by the process building, with its pid inside."""
LOCK_WAIT_S = 180.0
"""How long a build waits for another process's build of a kernel (~20 s) before giving up."""

SCHEMAS = {
    "decode_attention": "(Tensor q, Tensor k, Tensor v, Tensor first, Tensor position) -> Tensor",
    "decode_attention_int8": (
        "(Tensor q, Tensor k, Tensor ks, Tensor v, Tensor vs, Tensor first, Tensor position) -> Tensor"
    ),
    "matvec": "(Tensor x, Tensor w) -> Tensor",
    "matvec_q4": "(Tensor x, Tensor q, Tensor scale) -> Tensor",
    "dequantize_q4": "(Tensor q, Tensor scale) -> Tensor",
    "rms_norm": "(Tensor x, Tensor weight, float eps) -> Tensor",
    "sample_summary": "(Tensor logits, float scale, int chosen, float? u, int k) -> Tensor",
}
"""The kernels' ops; the built library registers their CPU implementations."""

# Declared here rather than in the C++ (2 ms): a step can then be traced before the kernels are built.
LIBRARY = torch.library.Library("llmchat", "DEF")
for _name, _schema in SCHEMAS.items():
    LIBRARY.define(_name + _schema)

_locks = {name: threading.Lock() for name in KERNELS}
_error: dict[str, str] = {}
_loaded = {name: threading.Event() for name in KERNELS}
_notes_lock = threading.Lock()
_notes: list[str] = []


class BuildBusy(Exception):
    """The build did not finish through no fault of its own: another live process held it for
    longer than we wait, or it was stopped. Not remembered: the next load tries again."""


class BuildFailed(Exception):
    """The build's child process failed; the message is its one-line reason."""


def _build_directory(name: str) -> Path:
    """Per kernel, machine and torch version: the build is for this CPU's instructions (-march=native)."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0]
    except (OSError, IndexError):
        flags = ""
    key = hashlib.sha256(f"{name}{flags}{torch.__version__}{FLAGS}".encode())
    for source in SOURCES + HEADERS:  # a changed kernel builds anew, beside (not over) the old one
        key.update(source.read_bytes())
    return Path(platformdirs.user_cache_dir("llmchat")) / "kernels" / key.hexdigest()[:12]


def _put_ninja_on_path() -> None:
    """torch's extension builder runs `ninja` from PATH; the pip package's binary lies in the
    virtual environment, which need not be on PATH (`.venv/bin/llmchat`)."""
    if shutil.which("ninja") is None:
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def take_notes() -> list[str]:
    """What the builds so far met worth telling (a stale lock removed), each once."""
    with _notes_lock:
        notes, _notes[:] = list(_notes), []
        return notes


@contextlib.contextmanager
def _build_lock(directory: Path, wait_s: float) -> Iterator[None]:
    """Hold our lock on the build directory (raises BuildBusy after `wait_s`); with it held, a
    `lock` file of torch's is one a killed build left, and is removed."""
    if fcntl is None:
        yield
        return
    with open(directory / LOCK_FILE, "a+") as lock:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    lock.seek(0)
                    holder = lock.read().strip() or "?"
                    raise BuildBusy(
                        f"the kernel's build waited {wait_s:.0f} s for another build "
                        f"(pid {holder}) and gave up"
                    ) from None
                time.sleep(0.1)
        lock.truncate(0)
        lock.write(str(os.getpid()))
        lock.flush()
        baton = directory / "lock"
        if baton.exists():
            baton.unlink(missing_ok=True)
            with _notes_lock:
                _notes.append("a killed kernel build had left a stale lock; removed it")
        yield  # the lock goes with the file's closing, or with this process


def load(name: str) -> str | None:
    """Build the kernel `name` (or load the cached build) as its torch.ops.llmchat ops; None once
    they are there, else why they are not (the callers keep torch's ops)."""
    with _locks[name]:
        if _loaded[name].is_set() or name in _error:
            return _error.get(name)
        if _load_built(name):
            return None
        try:
            directory = _build_directory(name)
            directory.mkdir(parents=True, exist_ok=True)
            with _build_lock(directory, LOCK_WAIT_S):
                _build_in_a_child(name, directory)
            torch.ops.load_library(str(directory / f"llmchat_{name}.so"))
        except BuildBusy as e:  # not remembered: the next load tries again
            return str(e)
        except BuildFailed as e:
            _error[name] = str(e)
            return _error[name]
        except Exception as e:  # no compiler or ninja: torch's ops serve
            _error[name] = one_line(e, 200, named=True)
            return _error[name]
        _loaded[name].set()
        return None


_builds: list[subprocess.Popen] = []
"""The build child processes running now."""
_BUILD_CHILD = "import sys; from engine.fast import kernels; kernels.build_here(sys.argv[1], sys.argv[2])"


def _build_in_a_child(name: str, directory: Path) -> None:
    """Build the kernel `name` into `directory` in a child process (`build_here`), and wait for it;
    raises BuildFailed with its reason."""
    child = child_sessions.start(
        [sys.executable, "-c", _BUILD_CHILD, name, str(directory)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    _builds.append(child)
    try:
        out, _ = child.communicate()
    finally:
        _builds.remove(child)
    _raise_unless_built(child.returncode, out)


def _raise_unless_built(returncode: int, out: str) -> None:
    """Raise BuildBusy or BuildFailed, with the reason the child printed, unless it exited 0."""
    if returncode < 0:  # stopped by a signal (the app quitting, a test ending): not the build's fault
        raise BuildBusy(f"the kernel's build was stopped (signal {-returncode})")
    if returncode != 0:
        lines = out.strip().splitlines()
        raise BuildFailed(lines[-1] if lines else f"the kernel's build ended with status {returncode}")


def build_here(name: str, directory: str) -> None:
    """The build's child process: build the kernel `name` with torch's builder, or print why not
    (one line) and exit 1. The app holds the build directory's lock meanwhile."""
    child_sessions.end_with_parent()
    try:
        from torch.utils.cpp_extension import load as load_extension

        _put_ninja_on_path()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load_extension(
                name=f"llmchat_{name}",
                sources=[str(KERNELS[name])],
                extra_cflags=FLAGS,
                build_directory=directory,
                is_python_module=False,
            )
    except Exception as e:
        print(one_line(e, 200, named=True), flush=True)
        sys.exit(1)


@atexit.register
def stop_builds() -> None:
    """End every build running now, with all it started (ninja, the compilers): the app is quitting."""
    for child in list(_builds):
        child_sessions.end(child)


def load_built(name: str) -> bool:
    """Load the kernel `name` only where an earlier run built it for these sources (a dlopen,
    under a millisecond, where the build itself takes seconds of both cores): for a one-shot
    command such as `ask`. False where it is not built, or is being built now."""
    with _locks[name]:
        return _loaded[name].is_set() or (name not in _error and _load_built(name))


def _load_built(name: str) -> bool:
    """`load_built` for a caller holding the kernel's lock. The build directory is named by the
    sources, flags, CPU and torch, so a library in it is this build; one a live build holds is
    left alone (it may be half written), and one that cannot be loaded is built again by `load`."""
    directory = _build_directory(name)
    library = directory / f"llmchat_{name}.so"
    if not library.is_file():
        return False
    try:
        with _build_lock(directory, wait_s=0.0):
            torch.ops.load_library(str(library))
    except (BuildBusy, OSError, RuntimeError):
        return False
    _loaded[name].set()
    return True


def is_loaded(name: str) -> bool:
    """The kernel `name` is built and loaded (by the background compile job, or `load_built`)."""
    return _loaded[name].is_set()


_shapes: dict[str, Callable] = {}
"""The step's ops, each with its output shape as a function of its inputs (`shaped`)."""
_standing_in = threading.Event()


def shaped(op: str):
    """Declare how `op`, one of the step's ops, shapes its output (a function of its inputs, as
    `register_fake` takes it): torch.compile traces the op by it, and `stand_in` answers zeros
    of that shape."""

    def register(shape):
        _shapes[op] = shape
        return torch.library.register_fake(f"llmchat::{op}", lib=LIBRARY)(shape)

    return register


def stand_in() -> None:
    """For the compile child only (engine/fast/compiled.py), whose step's output nobody reads:
    the step's ops answer zeros instead of waiting for the kernel's build (~6 s of a fresh
    machine's first start, which the app runs meanwhile), so the step is traced as the app
    will trace it, calling the kernel, while that builds."""
    for op, shape in _shapes.items():
        torch.library.impl(LIBRARY, op, "CPU")(lambda *args, shape=shape: shape(*args).zero_())
    _standing_in.set()


def step_kernel_there() -> bool:
    """The step's kernel is loaded here, or stood in for (`stand_in`): a step traced now calls it."""
    return _loaded["step"].is_set() or _standing_in.is_set()
