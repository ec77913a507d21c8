"""RMSNorm for the fast path: the step library's kernel (engine/fast/rms_norm.cpp) where an eager
forward on a CPU runs it, torch's everywhere else.

torch's `rms_norm` on a CPU is six ops dispatched one by one (~36 us for one 576-wide row on a
Zen 1); an eager step runs it twice a layer, and so do a speculative verify and the lab's batched
forward. Inside a compiled step torch's stays: Inductor fuses it into the loops around it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.fast import kernels


def in_kernel(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel normalizes x: not while torch.compile traces (checked first, so the trace
    sees a constant), float32 on a CPU, contiguous, with the step's kernels loaded."""
    return (
        not torch.compiler.is_compiling()
        and x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and x.is_contiguous()
        and kernels.is_loaded("step")
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., d] / sqrt(mean(x²) + eps) * weight."""
    if in_kernel(x, weight):
        return torch.ops.llmchat.rms_norm(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)
