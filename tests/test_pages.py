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
