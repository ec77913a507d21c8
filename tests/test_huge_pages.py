"""The fast path's weights in huge pages (engine/fast/huge_pages.py): moved there in the background,
their values untouched, and left alone where it is turned off."""

import platform
import sys
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


@needs_collapse
def test_a_large_tensor_moves_into_huge_pages_with_its_values_unchanged():
    tensor = torch.randn(16 << 20)  # 64 MiB: a mapping of its own
    before = tensor.clone()
    assert huge_bytes(tensor) == 0
    settling = huge_pages.settle([tensor])
    assert settling is not None
    settling.join()
    assert huge_bytes(tensor) >= 60 << 20
    assert torch.equal(tensor, before)


def test_nothing_moves_where_it_is_turned_off_or_no_huge_page_fits(monkeypatch):
    assert huge_pages.settle([torch.randn(1000)]) is None  # 4 KB: no whole 2 MiB page inside
    monkeypatch.setenv("LLMCHAT_HUGE_PAGES", "0")
    tensor = torch.randn(16 << 20)
    assert huge_pages.settle([tensor]) is None
    assert huge_bytes(tensor) == 0


def test_only_whole_pages_inside_a_tensor_are_named():
    tensor = torch.empty(5 << 20, dtype=torch.uint8)
    ranges = huge_pages.whole_pages([tensor, tensor[: 1 << 20]])
    assert len(ranges) == 1  # the 1 MiB view holds no whole huge page
    start, length = ranges[0]
    assert start % huge_pages.SIZE == 0 and length % huge_pages.SIZE == 0
    assert tensor.data_ptr() <= start and start + length <= tensor.data_ptr() + tensor.numel()


@needs_collapse
def test_the_real_models_lm_head_is_streamed_from_huge_pages(smollm2):
    fast = fused.for_model(smollm2.model)
    if fast.settling is not None:
        fast.settling.join()
    head = fast.lm_head
    assert huge_bytes(head) >= head.numel() * head.element_size() - 2 * huge_pages.SIZE
