"""The two phases, measured: FLOPs and bytes per phase, the rates achieved, and this machine's peaks.

How the work is counted (a student can redo it by hand from the model config):

* A weight matrix of shape [m, n] applied to one token costs 2·m·n FLOPs (one multiply and
  one add per weight). Per layer the matrices are q [h, H·d], k and v [h, K·d] each,
  o [H·d, h], and the MLP's gate, up and down [h, i] each, where h is the hidden size,
  H the query heads, K the KV heads, d the head dimension and i the MLP width:

      P_layer = h·H·d + 2·h·K·d + H·d·h + 3·h·i        P = layers · P_layer

  The LM head [h, vocab] runs once per forward pass (only the last position's logits are
  kept), the embedding is a row lookup (no FLOPs). Norms, RoPE, softmax and SiLU are a few
  FLOPs per element and left out, and so are the adds of a family's biases (Qwen2's q, k and
  v: (H + 2·K)·d a layer) and its q/k norms (Qwen3: 2·d weights a layer): they are counted
  among the parameters and in W, the bytes a pass reads, not in P.
* Attention: a query against one cached key costs 2·d (QKᵀ) plus 2·d (weighting V) per
  head, so 4·H·d per layer. In prefill, new token j (0-based) after r reused tokens sees
  r + j + 1 keys: pairs = n·r + n(n+1)/2. A decode step at context c sees c + 1 keys. A layer
  that attends over a sliding window of w positions (Gemma 3's local layers) sees at most w:
  its pairs are Σ min(r + j + 1, w), and it reads at most w positions' K/V.

      FLOPs(prefill of n after r) = 2·P·n + 2·h·vocab·chunks + 4·layers·H·d·pairs
      FLOPs(decode at context c)  = FLOPs(prefill of 1 after c)

* Bytes: every weight the pass uses is read once per forward pass (the embedding table only
  one row per token when it is not tied to the LM head), the K/V of every position the pass
  attends to is read once, and the new positions' K/V are written once:

      bytes(prefill) = chunks·W + kv·(r + n) + kv·n      kv = 2·layers·K·d·element bytes
      bytes(decode)  = W + kv·(c + 1) + kv

Arithmetic intensity = FLOPs / bytes. The machine's balance point is peak FLOP/s divided by
bandwidth: below it a phase's roof is memory (decode: about 0.5 FLOP per byte at fp32),
above it arithmetic (prefill grows with n). The roof is what the phase could reach at most;
how close it came is achieved / roof. Far below both roofs, neither arithmetic nor memory is
the limit: per-pass overhead (Python, op launches, the sampler) or other work on the machine is.

The peaks are the median of CALIBRATION_RUNS runs, with their spread: one run on a shared
machine can be twice as fast or slow as the next, and the roofline should not move with it.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable, Literal

import platformdirs
import torch

from engine.contention import ContentionMeter
from engine.events import Contention, ModelInfo, TurnStats
from engine.kv_windows import kv_read_bytes
from engine.models import LoadedModel, head_bytes_per_token, weights_read_per_token
from engine.session import PREFILL_CHUNK
from engine.threads import configured as configured_threads
from engine.threads import restore as restore_threads

Bound = Literal["compute", "memory"]
CALIBRATION_RUNS = 5
"""Runs of each calibration measurement; the peak is their median, shown with the spread."""
NEAR_ROOF = 0.5
"""At or above this fraction of its roof a phase is limited by that roof."""
FAR_FROM_ROOF = 0.2
"""Below this fraction of both roofs, neither is what limits a phase: overhead or contention is."""


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
    """The config ties the LM head to the embedding table (one matrix counted once)."""
    weight_bytes: int
    """Bytes of all weights as loaded (at the loaded precision)."""
    streamed_weight_bytes: int
    """W: weight bytes one forward pass reads (engine/models.py `weights_read_per_token`: all
    but a table the LM head does not multiply by, of which a pass reads a row a token)."""
    kv_bytes_per_token: int
    head_bytes: int = 0
    """Bytes of the LM head, of W (engine/models.py `head_bytes_per_token`)."""
    layer_biases: int = 0
    """Bias values of one layer's projections, read from its modules (Qwen2: q, k, v)."""
    windows: tuple[int | None, ...] = ()
    """Each layer's sliding window (None: the whole context); () where no layer has one."""
    layer_norms: int | None = None
    """Weights of one layer's RMSNorms, read from its modules (Llama: 2·hidden; Qwen3's per-head
    q and k norms add 2·head_dim, Gemma 3's norms of the attention's and MLP's outputs 2·hidden
    more). None: Llama's 2·hidden."""

    @classmethod
    def of(cls, loaded: LoadedModel, info: ModelInfo | None = None) -> ModelShape:
        """`info`: the session's, whose KV cache may have another precision than the model's
        own (an int8 cache's bytes per token are its scales' too: the KV panel's figure)."""
        config, info = loaded.model.config, info or loaded.info
        biases, norms = _layer_vectors(loaded.model)
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
            streamed_weight_bytes=weights_read_per_token(loaded),
            kv_bytes_per_token=info.kv_bytes_per_token,
            head_bytes=head_bytes_per_token(loaded),
            layer_biases=biases,
            layer_norms=norms,
            windows=info.layer_windows,
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
        """Every parameter: P, the LM head, the embedding (once if tied), the RMSNorm weights
        (each layer's and the final one) and the family's biases."""
        embedding = 0 if self.tied_embeddings else self.vocab * self.hidden
        layer_norms = 2 * self.hidden if self.layer_norms is None else self.layer_norms
        extras = self.layers * (self.layer_biases + layer_norms) + self.hidden
        return self.matmul_params + self.head_params + embedding + extras

    # -- work per phase ---------------------------------------------------------------
    def attention_flops(self, new: int, reused: int) -> int:
        pairs = sum(_pairs(new, reused, window) for window in self._layer_windows)
        return 4 * self.heads * self.head_dim * pairs

    @property
    def _layer_windows(self) -> tuple[int | None, ...]:
        return self.windows or (None,) * self.layers

    def kv_read_bytes(self, positions: int) -> int:
        """K/V bytes a pass reads attending over `positions` cached ones (a window layer: its last w)."""
        return kv_read_bytes(self.kv_bytes_per_token, self.layers, self.windows, positions)

    def prefill_flops(self, new: int, reused: int = 0, chunks: int | None = None) -> int:
        chunks = _chunks(new) if chunks is None else chunks
        return (
            2 * self.matmul_params * new + 2 * self.head_params * chunks + self.attention_flops(new, reused)
        )

    def prefill_bytes(self, new: int, reused: int = 0, chunks: int | None = None) -> int:
        chunks = _chunks(new) if chunks is None else chunks
        return (
            chunks * self.streamed_weight_bytes
            + self.kv_read_bytes(reused + new)
            + self.kv_bytes_per_token * new
        )

    def decode_flops(self, context: int) -> int:
        """One decode step with `context` positions already in the cache."""
        return self.prefill_flops(1, context, chunks=1)

    def decode_bytes(self, context: int) -> int:
        return self.prefill_bytes(1, context, chunks=1)


