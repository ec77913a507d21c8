"""A decode step's matrix-vector products by a small C++ kernel, where the CPU has AVX-512 or AVX2.

A batch-1 decode step reads every weight once per token. Inductor's loop for x @ W.T
(`FastLlama._matvec`) keeps one chain of additions per row and widens both operands at every
step: on a CPU whose cores are slow beside its memory it is compute-bound. On a 2-core AVX-512
Xeon it streamed bfloat16 rows at ~12 GB/s and float32 at ~17, where `matvec.cpp` streams them
at ~23-25 and ~26-28 (a plain read: ~24-30; BENCHMARKS.md). On a CPU with AVX2 but not AVX-512
(an AMD EPYC VM), the kernel's portable loop, vectorized by the compiler for the CPU's own
instructions, beat Inductor's by far where the rows are narrow: int8 rows ~10x, bfloat16 ~2x,
float32 ~1.4x (scripts/matvec_cost.py; BENCHMARKS.md); int8 rows summed in integers by
`vpmaddwd` then read at float32's rate (~97% of its GB/s, where the portable loop made ~64%).
w4's Q4_0 blocks (engine/quant/w4.py) go through an op of their own, `multiply_q4`: each block
widened in registers and summed in integers against x rounded to 16 bits, as w8's rows are.
The kernel is built with the step's other kernel, the decode attention (engine/fast/kernels.py),
and the step is traced calling it.
On older CPUs the step keeps Inductor's loop, which vectorizes for whatever the CPU has.
"""

from __future__ import annotations

import torch

from engine.fast import kernels

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8)
"""The weights the kernel multiplies as stored (int8: w8's rows, times a float32 x, which the
kernel rounds to 16 bits where the CPU has AVX512-VNNI or AVX2: engine/quant/w8.py)."""

enabled = torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX2")
"""Whether compiled steps use the kernel: where the CPU has AVX-512 or AVX2 (a benchmark may turn
it off to compare; `steps.saved_path` keys a saved step by it)."""


MAX_ROWS = 16
"""Rows of x the kernel multiplies at once, each weight row read once for all of them."""


@kernels.shaped("matvec")
def _shape(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


@kernels.shaped("matvec_q4")
def _shape_q4(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], q.shape[0]))


@kernels.shaped("dequantize_q4")
def _shape_dequantized(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.new_empty((q.shape[0], q.shape[1] * 2), dtype=torch.float32)


def _streams(weight: torch.Tensor) -> bool:
    """A weight the kernel multiplies: [out, in] rows, contiguous, on the CPU, of a type it reads
    (uint8: w4's packed 4-bit values, `multiply_q4`)."""
    usable = weight.device.type == "cpu" and weight.dtype in DTYPES + (torch.uint8,) and weight.dim() == 2
    return enabled and usable and weight.is_contiguous()


def can_multiply(weight: torch.Tensor) -> bool:
    """Whether a step traced now multiplies by `weight` in the kernel (loaded, or stood in for
    in the compile child: `kernels.stand_in`)."""
    return _streams(weight) and kernels.step_kernel_there()


def can_multiply_now(weight: torch.Tensor) -> bool:
    """Whether an eager step can multiply by `weight` in the kernel: it is loaded here."""
    return _streams(weight) and kernels.is_loaded("step")


def steps_use_kernel(fast) -> bool:
    """Whether `fast`'s compiled steps multiply in the kernel (the CPU has AVX-512 and its
    matrices are stored [out, in])."""
    return enabled and fast.embed.device.type == "cpu" and not fast.transposed


def multiply(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [n, in] @ weight.T, [n, out]: one row in weight's dtype (float32 for int8 rows); 2 to
    MAX_ROWS rows in float32 whatever weight's dtype, or in weight's own 16-bit dtype (a verify's
    tokens, the lab's batch: each weight row is read once for all of them)."""
    return torch.ops.llmchat.matvec(x.contiguous(), weight)


def multiply_q4(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [n, in] (float32, n up to MAX_ROWS) @ W.T, [n, out] in float32, for W held as w4's Q4_0
    blocks (engine/quant/w4.py): packed values q [out, in / 2], float16 scales [out, in / 32]."""
    return torch.ops.llmchat.matvec_q4(x.contiguous(), q, scale)


def dequantize_q4(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 matrix [out, in] w4's Q4_0 blocks stand for, widened in one pass (a prefill's)."""
    return torch.ops.llmchat.dequantize_q4(q, scale)
