"""x @ W.T in float32 on a CPU through oneDNN, not torch's default BLAS.

torch hands float32 CPU matmuls to MKL, which on AMD CPUs runs its AVX2 kernels: half of
what a CPU with AVX-512 can do. oneDNN (built into torch's x86 wheels; Inductor calls this same
op) picks its kernels by the CPU's features, not its vendor. Measured on this project's Zen 5
machine (scripts/gemm.py): ~2x at every row count from 1 to 512, so prefill, a speculative
verify and the eager step all gain. 16-bit matmuls already go to oneDNN; they are left alone.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


@functools.cache
def onednn_works() -> bool:
    """oneDNN's linear is in this torch build and gives x @ W.T (probed once, on a tiny case)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        x, w = torch.arange(24.0).view(3, 8) / 7, torch.arange(40.0).view(5, 8) / 11  # no RNG used
        out = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")  # noqa: SLF001 (no public name)
        return torch.allclose(out, F.linear(x, w), rtol=1e-5)
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ weight.T for weight [out, in] (any strides: a transposed view works)."""
    if x.dtype == weight.dtype == torch.float32 and x.device.type == "cpu" and onednn_works():
        rows = x.reshape(-1, x.shape[-1])
        out = torch.ops.mkldnn._linear_pointwise(rows, weight, None, "none", [], "")  # noqa: SLF001
        return out.reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight)


WIDEN_ROWS = 4096
"""Rows of a weight widened at once by `widened`."""


def widened(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T for a narrower weight [out, in] (16-bit, int8), widened to x's dtype a block
    of rows at a time: SmolLM2's LM head widened whole is a 113 MB temporary, the peak of a
    16-bit prefill's or a w8 answer's memory."""
    blocks = [linear(x, rows.to(x.dtype)) for rows in weight.split(WIDEN_ROWS)]
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=-1)
