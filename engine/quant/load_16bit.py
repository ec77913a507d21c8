"""Load float32 weights into 16-bit ones without holding both at once.

Asked for bf16 or fp16 from a float32 checkpoint (a converted GGUF is one), transformers reads
every tensor of the mapped file and converts it, so the file's pages and the 16-bit copies are
resident together: a 1,148 MiB peak for the built-in model's 257 MiB of bf16 weights. Loading
at float32 instead maps the file without copying; each tensor is then narrowed on its own and
its pages of the file handed back at once (engine/fast/pages.py), as w8 does when it quantizes.
The values are the same: one rounding from float32 either way.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from torch import nn

from engine.fast import pages


def stored_dtype(directory: str) -> str | None:
    """The safetensors dtype of a checkpoint's first tensor ('F32', 'BF16' …); None if unknown."""
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        return None
    try:
        with open(files[0], "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error):
        return None
    return next((entry["dtype"] for name, entry in header.items() if name != "__metadata__"), None)


def narrow(model: nn.Module, dtype: torch.dtype) -> None:
    """Every float32 parameter of `model` as `dtype`, one at a time; tied weights stay tied."""
    mappings = pages.weight_file_mappings()
    narrowed: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # the old one kept: its id stays its own
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.dtype != torch.float32:
                continue
            if id(param) not in narrowed:
                narrowed[id(param)] = (param, nn.Parameter(param.detach().to(dtype), requires_grad=False))
                pages.release(param.detach(), mappings)
            setattr(module, name, narrowed[id(param)][1])
    model.config.dtype = dtype
