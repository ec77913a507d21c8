"""The fast path's weights in huge pages (engine/fast/huge_pages.py): moved there in the background,
their values untouched, and left alone where it is turned off."""

import mmap
import platform
import sys
import types
import weakref
from pathlib import Path

import pytest
import torch

from engine.fast import fused, huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _collapse_works() -> bool:
    """Linux 6.1+ (MADV_COLLAPSE) with transparent huge pages not switched off."""
    if not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text():
        return False
    major, minor = (int(part) for part in platform.release().split(".")[:2])
    return (major, minor) >= (6, 1)


needs_collapse = pytest.mark.skipif(not _collapse_works(), reason="needs Linux 6.1+ with THP not 'never'")
ON_ADVICE_ONLY = THP.exists() and "[madvise]" in THP.read_text()
"""Whether memory gets huge pages only where advised: then a fresh tensor starts in 4 KiB pages."""


def huge_bytes(tensor: torch.Tensor) -> int:
    """The bytes /proc/self/smaps counts as anonymous huge pages in the mappings `tensor` spans
    (advice splits a mapping: the huge pages inside, the 4 KiB edges apart)."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if not fields[0].endswith(":"):  # a mapping's first line: its address range
            low, high = (int(x, 16) for x in fields[0].split("-"))
            inside = low < end and start < high
        elif inside and fields[0] == "AnonHugePages:":
            total += int(fields[1]) * 1024
    return total


def fresh_tensor(megabytes: int) -> torch.Tensor:
    """Random float32 values in a private mapping of their own, made here: in 4 KiB pages where THP
    waits for advice (torch's own allocation may reuse memory an earlier test advised)."""
    mapping = mmap.mmap(-1, megabytes << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=torch.float32).copy_(torch.randn(megabytes << 18))


def advice_recorded(monkeypatch) -> list[tuple]:
    """Every `madvise` call's arguments, recorded instead of made."""
    advised = []
    libc = types.SimpleNamespace(madvise=lambda *args: advised.append(args))
    monkeypatch.setattr(huge_pages, "libc", lambda: libc)
    return advised


@needs_collapse
def test_a_large_tensor_moves_into_huge_pages_with_its_values_unchanged():
    tensor = fresh_tensor(64)
    before = tensor.clone()
    assert huge_bytes(tensor) == 0 or not ON_ADVICE_ONLY
    settling = huge_pages.settle([tensor])
    assert settling is not None
    settling.join()
    assert huge_bytes(tensor) >= 60 << 20
    assert torch.equal(tensor, before)


def test_nothing_moves_where_it_is_turned_off_or_no_huge_page_fits(monkeypatch):
    advised = advice_recorded(monkeypatch)
    assert huge_pages.settle([torch.randn(1000)]) is None  # 4 KB: no whole 2 MiB page inside
    monkeypatch.setenv("LLMCHAT_HUGE_PAGES", "0")
    assert huge_pages.settle([torch.randn(16 << 20)]) is None
    assert advised == []


def test_only_whole_pages_inside_a_tensor_are_named():
    tensor = torch.empty(5 << 20, dtype=torch.uint8)
    assert huge_pages.whole_pages(tensor[: 1 << 20]) is None  # 1 MiB holds no whole huge page
    start, length = huge_pages.whole_pages(tensor)
    assert start % huge_pages.SIZE == 0 and length % huge_pages.SIZE == 0 and length >= 2 << 20
    assert tensor.data_ptr() <= start and start + length <= tensor.data_ptr() + tensor.numel()


def test_a_tensor_freed_before_its_turn_is_skipped(monkeypatch):
    """Its addresses may hold new memory by then: only a live tensor's pages are advised."""
    advised = advice_recorded(monkeypatch)
    kept, dropped = torch.empty(8 << 20, dtype=torch.uint8), torch.empty(8 << 20, dtype=torch.uint8)
    work = [(weakref.ref(t), huge_pages.whole_pages(t)) for t in (kept, dropped)]
    del dropped
    huge_pages._collapse(work)
    assert {args[0].value for args in advised} == {work[0][1][0]}


@needs_collapse
def test_the_real_models_lm_head_is_streamed_from_huge_pages(smollm2):
    fast = fused.for_model(smollm2.model)
    if fast.settling is not None:
        fast.settling.join()
    head = fast.lm_head
    assert huge_bytes(head) >= head.numel() * head.element_size() - 2 * huge_pages.SIZE
