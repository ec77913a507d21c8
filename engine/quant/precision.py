"""The precisions llmchat offers, what each needs from the device, and how to load at each.

fp32/bf16/fp16 are plain weight dtypes; int8 and nf4 quantize through bitsandbytes (GPU-first
kernels); w8a8 quantizes weights and activations to int8 through torch's own fbgemm CPU
kernels (engine/quant/int8.py), the fastest prefill; w8 quantizes only the weights (engine/quant/w8.py)
and, with the compiled decode step, is the fastest decode on a CPU; w4 holds them in llama.cpp's
Q4_0 blocks of 4-bit values (engine/quant/w4.py), an eighth of fp32's bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from engine.cpu_features import cpu_matmul_native

if TYPE_CHECKING:
    import torch


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


@dataclass(frozen=True)
class PrecisionKind:
    """One precision llmchat offers, declared once: the CLI's choices and help, Settings' list
    and its note, the checks before a load and the step after it are all read from these."""

    name: str
    bits: int
    """Bits per weight element of the linear layers."""
    summary: str
    """What it is, in a few words (help texts)."""
    compute: tuple[str, str]
    """The dtype (torch's name) of activations (and unquantized weights) on (a CPU, a GPU)."""
    bitsandbytes: bool = False
    """Quantized through bitsandbytes at load time."""
    cpu_only: str | None = None
    """Why it cannot run on a GPU, where it cannot."""
    requires: Callable[[str], None] | None = None
    """Raises PrecisionError when this machine lacks what it needs (given the device)."""
    quantize: Callable[[Any, Any], None] | None = None
    """Quantizes a loaded model in place (given the model and its tokenizer), after loading in fp32."""
    reads_checkpoint: bool = False
    """On a CPU, engine/fast/checkpoint.py can read its weights without transformers."""
    calibrates: bool = False
    """Its quantizer runs the model on text, so a load for the weights alone reads the tokenizer too."""
    note: Callable[[], str | None] = lambda: None
    """An honest word on what it costs on this CPU (Settings, the model line)."""


def _w8a8(model: Any, tokenizer: Any) -> None:
    from engine.quant import int8

    int8.quantize_linears(model, int8.calibration_ids(tokenizer))


def _w8(model: Any, tokenizer: Any) -> None:
    from engine.quant import w8

    w8.quantize_linears(model)


def _w4(model: Any, tokenizer: Any) -> None:
    from engine.quant import w4

    w4.quantize_linears(model)


def _bf16_prefill() -> str:
    """What a quantized width's prefill multiplies in on this CPU (w8.py's `product_dtype`)."""
    native = cpu_matmul_native("bfloat16")
    return " (a prefill's products in bf16: twice fp32's rate on this CPU)" if native else ""


def _w8_note() -> str:
    return (
        f"w8 on CPU: int8 weights, fp32 activations{_bf16_prefill()}: a quarter of the matrices' "
        "bytes and the fastest decode once the compiled step (or, with AVX-512, its matvec kernel) "
        "is ready; before that each token widens every matrix, slower than fp32; only the weights "
        "are rounded, so the top-k stays near fp32's"
    )


def _w4_note() -> str:
    return (
        "w4 on CPU: llama.cpp's Q4_0, 4-bit weights with one scale per 32, fp32 activations"
        f"{_bf16_prefill()}: "
        "an eighth of fp32's matrix bytes; the LM head is 4-bit too and the embedding table "
        "stays fp32, as w8 keeps it; fast once the matvec kernel is built, before that each "
        "token widens every matrix; rounding to 16 levels moves the top-k more than w8 "
        "(F8 compares it with fp32)"
    )


def _sixteen_bit_note(name: str) -> str:
    cache = f"the KV cache stays fp32 (a {name} one would round again what {name} weights rounded)"
    if cpu_matmul_native("bfloat16" if name == "bf16" else "float16"):
        return (
            f"{name} on this CPU: half the bytes per weight and native {name} matmuls, "
            f"so decode and prefill are faster; {cache}"
        )
    return (
        f"{name} on this CPU: half the bytes per weight, so decode is faster, but there are no "
        f"native {name} matmul instructions: prefill upcasts each weight to fp32 on the fly "
        f"(a little slower than fp32; without that it would be several times slower), and {cache}"
    )


def _bitsandbytes_note(name: str) -> str:
    return (
        f"{name} on CPU through bitsandbytes: the smallest weights, but its CPU kernels "
        "are slower than fp32 today; the memory saving is the lesson"
    )


def resolve_device(device: str) -> str:
    """`auto` picks CUDA when present; an unavailable device is a clear error."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise PrecisionError("--device cuda: no CUDA GPU is visible on this machine; use --device cpu")
    if device not in ("cpu", "cuda"):
        raise PrecisionError(f"unknown device {device!r}; choose auto, cpu or cuda")
    return device


def precision_for(name: str, device: str) -> Precision:
    """Validate a precision name for a device and describe it."""
    kind = KINDS.get(name)
    if kind is None:
        raise PrecisionError(f"unknown precision {name!r}; choose one of {', '.join(PRECISIONS)}")
    if kind.cpu_only and device != "cpu":
        raise PrecisionError(kind.cpu_only)
    if kind.requires is not None:
        kind.requires(device)
    import torch

    compute = getattr(torch, kind.compute[device == "cuda"])
    cache = torch.float32 if device == "cpu" else compute
    return Precision(name, compute, kind.bits, kind.bitsandbytes, cache)


def cpu_note(name: str) -> str | None:
    """An honest word on what a precision costs on this CPU, or None."""
    kind = KINDS.get(name)
    return kind.note() if kind is not None else None


def _require_bf16(device: str) -> None:
    import torch

    if device == "cuda" and not torch.cuda.is_bf16_supported():
        raise PrecisionError("bf16 is not supported by this GPU; use fp16 or fp32")


def _require_fbgemm(device: str) -> None:
    from engine.quant import int8

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


FP32, BF16, FP16 = "float32", "bfloat16", "float16"
KINDS: dict[str, PrecisionKind] = {
    kind.name: kind
    for kind in (
        PrecisionKind("fp32", 32, "full precision (the default)", (FP32, FP32), reads_checkpoint=True),
        PrecisionKind(
            "bf16", 16, "16-bit brain float", (BF16, BF16), reads_checkpoint=True,
            requires=_require_bf16, note=lambda: _sixteen_bit_note("bf16"),
        ),
        PrecisionKind(
            "fp16", 16, "16-bit float", (FP16, FP16), reads_checkpoint=True,
            note=lambda: _sixteen_bit_note("fp16"),
        ),
        # bitsandbytes dequantizes into the compute dtype for each matmul.
        PrecisionKind(
            "int8", 8, "int8 weights (bitsandbytes)", (FP32, FP16), bitsandbytes=True,
            requires=lambda device: _require_bitsandbytes("int8"), note=lambda: _bitsandbytes_note("int8"),
        ),
        PrecisionKind(
            "nf4", 4, "4-bit NormalFloat weights (bitsandbytes)", (FP32, BF16), bitsandbytes=True,
            requires=lambda device: _require_bitsandbytes("nf4"), note=lambda: _bitsandbytes_note("nf4"),
        ),
        # Loaded in float32, then quantized; activations and the KV cache stay float32.
        PrecisionKind(
            "w8a8", 8, "int8 weights and activations (CPU)", (FP32, FP32), requires=_require_fbgemm,
            quantize=_w8a8, calibrates=True,
            cpu_only="w8a8 runs on torch's fbgemm CPU kernels; on a GPU use int8, nf4, bf16 or fp16",
            note=lambda: (
                "w8a8 on CPU: int8 weights and activations through torch's fbgemm kernels: the fastest "
                "prefill and a quarter of the matrices' bytes, but no compiled decode step; every matmul "
                "rounds its input to 7 bits, so the top-k drifts (F8 compares it with another precision)"
            ),
        ),
        PrecisionKind(
            "w8", 8, "int8 weights, float activations (CPU)", (FP32, FP32), quantize=_w8,
            reads_checkpoint=True,
            cpu_only="w8 is a CPU precision (its speed is the compiled CPU step); "
            "on a GPU use int8, nf4, bf16 or fp16",
            note=_w8_note,
        ),
        PrecisionKind(
            "w4", 4, "4-bit weights (Q4_0), float activations (CPU)", (FP32, FP32),
            quantize=_w4, reads_checkpoint=True,
            cpu_only="w4 is a CPU precision (its speed is llmchat's CPU matvec kernel); "
            "on a GPU use nf4, int8, bf16 or fp16",
            note=_w4_note,
        ),
    )
}  # fmt: skip
PRECISIONS = tuple(KINDS)
"""The precisions' names, in the order they are offered."""


def precision_help() -> str:
    """The choices as a help text: 'fp32, bf16, ... or w8 (CPU)'."""
    names = [f"{k.name} (CPU)" if k.cpu_only else k.name for k in KINDS.values()]
    return ", ".join(names[:-1]) + " or " + names[-1]
