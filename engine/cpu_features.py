"""What this CPU's instructions can do, read once from /proc/cpuinfo (no torch needed): the
precisions' notes, the fast path's prefill and w4's prefill ask it."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@functools.cache
def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(f.read().split())
    except OSError:
        return set()


def cpu_matmul_native(dtype: torch.dtype | str) -> bool:
    """Whether this CPU has matmul instructions for 16-bit `dtype` (AVX-512 or AMX)."""
    wanted = {"bfloat16": ("avx512_bf16", "amx_bf16"), "float16": ("avx512_fp16", "amx_fp16")}
    return any(flag in _cpu_flags() for flag in wanted.get(str(dtype).removeprefix("torch."), ()))
