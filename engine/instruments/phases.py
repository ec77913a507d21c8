"""The two phases, measured: FLOPs and bytes per phase, the rates achieved, and this machine's peaks.

How the work is counted (a student can redo it by hand from the model config):

* A weight matrix of shape [m, n] applied to one token costs 2·m·n FLOPs (one multiply and
  one add per weight). Per layer the matrices are q [h, H·d], k and v [h, K·d] each,
  o [H·d, h], and the MLP's gate, up and down [h, i] each, where h is the hidden size,
  H the query heads, K the KV heads, d the head dimension and i the MLP width:

      P_layer = h·H·d + 2·h·K·d + H·d·h + 3·h·i        P = layers · P_layer

  The LM head [h, vocab] runs once per forward pass (only the last position's logits are
  kept), the embedding is a row lookup (no FLOPs). Norms, RoPE, softmax and SiLU are a few
  FLOPs per element and left out.
* Attention: a query against one cached key costs 2·d (QKᵀ) plus 2·d (weighting V) per
  head, so 4·H·d per layer. In prefill, new token j (0-based) after r reused tokens sees
  r + j + 1 keys: pairs = n·r + n(n+1)/2. A decode step at context c sees c + 1 keys.

      FLOPs(prefill of n after r) = 2·P·n + 2·h·vocab·chunks + 4·layers·H·d·pairs
      FLOPs(decode at context c)  = FLOPs(prefill of 1 after c)

* Bytes: every weight the pass uses is read once per forward pass (the embedding table only
  one row per token when it is not tied to the LM head), the K/V of every position the pass
  attends to is read once, and the new positions' K/V are written once:

      bytes(prefill) = chunks·W + kv·(r + n) + kv·n      kv = 2·layers·K·d·element bytes
      bytes(decode)  = W + kv·(c + 1) + kv

Arithmetic intensity = FLOPs / bytes. The machine's balance point is peak FLOP/s divided by
bandwidth: below it a phase waits on memory (decode: about 0.5 FLOP per byte at fp32),
above it on arithmetic (prefill grows with n).
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import platformdirs
import torch

from engine.events import TurnStats
from engine.models import LoadedModel
from engine.session import PREFILL_CHUNK

Bound = Literal["compute", "memory"]


@dataclass(frozen=True)
class ModelShape:
    """The numbers of the model config the counts need, plus the loaded weight and cache sizes."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool
    weight_bytes: int
    """Bytes of all weights as loaded (at the loaded precision)."""
    embedding_bytes: int
    """Bytes of the input embedding table."""
    kv_bytes_per_token: int

    @classmethod
    def of(cls, loaded: LoadedModel) -> ModelShape:
        config, info = loaded.model.config, loaded.info
        embedding = loaded.model.get_input_embeddings().weight
        return cls(
            layers=info.layers,
            hidden=info.hidden_size,
            intermediate=config.intermediate_size,
            heads=info.heads,
            kv_heads=info.kv_heads,
            head_dim=info.head_dim,
            vocab=info.vocab_size,
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            weight_bytes=info.weight_bytes,
            embedding_bytes=embedding.numel() * embedding.element_size(),
            kv_bytes_per_token=info.kv_bytes_per_token,
        )

    # -- parameters -----------------------------------------------------------------
    @property
    def layer_matmul_params(self) -> int:
        """q, k, v and o projections and the three MLP matrices of one layer."""
        h, hd, kvd = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return h * hd + 2 * h * kvd + hd * h + 3 * h * self.intermediate

    @property
    def matmul_params(self) -> int:
        """P: the weights every token multiplies through, all layers (the LM head apart)."""
        return self.layers * self.layer_matmul_params

    @property
    def head_params(self) -> int:
        return self.hidden * self.vocab

    @property
    def parameters(self) -> int:
        """Every parameter: P, the LM head, the embedding (once if tied) and the RMSNorm weights."""
        embedding = 0 if self.tied_embeddings else self.vocab * self.hidden
        norms = (2 * self.layers + 1) * self.hidden
        return self.matmul_params + self.head_params + embedding + norms

    @property
    def streamed_weight_bytes(self) -> int:
        """W: weight bytes one forward pass reads (an untied embedding table is only looked up)."""
        return self.weight_bytes - (0 if self.tied_embeddings else self.embedding_bytes)

    # -- work per phase ---------------------------------------------------------------
    def attention_flops(self, new: int, reused: int) -> int:
        pairs = new * reused + new * (new + 1) // 2
        return 4 * self.layers * self.heads * self.head_dim * pairs

    def prefill_flops(self, new: int, reused: int = 0, chunks: int | None = None) -> int:
        chunks = _chunks(new) if chunks is None else chunks
        return (
            2 * self.matmul_params * new + 2 * self.head_params * chunks + self.attention_flops(new, reused)
        )

    def prefill_bytes(self, new: int, reused: int = 0, chunks: int | None = None) -> int:
        chunks = _chunks(new) if chunks is None else chunks
        return chunks * self.streamed_weight_bytes + self.kv_bytes_per_token * (reused + 2 * new)

    def decode_flops(self, context: int) -> int:
        """One decode step with `context` positions already in the cache."""
        return self.prefill_flops(1, context, chunks=1)

    def decode_bytes(self, context: int) -> int:
        return self.prefill_bytes(1, context, chunks=1)


def _chunks(new: int) -> int:
    return max(1, math.ceil(new / PREFILL_CHUNK))