def _layer_vectors(model: torch.nn.Module) -> tuple[int, int | None]:
    """One decoder layer's bias values and norm weights, counted from its modules (the families'
    layers are alike; a model without `model.layers` counts no bias and Llama's norms)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers:
        return 0, None
    modules = list(layers[0].modules())
    biases = [getattr(m, "bias", None) for m in modules]
    # A norm's weight is the one vector a module holds as `weight` (a projection's is a matrix).
    weights = [getattr(m, "weight", None) for m in modules if not isinstance(m, torch.nn.Linear)]
    norms = [w for w in weights if isinstance(w, torch.Tensor) and w.dim() == 1]
    return (
        sum(b.numel() for b in biases if isinstance(b, torch.Tensor)),
        sum(w.numel() for w in norms),
    )


def _pairs(new: int, reused: int, window: int | None) -> int:
    """(query, key) pairs of `new` tokens after `reused`: token j sees r + j + 1 keys, at most `window`."""
    pairs = new * reused + new * (new + 1) // 2
    if window is None or reused + new <= window:
        return pairs
    # Tokens at positions p = r+1 .. r+n (1-based) see min(p, window) keys.
    below = max(0, min(reused + new, window) - reused)  # those still within the window
    return below * reused + below * (below + 1) // 2 + (new - below) * window


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
    """Median FLOP/s of a square matmul at `dtype` over the runs (what prefill can reach at most)."""
    bandwidth_bytes_s: float
    """Median bytes/s reading a large buffer once (what a decode step can reach at most)."""
    measured_at: float
    matmul_runs: tuple[float, ...] = ()
    """Each run's FLOP/s (empty in a calibration saved before runs were kept: one run)."""
    bandwidth_runs: tuple[float, ...] = ()
    cpu_share: float | None = None
    """The CPU share the calibration got (engine/contention.py); None where not measured."""
    busy: bool = False
    """It ran on a busy machine: the peaks are lower than the machine's own."""
    bandwidth_read: str = ""
    """How the bandwidth was read (engine/bench.py `BANDWIDTH_READ`); '' before it was named."""

    @property
    def balance(self) -> float:
        """FLOPs per byte where the roofline bends: below it a phase is memory-bound."""
        return self.matmul_flop_s / self.bandwidth_bytes_s

    @classmethod
    def from_saved(cls, saved: dict) -> Calibration:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in saved.items() if k in known}
        for name in ("matmul_runs", "bandwidth_runs"):
            values[name] = tuple(values.get(name, ()))
        return cls(**values)


