"""Handing back a weight file's pages must never change a weight, and never touch other memory."""

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.fast import pages


def test_released_file_pages_read_back_the_same_values(tmp_path):
    path = tmp_path / "w.safetensors"
    original = torch.randn(512, 1024)  # 2 MiB: many whole pages
    save_file({"w": original}, str(path))
    with safe_open(str(path), framework="pt") as f:
        mapped = f.get_tensor("w")
        mappings = pages.weight_file_mappings()
        dropped = pages.release(mapped, mappings)
        if not mappings:  # safetensors copied instead of mapping: nothing to hand back
            assert dropped == 0
        else:
            assert dropped > 0
        assert torch.equal(mapped, original)  # re-read from the file


def test_memory_that_is_not_a_weight_file_is_left_alone():
    heap = torch.randn(512, 1024)
    copy = heap.clone()
    assert pages.release(heap, pages.weight_file_mappings()) == 0
    assert torch.equal(heap, copy)


def _resident_kib(path) -> int:
    """This process's resident KiB of its mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            inside = fields[-1] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total


def test_an_owned_copy_of_a_mapped_weight_leaves_none_of_the_file_resident(tmp_path):
    """w8's float embedding was copied whole, and the file's 113 MB stayed resident beside the copy."""
    path = tmp_path / "w.safetensors"
    original = torch.randn(2048, 1024)  # 8 MiB
    save_file({"w": original}, str(path))
    with safe_open(str(path), framework="pt") as f:
        mapped = f.get_tensor("w")
        mappings = pages.weight_file_mappings()
        if not mappings:  # safetensors copied instead of mapping: nothing to hand back
            return
        copy = pages.owned_copy(mapped, mappings, block_bytes=1 << 20)
        assert torch.equal(copy, original)
        assert copy.data_ptr() != mapped.data_ptr()
        assert _resident_kib(path) < 512
        mapped.clone()  # what the fast path did before: the whole file read in
        assert _resident_kib(path) >= 8 * 1024 - 64
