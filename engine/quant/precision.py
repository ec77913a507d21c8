"""The precisions llmchat offers, what each needs from the device, and how to load at each.

fp32/bf16/fp16 are plain weight dtypes; int8 and nf4 quantize through bitsandbytes (GPU-first
kernels); w8a8 quantizes weights and activations to int8 through torch's own fbgemm CPU
kernels (engine/quant/int8.py), the fastest prefill; w8 quantizes only the weights (engine/quant/w8.py)
and, with the compiled decode step, is the fastest decode on a CPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

PRECISIONS = ("fp32", "bf16", "fp16", "int8", "nf4", "w8a8", "w8")


class PrecisionError(ValueError):
    """A precision that cannot run on the chosen device; the message says what would."""


@dataclass(frozen=True)
class Precision:
    name: str
    dtype: torch.dtype
    """Dtype of the non-quantized weights, the activations and the KV cache."""
    bits: int
    """Bits per weight element of the linear layers."""
    quantized: bool
    """Quantized through bitsandbytes at load time."""
    cache_dtype: torch.dtype
    """The KV cache's dtype. A 16-bit model on a CPU keeps an fp32 cache, for its answers: with
    the step's attention kernel a bf16 cache reads as fast or faster, but it rounds again what
    bf16 weights rounded. SmolLM2 at bf16 weights, teacher-forced against its fp32-cache answers:
    top-1 0.971, mean KL 0.0011 nats (30x a bf16 cache's at fp32 weights), and the first token
    to "What is the capital of France?" flips to French (BENCHMARKS.md)."""


def resolve_device(device: str) -> str:
    """`auto` picks CUDA when present; an unavailable device is a clear error."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise PrecisionError("--device cuda: no CUDA GPU is visible on this machine; use --device cpu")
    if device not in ("cpu", "cuda"):
        raise PrecisionError(f"unknown device {device!r}; choose auto, cpu or cuda")
    return device


def precision_for(name: str, device: str) -> Precision:
    """Validate a precision name for a device and describe it."""
    if name not in PRECISIONS:
        raise PrecisionError(f"unknown precision {name!r}; choose one of {', '.join(PRECISIONS)}")
    if name in ("int8", "nf4"):
        _require_bitsandbytes(name)
    if name == "w8a8":
        _require_fbgemm(device)
    if name == "w8" and device != "cpu":
        raise PrecisionError(
            "w8 is a CPU precision (its speed is the compiled CPU step); on a GPU use int8, nf4, bf16 or fp16"
        )
    compute = {
        "fp32": torch.float32,
        "bf16": torch.bfloat16,
        "fp16": torch.float16,
        # bitsandbytes dequantizes into this dtype for each matmul.
        "int8": torch.float16 if device == "cuda" else torch.float32,
        "nf4": torch.bfloat16 if device == "cuda" else torch.float32,
        # Loaded in float32, then quantized; activations and the KV cache stay float32.
        "w8a8": torch.float32,
        "w8": torch.float32,
    }[name]
    if name == "bf16" and device == "cuda" and not torch.cuda.is_bf16_supported():
        raise PrecisionError("bf16 is not supported by this GPU; use fp16 or fp32")
    bits = {"fp32": 32, "bf16": 16, "fp16": 16, "int8": 8, "nf4": 4, "w8a8": 8, "w8": 8}[name]
    cache = torch.float32 if device == "cpu" else compute
    return Precision(name, compute, bits, name in ("int8", "nf4"), cache)


def cpu_note(name: str) -> str | None:
    """An honest word on what a precision costs on this CPU, or None."""
    if name in ("bf16", "fp16"):
        cache = f"the KV cache stays fp32 (a {name} one would round again what {name} weights rounded)"
        if cpu_matmul_native(torch.bfloat16 if name == "bf16" else torch.float16):
            return (
                f"{name} on this CPU: half the bytes per weight and native {name} matmuls, "
                f"so decode and prefill are faster; {cache}"
            )
        return (
            f"{name} on this CPU: half the bytes per weight, so decode is faster, but there are no "
            f"native {name} matmul instructions: prefill upcasts each weight to fp32 on the fly "
            f"(a little slower than fp32; without that it would be several times slower), and {cache}"
        )
    if name == "w8a8":
        return (
            "w8a8 on CPU: int8 weights and activations through torch's fbgemm kernels: the fastest "
            "prefill and a quarter of the matrices' bytes, but no compiled decode step; every matmul "
            "rounds its input to 7 bits, so the top-k drifts (F8 compares it with another precision)"
        )
    if name == "w8":
        return (
            "w8 on CPU: int8 weights, fp32 activations: a quarter of the matrices' bytes and the "
            "fastest decode once the compiled step (or, with AVX-512, its matvec kernel) is ready; "
            "before that each token widens every matrix, slower than fp32; only the weights are "
            "rounded, so the top-k stays near fp32's"
        )
    if name in ("int8", "nf4"):
        return (
            f"{name} on CPU through bitsandbytes: the smallest weights, but its CPU kernels "
            "are slower than fp32 today; the memory saving is the lesson"
        )
    return None


@functools.cache
def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(f.read().split())
    except OSError:
        return set()


def cpu_matmul_native(dtype: torch.dtype) -> bool:
    """Whether this CPU has matmul instructions for 16-bit `dtype` (AVX-512 or AMX)."""
    wanted = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}
    return any(flag in _cpu_flags() for flag in wanted.get(dtype, ()))


def _require_fbgemm(device: str) -> None:
    from engine.quant import int8

    if device != "cpu":
        raise PrecisionError("w8a8 runs on torch's fbgemm CPU kernels; on a GPU use int8, nf4, bf16 or fp16")
    missing = int8.available()
    if missing:
        raise PrecisionError(f"w8a8: {missing}; use fp32, bf16 or fp16")


def _require_bitsandbytes(name: str) -> None:
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as e:
        raise PrecisionError(
            f"{name} needs the bitsandbytes package ({e}); install it or use fp32/bf16/fp16"
        ) from None


def quantization_config(precision: Precision):
    """The BitsAndBytesConfig for a quantized precision, else None."""
    if not precision.quantized:
        return None
    from transformers import BitsAndBytesConfig

    if precision.name == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=precision.dtype,
    )
