"""w4 on CPU: 4-bit weights in blocks of 32, one scale each, float32 activations (llama.cpp's Q4_0).

Each row is cut into blocks of 32 weights along its input dimension; a block keeps one float16
scale d and 32 unsigned 4-bit values q, two to a byte:

    W[r, 32b + j] ≈ d[r, b] · (q[r, 32b + j] − 8),   q in 0..15

d is the block's largest |weight|, with its sign, over −8, so that weight lands on q = 0 and the
others round to the 16 levels around it (llama.cpp's `quantize_row_q4_0_ref`, to the bit). Byte
j of a block holds value j in its low half and value j + 16 in its high half, as Q4_0 packs
them; the scales are held beside the values rather than between blocks, so the torch forms
below read them without bit casts. 4.5 bits a weight: an eighth of fp32's bytes, and a decode
step reads every weight once.

The decode step's matvec kernel (engine/fast/matvec.cpp, `matvec_q4`) reads the packed bytes
and scales as stored and widens each block in registers: one token's row sums it in integers
against x rounded to 16 bits, as w8's rows are (an error a hundredth of the weights' own), 2 to
16 rows in float32; either is the dequantized matrix's product to that rounding (tests/test_w4.py).
Without the kernel each call widens the matrix first (`forward`): right everywhere, slow for one
token, and a prefill widens a block of rows at a time in the kernel's library where it is loaded.

Layers whose width is not a multiple of 32 stay as they are (float); so does the embedding
table, as w8 keeps it. The LM head is quantized like every other linear, as w8 does.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.fast import gemm, matvec, pages
from engine.quant.w8 import QuantizedLinear, product_dtype

BLOCK = 32
"""Weights per block, each block one scale (Q4_0's QK4_0)."""
WIDEN_ROWS = 4096
"""Rows quantized, or widened for a product, at once: a bound on the float temporaries."""


def quantize_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0 of `weight` [out, in] (in a multiple of 32): (q uint8 [out, in / 2], scale float16
    [out, in / 32]), a block of rows at a time."""
    parts = [_quantize_rows(rows) for rows in weight.detach().split(WIDEN_ROWS)]
    return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])


def _quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, width = weight.shape
    if width % BLOCK:
        raise ValueError(f"w4 needs a width that is a multiple of {BLOCK}, not {width}")
    blocks = weight.float().reshape(rows, width // BLOCK, BLOCK)
    largest = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))  # with its sign
    scale = largest / -8
    inverse = torch.where(scale == 0, 0.0, 1.0 / scale)
    q = (blocks * inverse + 8.5).floor_().clamp_(0, 15).to(torch.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)
    return packed.reshape(rows, width // 2), scale[..., 0].half()


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 matrix [out, in] that Q4_0 blocks (q, scale) stand for."""
    blocks = q.view(q.shape[0], -1, BLOCK // 2)
    values = torch.cat((blocks & 15, blocks >> 4), dim=-1).float() - 8
    return (values * scale.float()[..., None]).reshape(q.shape[0], -1)


class W4Linear(QuantizedLinear):
    """y = x @ W.T with W held as Q4_0 blocks: packed values `q` [out, in / 2] (uint8) and one
    float16 `scale` per block of 32, [out, in / 32]."""

    NAME = "w4"
    VALUES_PER_BYTE = 2
    quantize = staticmethod(quantize_blocks)

    def dequantized(self) -> torch.Tensor:
        """W in float32 [out, in], as the blocks stand for it (the reference's matrix)."""
        return dequantize(self.q, self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T with W widened to float32 a block of rows at a time: by the matvec kernel's
        library in one pass where it is loaded (~10x torch's ops), else by `dequantize`. A
        prefill (more rows than the rows kernel takes) multiplies in bfloat16 where the CPU has
        bf16 products, at twice float32's rate: x rounded to bf16 moves a product by ~0.3%,
        against the 4-bit weights' own ~7%."""
        widen = matvec.dequantize_q4 if matvec.can_multiply_now(self.q) else dequantize
        dtype = product_dtype(x)
        rows = x.to(dtype)
        parts = [
            gemm.linear(rows, widen(q, s).to(dtype)).to(x.dtype)
            for q, s in zip(self.q.split(WIDEN_ROWS), self.scale.split(WIDEN_ROWS))
        ]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def matvec(self, x: torch.Tensor) -> torch.Tensor:
        """forward for one row x [1, in], written for the compiled step where the matvec kernel
        is not there: the blocks are widened inside the multiply-and-sum loop."""
        return (x[:, None, :] * self.dequantized()[None].to(x.dtype)).sum(-1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, w4"


def quantize_linears(model: nn.Module) -> list[str]:
    """Replace every nn.Linear of `model` (the LM head too) with a W4Linear, handing back each
    float matrix's pages of the mapped weight file as soon as it is quantized. A linear with a
    bias, or whose width is not a multiple of 32, stays as it is; their names are returned."""
    mappings = pages.weight_file_mappings()
    kept = []
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            if child.bias is not None or child.in_features % BLOCK:
                kept.append(f"{parent_name}.{name}".lstrip("."))
                continue
            setattr(parent, name, W4Linear.from_linear(child))
            pages.release(child.weight.detach(), mappings)
    return kept