@dataclass(frozen=True)
class Spread:
    """Several runs of one measurement: the median and the range."""

    median: float
    low: float
    high: float
    runs: int

    @classmethod
    def of(cls, runs: tuple[float, ...] | list[float]) -> Spread:
        return cls(statistics.median(runs), min(runs), max(runs), len(runs))

    @property
    def relative(self) -> float:
        """(high - low) / median: 0.05 is runs within 5% of each other."""
        return (self.high - self.low) / self.median if self.median else 0.0


def calibration_path() -> Path:
    return Path(platformdirs.user_cache_dir("llmchat")) / "calibration.json"


def _machine_key(device: str, dtype: torch.dtype) -> str:
    if device == "cuda":
        name = torch.cuda.get_device_name()
    else:
        name = _cpu_name()
    return f"{device}|{name}|{str(dtype).removeprefix('torch.')}|{configured_threads()} threads"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
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
    runs: int = CALIBRATION_RUNS,
) -> Calibration:
    """Measure (a few seconds) or read back this machine's peak matmul FLOP/s and bandwidth:
    the median of `runs` runs of each, the runs kept for their spread."""
    from engine.bench import BANDWIDTH_READ, measure_bandwidth

    path = path or calibration_path()
    key = _machine_key(device, dtype)
    saved = _read(path)
    if not refresh and (known := cached_calibration(device, dtype, path)) is not None:
        return known
    size = size or (4096 if device == "cuda" else 1024)
    restore_threads()  # the peaks of the configured threads, which the key names
    meter = ContentionMeter()
    matmul, bandwidth = measure_runs(
        lambda: measure_matmul(device, dtype, size, repeats=2),
        lambda: measure_bandwidth(device, megabytes),
        runs,
    )
    contention = meter.stop()
    result = Calibration(
        device=device,
        dtype=str(dtype).removeprefix("torch."),
        threads=configured_threads(),
        matmul_flop_s=statistics.median(matmul),
        bandwidth_bytes_s=statistics.median(bandwidth),
        measured_at=time.time(),
        matmul_runs=tuple(matmul),
        bandwidth_runs=tuple(bandwidth),
        cpu_share=contention.cpu_share,
        busy=contention.busy,
        bandwidth_read=BANDWIDTH_READ,
    )
    saved[key] = asdict(result)
    _write(path, saved)
    return result


