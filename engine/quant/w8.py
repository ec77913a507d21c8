"""w8 on CPU: int8 weights with one scale per row, float32 activations (weight-only int8).

    W ≈ scale[:, None] · Q,  Q in [-127, 127]    so    x @ W.T = (x @ Q.T) · scale

A batch-1 decode step reads every weight once, so one byte per weight instead of four is the
whole game. No torch kernel multiplies float32 activations by int8 weights quickly on a CPU
(`_weight_int8pack_mm` is slower than widening: docs/benchmarks-history.md), but the decode step's matvec
does: llmchat's kernel where the CPU has AVX-512 (engine/fast/matvec.py), else a loop Inductor
generates that widens Q as it reads it (engine/fast/fused.py); that makes w8 the fastest
decode here. Without them (an eager step before the kernel is built, or --no-compile on a CPU
without AVX-512) each call widens the whole matrix first: fine for a prefill chunk, slow for
a single token, slower than fp32.

Only the weights are rounded, so the top-k stays close to fp32's (w8a8 rounds the activations
too, and that is where its drift comes from: engine/quant/int8.py). The decode step's matvec
kernel, where the CPU has AVX512-VNNI, sums the rows in integers against x rounded to 16 bits
over its largest value (engine/fast/matvec.cpp): an error a hundredth of the weights' own, which
leaves SmolLM2's top-1 agreement and KL against fp32 unchanged to four decimals.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.cpu_features import cpu_matmul_native
from engine.fast import gemm, matvec, pages
from engine.quant.int8 import quantize_rows


def product_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a quantized linear multiplies x in: bfloat16 for a prefill's rows on a CPU with
    bf16 products (AVX512-BF16, AMX: twice float32's rate), else float32. One token, a verify or
    the lab's batch (no more rows than the rows kernel takes) stay exact in its float32 (or its
    16-bit integers); so does every forward elsewhere."""
    rows = x.numel() // x.shape[-1]
    native = rows > matvec.MAX_ROWS and x.device.type == "cpu" and cpu_matmul_native(torch.bfloat16)
    return torch.bfloat16 if native else torch.float32


class QuantizedLinear(nn.Module):
    """y = x @ W.T with W held quantized row by row: the buffers `q` [out, ...] and `scale`
    [out, ...], as w8 and w4 each lay them out."""

    NAME = ""
    VALUES_PER_BYTE = 1
    """Weights packed in one byte of `q`."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = q.shape[0], q.shape[1] * self.VALUES_PER_BYTE
        self.register_buffer("q", q)
        self.register_buffer("scale", scale)

    @staticmethod
    def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "QuantizedLinear":
        if linear.bias is not None:
            raise ValueError(f"{cls.NAME} covers linear layers without bias")
        return cls(*cls.quantize(linear.weight))

    @classmethod
    def fuse(cls, modules: list["QuantizedLinear"]) -> "QuantizedLinear":
        """One matrix with the modules' rows stacked; each module's buffers become views of it."""
        fused = cls(torch.cat([m.q for m in modules]), torch.cat([m.scale for m in modules]))
        start = 0
        for module in modules:
            rows = slice(start, start + module.out_features)
            module.q, module.scale = fused.q[rows], fused.scale[rows]
            start = rows.stop
        return fused


class W8Linear(QuantizedLinear):
    """y = x @ W.T with W held as int8 rows `q` [out, in] and their float32 `scale` [out]."""

    NAME = "w8"
    quantize = staticmethod(quantize_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T, Q widened a block of rows at a time: to float32, or for a prefill to bfloat16
        where the CPU multiplies it natively (`product_dtype`; Q's integers are exact in bf16,
        x rounded to it moves a product by ~0.3%)."""
        dtype = product_dtype(x)
        return gemm.widened(x.to(dtype), self.q).to(x.dtype) * self.scale

    def matvec(self, x: torch.Tensor) -> torch.Tensor:
        """forward for one row x [1, in], written for the compiled step: Q is widened inside
        the multiply-and-sum loop, so each weight is read as one byte."""
        return (x[:, None, :] * self.q[None].to(x.dtype)).sum(-1) * self.scale

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, w8"


def quantize_linears(model: nn.Module) -> None:
    """Replace every nn.Linear of `model` (the LM head too) with a W8Linear, handing back each
    float matrix's pages of the mapped weight file as soon as it is quantized (engine/fast/pages.py).
    A linear with a bias (Qwen2's q/k/v: a few percent of the weights) stays as it is."""
    mappings = pages.weight_file_mappings()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.bias is None:
                setattr(parent, name, W8Linear.from_linear(child))
                pages.release(child.weight.detach(), mappings)
