"""Hand memory back while weights load: a weight file's pages once its tensors have been copied,
and the blocks freed along the way (`each_block_mapped`).

transformers maps a safetensors file and hands out tensors that are views of the mapping; the
pages count toward the process's resident memory once read. The fast path copies every matrix
into a fused one, so without this the file's pages and the copies would be resident together
(the peak). The pages are private, clean and read-only here: dropping them (MADV_DONTNEED)
costs nothing but a re-read from the file if anything touches them again.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import mmap
import os
import threading
from pathlib import Path
from typing import Iterator

import torch

MADV_DONTNEED = 4  # Linux


def weight_file_mappings(suffix: str = ".safetensors") -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of weight files; empty where /proc is absent."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    ranges = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].endswith(suffix):
            low, high = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((low, high))
    return ranges


def mapped(tensor: torch.Tensor, mappings: list[tuple[int, int]]) -> bool:
    """Whether `tensor`'s bytes lie in one of `mappings` (a view of a weight file)."""
    start = tensor.data_ptr()
    return any(low <= start < high for low, high in mappings)


def whole_pages(tensor: torch.Tensor, page: int = mmap.PAGESIZE) -> tuple[int, int] | None:
    """(start, length) of the pages of `page` bytes lying wholly inside a contiguous CPU tensor's
    bytes; None if none do."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first, last = -(-start // page) * page, end // page * page
    return (first, last - first) if last > first else None


def release(tensor: torch.Tensor, mappings: list[tuple[int, int]]) -> int:
    """Drop the whole pages of `tensor` that lie in one of `mappings`; returns the bytes dropped."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    if not any(low <= start and end <= high for low, high in mappings):
        return 0
    inside = whole_pages(tensor)
    if inside is None or libc() is None:
        return 0
    first, length = inside
    if libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(length), MADV_DONTNEED) != 0:
        return 0
    return length


def owned_copy(
    tensor: torch.Tensor, mappings: list[tuple[int, int]], block_bytes: int = 8 << 20
) -> torch.Tensor:
    """A copy of `tensor` in memory of its own. Where it is a view of a weight file, the copy is
    made a block of rows at a time, each block's pages handed back once copied, so the file's
    pages and the copy are never resident together (w8's float embedding: 113 MB)."""
    copy = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    if tensor.dim() == 0 or not tensor.is_contiguous() or not mapped(tensor, mappings):
        return copy.copy_(tensor)
    rows = max(1, block_bytes // max(1, tensor[0].numel() * tensor.element_size()))
    for start in range(0, tensor.shape[0], rows):
        copy[start : start + rows].copy_(tensor[start : start + rows])
        release(tensor[start : start + rows], mappings)
    return copy


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
"""glibc's `mallopt` parameters."""
LOADING_MMAP_THRESHOLD = 128 << 10
"""glibc's initial threshold: every block this large or larger is a mapping of its own."""
STEADY_MMAP_THRESHOLD, STEADY_TRIM_THRESHOLD = 32 << 20, 64 << 20
"""Where glibc's own adjustment takes them on a 64-bit system (its maximum, and twice that)."""

_loading = [0]
_loading_lock = threading.Lock()


@contextlib.contextmanager
def each_block_mapped() -> Iterator[None]:
    """While weights are read, narrowed and copied into fused matrices: each block of 128 KiB or
    more gets a mapping of its own, so a source freed after its copy goes back to the OS at once.

    glibc raises its threshold to the size of the first large block freed, and later blocks of up
    to that size come from the heap, which keeps what is freed: the fast path's peak at bf16 and
    w8 was 70-180 MiB higher, and varied from run to run by as much. Afterwards the thresholds are
    fixed where glibc's own adjustment takes them: a prefill whose temporaries were each mapped
    anew ran 2x slower. glibc only; elsewhere this does nothing."""
    with _loading_lock:
        _loading[0] += 1
        if _loading[0] == 1:
            _mallopt(M_MMAP_THRESHOLD, LOADING_MMAP_THRESHOLD)
    try:
        yield
    finally:
        with _loading_lock:
            _loading[0] -= 1
            if _loading[0] == 0:
                _mallopt(M_MMAP_THRESHOLD, STEADY_MMAP_THRESHOLD)
                _mallopt(M_TRIM_THRESHOLD, STEADY_TRIM_THRESHOLD)


def _mallopt(parameter: int, value: int) -> None:
    if _glibc() and libc() is not None:
        libc().mallopt(ctypes.c_int(parameter), ctypes.c_int(value))


def _glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (AttributeError, ValueError, OSError):
        return False


_LIBC: ctypes.CDLL | None = None


def libc() -> ctypes.CDLL | None:
    """The C library, for `madvise` and `mallopt`; None where it cannot be found."""
    global _LIBC
    if _LIBC is None:
        name = ctypes.util.find_library("c")
        _LIBC = ctypes.CDLL(name, use_errno=True) if name else None
    return _LIBC