def measure_runs(
    matmul: Callable[[], float], bandwidth: Callable[[], float], runs: int
) -> tuple[list[float], list[float]]:
    """`runs` measurements of each, interleaved, so a burst of other work touches both alike."""
    if runs < 1:
        raise ValueError(f"calibration runs must be at least 1, got {runs}")
    flops, reads = [], []
    for _ in range(runs):
        flops.append(matmul())
        reads.append(bandwidth())
    return flops, reads


def cached_calibration(device: str, dtype: torch.dtype, path: Path | None = None) -> Calibration | None:
    """The saved calibration for this machine, or None (without measuring; also where its
    bandwidth was read another way than today's, which is then measured again)."""
    from engine.bench import BANDWIDTH_READ

    saved = _read(path or calibration_path()).get(_machine_key(device, dtype))
    if not isinstance(saved, dict) or saved.get("bandwidth_read") != BANDWIDTH_READ:
        return None
    return Calibration.from_saved(saved)


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
        """The roof above the phase: compute right of the balance point, memory left of it."""
        return "compute" if self.intensity >= peaks.balance else "memory"

    def roof_use(self, peaks: Calibration) -> float:
        """How close the phase came to its roof: achieved / attainable FLOP/s (for a memory roof
        the same as achieved / peak bandwidth)."""
        roof = self.attainable_flop_s(peaks)
        return self.flop_s / roof if roof > 0 else 0.0

    def limit(self, peaks: Calibration) -> Literal["roof", "below", "neither"]:
        """'roof': at NEAR_ROOF of its roof or more, the roof limits it; 'neither': under
        FAR_FROM_ROOF of both peaks, overhead or contention does; 'below' in between."""
        if self.roof_use(peaks) >= NEAR_ROOF:
            return "roof"
        if self.compute_use(peaks) < FAR_FROM_ROOF and self.memory_use(peaks) < FAR_FROM_ROOF:
            return "neither"
        return "below"

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
    contention: Contention | None = None
    """The CPU share the turn was measured at (engine/contention.py)."""
    step_path: str | None = None
    """The step that decoded it (TurnStats.step_path): 'compiled', 'fused' (the eager step), ..."""


def turn_phases(shape: ModelShape, stats: TurnStats) -> TurnPhases:
    """Work and rates of a finished turn's two phases, from its `TurnStats`.

    Decode is measured at its mean context (prompt + half the answer) over its median step.
    """
    return TurnPhases(
        _prefill_phase(shape, stats), _decode_phase(shape, stats), stats.contention, stats.step_path
    )


def _prefill_phase(shape: ModelShape, stats: TurnStats) -> PhaseMeasure | None:
    """The turn's prefill, None where it prefilled nothing (the whole prompt was reused)."""
    if not (stats.prefilled_tokens > 0 and stats.prefill_tok_s > 0):
        return None
    n, r = stats.prefilled_tokens, stats.reused_tokens
    seconds = n / stats.prefill_tok_s
    return PhaseMeasure("prefill", n, seconds, shape.prefill_flops(n, r), shape.prefill_bytes(n, r))


def _decode_phase(shape: ModelShape, stats: TurnStats) -> PhaseMeasure | None:
    """The turn's decode at its mean context over its median step, None where there is no step to time."""
    # A speculative answer's tokens come in rounds (gaps of ~0 within one): no plain step to time.
    # A step-mode answer ran the slow path of a token at a time past the gate (3.7 tok/s): no
    # measure of the machine either.
    if not (stats.generated_tokens > 1 and stats.itl_p50_s > 0 and stats.speculative is None):
        return None
    if stats.step_path == "step mode":
        return None
    context = stats.prompt_tokens + stats.generated_tokens // 2
    steps = stats.generated_tokens - 1
    return PhaseMeasure(
        "decode", steps, stats.itl_p50_s, shape.decode_flops(context), shape.decode_bytes(context)
    )
