"""One new token's attention over the KV cache, by a small C++ kernel built in the background.

At long contexts a decode step's attention reads the whole cache. torch's CPU attention (SDPA;
also written as matmuls, compiled, or as FlexAttention) reads it at well under half the speed
of a plain sum over the same bytes. `decode_attention.cpp` reads K and V once, in blocks spread
over the cores, and merges the blocks' softmaxes (flash-decoding): about as fast as that plain
sum (the measurements: BENCHMARKS.md, "ITL against context length").

It is compiled with the C++ compiler torch.compile needs anyway, once per machine, into
llmchat's cache directory, by the background job that compiles the decode step
(engine/fast/compiled.py). Until it is loaded, or where it cannot be built, SDPA does the same sum.
Its ops are declared here, not in the C++, so that job's child process can trace a step calling
them while the kernel is still building (`stand_in`).

torch's builder guards the directory with a `lock` file that only the build that made it
removes: a build killed mid-way (a closed terminal) left it, and every later build waited on it
forever. So a build first takes a lock of our own (`flock`, which the OS drops when its holder
dies); whoever holds that lock knows any `lock` file is stale and removes it. A build that
waits longer than LOCK_WAIT_S on a live one gives up with the reason, and SDPA serves.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import threading
import time
import warnings
from pathlib import Path
from typing import Iterator

import platformdirs
import torch

from engine.errors import one_line

try:
    import fcntl
except ImportError:  # not on Windows: no lock of ours there
    fcntl = None

FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]
"""-ffast-math lets the compiler vectorize exp and the reductions (BENCHMARKS.md)."""

SOURCE = Path(__file__).with_name("decode_attention.cpp")

LOCK_FILE = "llmchat-build.lock"
"""Our lock in the build directory: held (flock) by the process building, with its pid inside."""
LOCK_WAIT_S = 180.0
"""How long a build waits for another process's build of the kernel (~20 s) before giving up."""

_lock = threading.Lock()
_error: list[str] = []
_loaded = threading.Event()
_notes: list[str] = []
_standing_in = threading.Event()


SCHEMAS = {
    "decode_attention": "(Tensor q, Tensor k, Tensor v, Tensor position) -> Tensor",
    "decode_attention_int8": (
        "(Tensor q, Tensor k, Tensor ks, Tensor v, Tensor vs, Tensor position) -> Tensor"
    ),
}
"""The kernel's ops; the built library registers their CPU implementations."""


