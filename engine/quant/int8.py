"""w8a8 on CPU: int8 weights and int8 activations through torch's own fbgemm kernels.

Each weight row gets one scale (symmetric, per output channel):  W ≈ s_row · Q,  Q in [-127, 127].
At each call fbgemm quantizes the input to 8 bits over its own range (dynamic: no calibration),
multiplies in integers and scales the result back to float32:

    y = x @ W.T  ≈  (s_x · (x_q − z_x)) @ (s_row · Q).T

Batch-1 decode reads one byte per weight instead of four, and the integer kernels are fast on
AVX2 where PyTorch's float32 matrix-vector product is not (numbers: docs/benchmarks-history.md). Activations
are quantized with 7 bits (`reduce_range`), as fbgemm advises on x86: its 8-bit products can
saturate 16-bit sums on AVX2 (measured: 8 bits make SmolLM2 agree with fp32 on 3% of tokens).

A few input channels of an LLM's linears carry activations far larger than the rest, and one
7-bit grid per token cannot fit both. Smoothing (SmoothQuant, Xiao et al. 2023) moves that range
into the weights, where each row has its own scale:

    x @ W.T  =  (x / s) @ (W · s).T,   s_c = (max |x_c| on a calibration text) ** ALPHA

Quantizing a whole prefill chunk with one range let one loud token coarsen all the others
("What is the capital of France?" was answered in broken French), so each token gets its own.

Measured on SmolLM2 against fp32 (teacher-forced top-1 agreement, mean KL, 6 questions):
no smoothing 0.85 / 0.11 nats; ALPHA 0.3: 0.89 / 0.033; 0.5: 0.91 / 0.031; 0.7: 0.85 / 0.050.
Weight-only int8 would reach 0.98 / 0.004: the activations are where the error comes from.

An `Int8Linear` replaces each `nn.Linear`, so the Hugging Face forward runs unchanged. The fast
path fuses q/k/v and gate/up into one matrix each (`Int8Linear.fuse`); the fused modules then
answer with their slice of the fused product, so no weight is stored twice.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

REDUCE_RANGE = True
ALPHA = 0.5
CALIBRATION = (
    "The history of computing is a story of abstraction layered on abstraction, from switches and "
    "vacuum tubes to transistors, integrated circuits, operating systems, compilers and networks. "
    "What is the capital of France? Name three rivers in Europe. Why is the sky blue? Answer briefly. "
    "Write a short poem about the sea, then explain how a cache makes a program faster."
)
"""Text whose activations set the smoothing: a chat turn of prose and questions."""


def available() -> str | None:
    """None if this torch has the fbgemm int8 kernels, else why not."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return "this torch build has no fbgemm int8 kernels (x86 CPUs only)"
    return None


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: (Q [out, in] int8, scale [out] float32) with W ≈ scale[:, None] * Q."""
    weight = weight.detach().float()
    largest = torch.maximum(weight.amax(dim=1), -weight.amin(dim=1))  # |W| without a copy of W
    scale = (largest / 127).clamp(min=1e-12)
    q = (weight / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8)  # one float temporary
    return q, scale


def _pack(q: torch.Tensor, scale: torch.Tensor):
    with warnings.catch_warnings():  # quantized tensors are deprecated in torch; fbgemm still takes them
        warnings.simplefilter("ignore")
        qt = torch._make_per_channel_quantized_tensor(  # noqa: SLF001 (fbgemm's prepack takes only these)
            q, scale.double(), torch.zeros_like(scale, dtype=torch.long), 0
        )
        return torch.ops.quantized.linear_prepack(qt, None)


class Int8Linear(nn.Module):
    """y = x @ W.T with W held as fbgemm-packed int8 rows; or a slice of another Int8Linear's output."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, smooth: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = q.shape
        # Packed for fbgemm at first use, so rows fused before then are packed only once.
        self._int8: tuple[torch.Tensor, torch.Tensor] | None = (q, scale)
        self._packed = None
        self.register_buffer("unsmooth", 1.0 / smooth)
        self.source: Int8Linear | None = None
        self.rows = slice(0, self.out_features)

    @classmethod
    def from_linear(cls, linear: nn.Linear, smooth: torch.Tensor) -> "Int8Linear":
        """Quantize W · s (s per input channel); inputs are divided by s at each call."""
        if linear.bias is not None:
            raise ValueError("w8a8 covers linear layers without bias")
        return cls(*quantize_rows(linear.weight.detach().float() * smooth), smooth)

    @property
    def packed(self):
        if self._packed is None:
            self._packed, self._int8 = _pack(*self._int8), None
        return self._packed

    def int8_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(Q, scale) of this module's rows (unpacked from fbgemm's layout if packed already)."""
        if self.source is not None:
            q, scale = self.source.int8_weight()
            return q[self.rows], scale[self.rows]
        if self._int8 is not None:
            return self._int8
        qt, _ = torch.ops.quantized.linear_unpack(self._packed)
        return qt.int_repr(), qt.q_per_channel_scales().float()

    @property
    def weight_bytes(self) -> int:
        """int8 values plus one float32 scale per row; a slice of a fused matrix owns none."""
        return 0 if self.source is not None else self.out_features * (self.in_features + 4)

    @classmethod
    def fuse(cls, modules: list["Int8Linear"]) -> "Int8Linear":
        """One matrix with the modules' rows stacked; each module then answers with its slice."""
        unsmooth = modules[0].unsmooth
        if any(not torch.equal(m.unsmooth, unsmooth) for m in modules):
            raise ValueError("only linears that share their input (and so their smoothing) fuse")
        parts = [m.int8_weight() for m in modules]
        fused = cls(torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts]), 1.0 / unsmooth)
        fused.unsmooth = unsmooth
        start = 0
        for module in modules:
            module.read_from(fused, slice(start, start + module.out_features))
            start += module.out_features
        return fused

    def read_from(self, fused: Int8Linear, rows: slice) -> None:
        """From now on, these `rows` of `fused` are this layer's output: its own weights go."""
        self.source, self._packed, self._int8, self.unsmooth, self.rows = fused, None, None, None, rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.source is not None:  # the reference path: compute the fused product, keep our rows
            return self.source(x)[..., self.rows]
        x = x.float() * self.unsmooth
        if x.numel() == x.shape[-1]:  # one token: fbgemm's one range per call is per token
            return torch.ops.quantized.linear_dynamic(x, self.packed, REDUCE_RANGE)
        # fbgemm takes one range for the whole input; give each token its own by scaling every
        # row to [-1, 1] first and back after (the product is linear in each row).
        rows = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
        return torch.ops.quantized.linear_dynamic(x / rows, self.packed, REDUCE_RANGE) * rows

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, w8a8"


