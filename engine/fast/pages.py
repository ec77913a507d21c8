"""Hand back the pages of a memory-mapped weight file once its tensors have been copied.

transformers maps a safetensors file and hands out tensors that are views of the mapping; the
pages count toward the process's resident memory once read. The fast path copies every matrix
into a fused one, so without this the file's pages and the copies would be resident together
(the peak). The pages are private, clean and read-only here: dropping them (MADV_DONTNEED)
costs nothing but a re-read from the file if anything touches them again.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap

import torch

MADV_DONTNEED = 4  # Linux


def weight_file_mappings(suffix: str = ".safetensors") -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of weight files; empty where /proc is absent."""
    try:
        lines = open("/proc/self/maps").read().splitlines()
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


def release(tensor: torch.Tensor, mappings: list[tuple[int, int]]) -> int:
    """Drop the whole pages of `tensor` that lie in one of `mappings`; returns the bytes dropped."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return 0
    if not any(low <= start and end <= high for low, high in mappings):
        return 0
    page = mmap.PAGESIZE
    first, last = -(-start // page) * page, end // page * page
    if last <= first or _libc() is None:
        return 0
    if _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_DONTNEED) != 0:
        return 0
    return last - first


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


_LIBC: ctypes.CDLL | None = None


def _libc() -> ctypes.CDLL | None:
    global _LIBC
    if _LIBC is None:
        name = ctypes.util.find_library("c")
        _LIBC = ctypes.CDLL(name, use_errno=True) if name else None
    return _LIBC