def _shape(q: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
    """The output as torch.compile traces it: [kv_heads, group, d], whatever the capacity."""
    return q.new_empty(q.shape)


# Declared here rather than in the C++ (2 ms): a step can then be traced before the kernel is built.
_LIBRARY = torch.library.Library("llmchat", "DEF")
for _name, _schema in SCHEMAS.items():
    _LIBRARY.define(_name + _schema)
    torch.library.register_fake(f"llmchat::{_name}", lib=_LIBRARY)(_shape)


class BuildBusy(Exception):
    """Another live process kept building the kernel for longer than we wait."""


def _build_directory() -> Path:
    """Per machine and torch version: the build is for this CPU's instructions (-march=native)."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0]
    except (OSError, IndexError):
        flags = ""
    source = SOURCE.read_bytes()  # a changed kernel builds anew, beside (not over) the old one
    key = hashlib.sha256(f"{flags}{torch.__version__}{FLAGS}".encode() + source).hexdigest()[:12]
    return Path(platformdirs.user_cache_dir("llmchat")) / "kernels" / key


def _put_ninja_on_path() -> None:
    """torch's extension builder runs `ninja` from PATH; the pip package's binary lies in the
    virtual environment, which need not be on PATH (`.venv/bin/llmchat`)."""
    if shutil.which("ninja") is None:
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def take_notes() -> list[str]:
    """What the builds so far met worth telling (a stale lock removed), each once."""
    with _lock:
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
                        f"the attention kernel's build waited {wait_s:.0f} s for another build "
                        f"(pid {holder}) and gave up"
                    ) from None
                time.sleep(0.1)
        lock.truncate(0)
        lock.write(str(os.getpid()))
        lock.flush()
        baton = directory / "lock"
        if baton.exists():
            baton.unlink(missing_ok=True)
            _notes.append("a killed kernel build had left a stale lock; removed it")
        yield  # the lock goes with the file's closing, or with this process


def load() -> str | None:
    """Build the kernel (or load the cached build) as torch.ops.llmchat.decode_attention;
    None once it is there, else why it is not (the caller keeps SDPA)."""
    with _lock:
        if _loaded.is_set() or _error:
            return _error[0] if _error else None
        try:
            from torch.utils.cpp_extension import load as load_extension

            _put_ninja_on_path()
            directory = _build_directory()
            directory.mkdir(parents=True, exist_ok=True)
            with _build_lock(directory, LOCK_WAIT_S), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                load_extension(
                    name="llmchat_decode_attention",
                    sources=[str(SOURCE)],
                    extra_cflags=FLAGS,
                    build_directory=str(directory),
                    is_python_module=False,
                )
        except BuildBusy as e:  # not remembered: the next load tries again
            return str(e)
        except Exception as e:  # no compiler or ninja: SDPA serves
            _error.append(one_line(e, 200, named=True))
            return _error[0]
        _loaded.set()
        return None


def stand_in() -> None:
    """For the compile child only (engine/fast/compiled.py), whose step's output nobody reads:
    the ops answer zeros instead of waiting for the kernel's build (~6 s of a fresh machine's
    first start, which the app runs meanwhile), so the step is traced as the app will trace
    it, calling the kernel, while that builds."""
    for name in SCHEMAS:
        torch.library.impl(_LIBRARY, name, "CPU")(_shape_zeros)
    _standing_in.set()


def _shape_zeros(q: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
    return q.new_zeros(q.shape)


KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8)
"""What the kernel reads as stored (int8 with its scales: `decode_int8`)."""


def is_loaded() -> bool:
    """The kernel is built and loaded (by the background compile job)."""
    return _loaded.is_set()


def can_attend(keys: torch.Tensor) -> bool:
    """Whether the kernel can attend over `keys` now (loaded, or stood in for; a cache on the
    CPU of a type it reads)."""
    there = _loaded.is_set() or _standing_in.is_set()
    return there and keys.device.type == "cpu" and keys.dtype in KERNEL_DTYPES


def decode(
    grouped: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor
) -> torch.Tensor:
    """One token's attention: `grouped` [1, kv_heads, group, d] holds its query heads, those
    sharing a K/V head together, over keys/values [1, kv_heads, positions, d] (the cache or
    views of it) at positions 0..position ([1] tensor); returns [1, kv_heads, group, d]."""
    out = torch.ops.llmchat.decode_attention(grouped[0].contiguous(), keys[0], values[0], position)
    return out[None]


def decode_int8(grouped: torch.Tensor, kv, position: torch.Tensor) -> torch.Tensor:
    """`decode` over an int8 cache (engine/kvcache.py QuantizedKV: values [1, kv_heads, n, d],
    scales [1, kv_heads, n]): the kernel where it is loaded, else `chunked_int8`."""
    if can_attend(kv.keys):
        out = torch.ops.llmchat.decode_attention_int8(
            grouped[0].contiguous(), kv.keys[0], kv.key_scales[0], kv.values[0], kv.value_scales[0], position
        )
        return out[None]
    return chunked_int8(grouped, kv, int(position))


CHUNK = 1024
"""Positions dequantized at a time by `chunked_int8`."""


def chunked_int8(grouped: torch.Tensor, kv, position: int, chunk: int = CHUNK) -> torch.Tensor:
    """The same sum in tensor ops, for where the kernel is not loaded (still building, no compiler,
    a GPU): CHUNK positions at a time are widened to float32 and folded into a running softmax
    (flash-decoding again), so at most one chunk's dequantized copy exists at once. It costs a
    write and a read of that copy per chunk, several small ops per chunk, and q·K as a batched
    matmul (bench: the int8 row says which path served)."""
    length = position + 1
    d = grouped.shape[-1]
    query = grouped.float() / d**0.5
    best = total = out = None
    for start in range(0, length, chunk):
        stop = min(length, start + chunk)
        keys = kv.keys[:, :, start:stop].float() * kv.key_scales[:, :, start:stop, None]
        scores = query @ keys.transpose(-1, -2)  # [1, kv_heads, group, n]
        peak = scores.amax(-1, keepdim=True)
        weights = torch.exp(scores - peak)
        values = kv.values[:, :, start:stop].float() * kv.value_scales[:, :, start:stop, None]
        part, mass = weights @ values, weights.sum(-1, keepdim=True)
        if best is None:
            best, total, out = peak, mass, part
            continue
        merged = torch.maximum(best, peak)
        old, new = torch.exp(best - merged), torch.exp(peak - merged)
        out, total, best = out * old + part * new, total * old + mass * new, merged
    return out / total