def input_ranges(model: nn.Module, ids: list[int]) -> dict[nn.Linear, torch.Tensor]:
    """Per input channel, the largest |x| each linear of `model` sees while it reads `ids`."""
    ranges: dict[nn.Linear, torch.Tensor] = {}

    def record(module, inputs, output):
        x = inputs[0].detach().float()
        ranges[module] = x.abs().reshape(-1, x.shape[-1]).amax(dim=0)

    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    hooks = [m.register_forward_hook(record) for m in linears]
    try:
        with torch.inference_mode():
            model(input_ids=torch.tensor([ids], device=model.device), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return ranges


def calibration_ids(tokenizer) -> list[int]:
    """The calibration text as the model reads a question: in its chat template, or raw for a base model."""
    from engine.prompt_format import CHAT_TEMPLATE, RAW

    chat = [{"role": "user", "content": CALIBRATION}]
    return (CHAT_TEMPLATE if getattr(tokenizer, "chat_template", None) else RAW).ids(tokenizer, chat)


def quantize_linears(model: nn.Module, calibration: list[int]) -> None:
    """Replace every nn.Linear of `model` (the LM head too) with a smoothed Int8Linear.

    Linears that read the same input (q/k/v, gate/up) see the same ranges, so they get the
    same smoothing and can still be fused into one matrix. A linear with a bias stays as it is.
    """
    ranges = input_ranges(model, calibration)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.bias is None:
                smooth = ranges[child].clamp(min=1e-5) ** ALPHA
                setattr(parent, name, Int8Linear.from_linear(child, smooth))


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the int8 matrices (not counted by get_memory_footprint, which sees only tensors)."""
    return sum(m.weight_bytes for m in model.modules() if isinstance(m, Int8Linear))