# -- calibration ------------------------------------------------------------------------
@dataclass(frozen=True)
class Calibration:
    """This machine's peaks, measured once and cached per device, dtype and thread count."""

    device: str
    dtype: str
    threads: int
    matmul_flop_s: float
    """Best FLOP/s of a square matmul at `dtype` (what prefill can reach at most)."""
    bandwidth_bytes_s: float
    """Best bytes/s reading a large buffer once (what a decode step can reach at most)."""
    measured_at: float

    @property
    def balance(self) -> float:
        """FLOPs per byte where the roofline bends: below it a phase is memory-bound."""
        return self.matmul_flop_s / self.bandwidth_bytes_s


def calibration_path() -> Path:
    return Path(platformdirs.user_cache_dir("llmchat")) / "calibration.json"


def _machine_key(device: str, dtype: torch.dtype) -> str:
    if device == "cuda":
        name = torch.cuda.get_device_name()
    else:
        name = _cpu_name()
    return f"{device}|{name}|{str(dtype).removeprefix('torch.')}|{torch.get_num_threads()} threads"


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure_matmul(device: str, dtype: torch.dtype, size: int, repeats: int = 5) -> float:
    """Best FLOP/s of [size, size] @ [size, size]: 2·size³ FLOPs."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    a @ b  # warm up (thread pool, kernels)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        started = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - started)
    return 2 * size**3 / best


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype a `ModelInfo.compute_dtype` names ("bfloat16"), float32 for anything else."""
    dtype = getattr(torch, name, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def calibrate(
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    size: int | None = None,
    megabytes: int = 256,
    path: Path | None = None,
    refresh: bool = False,
) -> Calibration:
    """Measure (a few seconds) or read back this machine's peak matmul FLOP/s and bandwidth."""
    from engine.bench import measure_bandwidth

    path = path or calibration_path()
    key = _machine_key(device, dtype)
    saved = _read(path)
    if key in saved and not refresh:
        return Calibration(**saved[key])
    size = size or (4096 if device == "cuda" else 1024)
    result = Calibration(
        device=device,
        dtype=str(dtype).removeprefix("torch."),
        threads=torch.get_num_threads(),
        matmul_flop_s=measure_matmul(device, dtype, size),
        bandwidth_bytes_s=measure_bandwidth(device, megabytes),
        measured_at=time.time(),
    )
    saved[key] = asdict(result)
    _write(path, saved)
    return result


def cached_calibration(device: str, dtype: torch.dtype, path: Path | None = None) -> Calibration | None:
    """The saved calibration for this machine, or None (without measuring)."""
    saved = _read(path or calibration_path()).get(_machine_key(device, dtype))
    return Calibration(**saved) if saved else None


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f"{path.name}.tmp{os.getpid()}")
    staging.write_text(json.dumps(data, indent=1))
    os.replace(staging, path)


# -- one turn, measured -----------------------------------------------------------------
@dataclass(frozen=True)
class PhaseMeasure:
    """One phase of one turn: the work, the time, the rates, and where it sits on the roofline."""

    phase: str
    tokens: int
    """Tokens the phase processed (prefill: new prompt tokens; decode: steps measured)."""
    seconds: float
    """Prefill: the whole pass; decode: one step (median inter-token latency)."""
    flops: int
    bytes: int

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved."""
        return self.flops / self.bytes if self.bytes else 0.0

    @property
    def flop_s(self) -> float:
        return self.flops / self.seconds if self.seconds > 0 else 0.0

    @property
    def bytes_s(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else 0.0

    def bound(self, peaks: Calibration) -> Bound:
        return "compute" if self.intensity >= peaks.balance else "memory"

    def attainable_flop_s(self, peaks: Calibration) -> float:
        """The roofline: min(peak FLOP/s, intensity × bandwidth)."""
        return min(peaks.matmul_flop_s, self.intensity * peaks.bandwidth_bytes_s)

    def compute_use(self, peaks: Calibration) -> float:
        """Achieved FLOP/s as a fraction of the peak."""
        return self.flop_s / peaks.matmul_flop_s

    def memory_use(self, peaks: Calibration) -> float:
        """Achieved bytes/s as a fraction of the measured bandwidth."""
        return self.bytes_s / peaks.bandwidth_bytes_s


@dataclass(frozen=True)
class TurnPhases:
    prefill: PhaseMeasure | None
    """None when nothing was prefilled (the whole prompt came from the cache)."""
    decode: PhaseMeasure | None
    """None with fewer than two tokens (no inter-token latency yet), and for a speculative answer."""


def turn_phases(shape: ModelShape, stats: TurnStats) -> TurnPhases:
    """Work and rates of a finished turn's two phases, from its `TurnStats`.

    Decode is measured at its mean context (prompt + half the answer) over its median step.
    """
    prefill = None
    if stats.prefilled_tokens > 0 and stats.prefill_tok_s > 0:
        n, r = stats.prefilled_tokens, stats.reused_tokens
        seconds = n / stats.prefill_tok_s
        prefill = PhaseMeasure("prefill", n, seconds, shape.prefill_flops(n, r), shape.prefill_bytes(n, r))
    decode = None
    # A speculative answer's tokens come in rounds (gaps of ~0 within one): no plain step to time.
    if stats.generated_tokens > 1 and stats.itl_p50_s > 0 and stats.speculative is None:
        context = stats.prompt_tokens + stats.generated_tokens // 2
        steps = stats.generated_tokens - 1
        decode = PhaseMeasure(
            "decode", steps, stats.itl_p50_s, shape.decode_flops(context), shape.decode_bytes(context)
        )
    return TurnPhases(prefill, decode)
