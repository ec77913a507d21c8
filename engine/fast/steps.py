"""The compiled decode steps: compiling one against scratch buffers, saving it, loading it.

Each is `(fast, token, position, offsets, keys, values[, key_scales, value_scales]) -> logits
[vocab]` over the cache buffers of every layer (`cache_buffers`; the scales for an int8 cache),
`offsets` being the first position each layer's buffers hold (0 unless a sliding window dropped
the oldest, engine/kvcache_layers.py), and
engine/fast/compiled.py builds them in the background:
- "regional": one decoder block compiled once and run for every layer (the layers differ only
  in their weights, which come in as arguments), and the head. Compiles in ~5 s.
- "whole": the blocks unrolled into one graph. ~30 s to compile, and one call per token
  instead of 31: 4-20% faster per token, the more the fewer bytes a token reads (w8).
- "verify": the regional step for 2 to 16 tokens at once (a speculative verify), their number
  compiled as dynamic, each row's logits out; built only once speculation asks for it.
Each is compiled ahead of time (Dynamo's `aot_compile`) by a child process, which saves it;
the app loads it (`load`) in a fraction of a second, without tracing it again, and so does
every later start. scripts/compile_cost.py measures both; BENCHMARKS.md has the numbers.

Both run without Dynamo's guards (nor Inductor's size asserts), which would check ~190
(regional, per call) or ~1,800 (whole) conditions before each call, ~0.6 ms a token. That is
safe here because each step is only ever called with one fast path's layers and cache buffers
of one dtype, whose capacity is compiled as dynamic, and is saved under a key of everything its
code depends on (`saved_path`): nothing a guard would catch changes between calls.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import pickle
import sys
from pathlib import Path
from typing import Callable

import torch

from engine.fast import matvec
from engine.fast.fused import FastLlama
from engine.kvcache_layers import SCALE_DTYPE, PreallocatedLayer
from engine.threads import configured as configured_threads

REGIONAL = "regional"
KINDS = (REGIONAL, "whole")
"""In the order the background build makes them: quick to compile first, fastest second."""
VERIFY = "verify"
"""The third kind, built once a speculative answer asks for it: the regional step for a verify's
2 to MAX_VERIFY_ROWS tokens, their number compiled as dynamic, each row's logits out."""
MAX_VERIFY_ROWS = matvec.MAX_ROWS
"""Tokens the verify step takes at most: the rows the matvec kernel multiplies in one read."""


def whole_step(
    fast: FastLlama, token: torch.Tensor, position: torch.Tensor, offsets: torch.Tensor, *buffers
) -> torch.Tensor:
    """A decode step in one piece; embedding and RoPE are a row lookup and a few dozen numbers.
    `offsets` [layers]: the first position each layer's buffers hold (`cache_offsets`); `buffers`:
    every layer's K buffer, every layer's V buffer (and, for an int8 cache, every layer's K scales
    and V scales), as `cache_buffers` gives them."""
    h = fast.embedded(token)
    for layer, inputs, *layer_buffers in zip(fast.layers, layer_inputs(fast, position, offsets), *buffers):
        h = fast.block_on_buffers(layer, h, *inputs, *layer_buffers)
    return fast.head(h)


def layer_inputs(
    fast: FastLlama, position: torch.Tensor, offsets: torch.Tensor
) -> list[tuple[torch.Tensor, ...]]:
    """Each layer's (cos, sin, slot, first attended slot) for a step at `position`: its kind of
    layer's RoPE table and window (Gemma 3's local layers differ from its global ones). A slot is a
    position less the layer's offset: a sliding window's buffers may no longer start at 0."""
    ropes, firsts = fast.ropes_at(position), fast.window_starts(position)
    inputs = []
    for i, layer in enumerate(fast.layers):
        slot, first = position, firsts[layer.window]
        if layer.window is not None:  # only a sliding window drops positions: the others pay nothing
            offset = offsets[i : i + 1]
            slot, first = position - offset, first - offset
        inputs.append((*ropes[layer.rope], slot, first))
    return inputs


def cache_offsets(layers: list[PreallocatedLayer]) -> torch.Tensor:
    """The first position each layer's buffers hold, as a step takes them ([layers])."""
    return torch.tensor([layer.start for layer in layers])


class _RegionalStep:
    """`whole_step` with the block and the head compiled on their own, the block run per layer."""

    def __init__(self, block: Callable, head: Callable):
        self.block, self.head = block, head

    def __call__(
        self, fast: FastLlama, token: torch.Tensor, position: torch.Tensor, offsets: torch.Tensor, *buffers
    ):
        h = fast.embedded(token)
        inputs_per_layer = layer_inputs(fast, position, offsets)
        for layer, inputs, *layer_buffers in zip(fast.layers, inputs_per_layer, *buffers):
            h = self.block(fast, layer, h, *inputs, *layer_buffers)
        return self.head(fast, h)


_SOURCES = {
    "step": whole_step,
    "block": FastLlama.block_on_buffers,
    "head": FastLlama.head,
    "verify_block": FastLlama.block_on_buffers,
    "verify_head": FastLlama.head_rows,
}
"""The function each compiled part of a step is made from: the whole step's one, the regional
step's two, the verify step's two."""


def compile_here(kind: str, fast: FastLlama, cache_dtype: torch.dtype) -> dict[str, Callable]:
    """The compiled parts of a step of `kind` ("step"; "block" and "head"), compiled in this
    process by Dynamo's ahead-of-time compile on scratch buffers: `assemble` makes the step of
    them, `save` keeps them for a later `load`."""
    rows = 5 if kind == VERIFY else 1  # an example: a verify's number of rows is compiled as dynamic
    token, position, offsets = torch.zeros(rows, dtype=torch.long), torch.arange(rows), no_offsets(fast)
    buffers = scratch_buffers(fast, cache_dtype)
    if kind == "whole":
        examples = {"step": (fast, token, position, offsets, *buffers)}
    else:
        h = fast.embedded(token)
        inputs = layer_inputs(fast, position, offsets)[0]
        if kind == VERIFY:
            _rows_dynamic(h, *inputs)
        prefix = "verify_" if kind == VERIFY else ""
        examples = {
            f"{prefix}block": (fast, fast.layers[0], h, *inputs, *(per_layer[0] for per_layer in buffers)),
            f"{prefix}head": (fast, h),
        }
    with torch.inference_mode():  # as the session's calls are
        parts = {name: unguarded(_SOURCES[name]).aot_compile((args, {})) for name, args in examples.items()}
    for part in parts.values():
        part.disable_guard_check()
    return parts


def _rows_dynamic(*tensors: torch.Tensor) -> None:
    """Each tensor's first dimension (a verify's rows) compiled as any of 2..MAX_VERIFY_ROWS."""
    from torch._dynamo import mark_dynamic  # torch.compiler has no public name for it (2.13)

    for tensor in tensors:
        mark_dynamic(tensor, 0, min=2, max=MAX_VERIFY_ROWS)


def assemble(kind: str, parts: dict[str, Callable]) -> Callable:
    """The step of `kind` made of its compiled parts (`compile_here`, `load`). The verify step
    is called as the others, with a [n] tensor of tokens and one of their positions; it returns
    each row's logits [n, vocab]."""
    if kind == "whole":
        return parts["step"]
    if kind == VERIFY:
        return _RegionalStep(parts["verify_block"], parts["verify_head"])
    return _RegionalStep(parts["block"], parts["head"])


def save(parts: dict, path: Path) -> None:
    """Write a step's compiled parts to `path` at once (a crash leaves no half-written file)."""
    serialized = {name: type(part).serialize(part).serialized_data for name, part in parts.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    partial.write_bytes(pickle.dumps(serialized))
    os.replace(partial, path)


def load(path: Path) -> dict[str, Callable]:
    """A step's compiled parts as `save` wrote them: Dynamo's output bytecode and Inductor's
    code, nothing traced again. Under a second, most of it waiting on subprocesses without the
    GIL, where Dynamo's trace of the whole step from Inductor's cache held it ~5 s
    (docs/benchmarks-history.md)."""
    serialized = pickle.loads(path.read_bytes())
    parts = {}
    # Inductor test-builds ATen's vector headers for each ISA and dlopens them in fresh Pythons
    # (~1.4 s, once per process); as in the compile (`unguarded`), the base check is skipped.
    from torch._inductor import config as inductor_config  # imported when used: it is slow to import

    with inductor_config.patch({"cpp.vec_isa_ok": True}):
        for name, data in serialized.items():
            f_globals = _SOURCES[name].__globals__
            parts[name] = torch.compiler.load_compiled_function(io.BytesIO(data), f_globals=f_globals)
            parts[name].disable_guard_check()
    return parts


def unguarded(fn: Callable) -> Callable:
    """`fn` to compile without guards (`compile_here` compiles it ahead of time: nothing is
    kept in Dynamo's cache of `fn`'s code, so no copy of the code is needed)."""
    options = {
        "guard_filter_fn": torch.compiler.skip_all_guards_unsafe,
        # Inductor's size asserts check each input's shape and strides per call, like the
        # guards (~280 a whole step, ~0.15 ms a token), and are off for the same reason.
        "size_asserts": False,
        # Before a machine's first compile, Inductor test-builds ATen's vector headers for each
        # ISA the CPU reports (4.7 s of a 9.9 s first compile here; a dlopen probe in a fresh
        # Python on every start). The CPU's flags still choose the ISA; a compiler that cannot
        # build it fails the compile itself, which leaves eager serving and says why.
        "cpp.vec_isa_ok": True,
    }
    return torch.compile(fn, dynamic=False, fullgraph=True, options=options)


def cache_buffers(layers: list[PreallocatedLayer], room: int = 1) -> list[list[torch.Tensor]]:
    """A step's buffers from the cache's layers, each grown to hold `room` more positions: every
    layer's K buffer, then every layer's V (then, for an int8 cache, K scales and V scales)."""
    return [list(kind) for kind in zip(*(layer.buffers_with_room(room) for layer in layers))]


def no_offsets(fast: FastLlama) -> torch.Tensor:
    """Offsets of buffers that hold every position from 0 (a fresh cache, scratch buffers)."""
    return torch.zeros(len(fast.layers), dtype=torch.long)


def scratch_buffers(
    fast: FastLlama, cache_dtype: torch.dtype, capacity: int = PreallocatedLayer.initial_capacity
) -> list[list[torch.Tensor]]:
    """Zeroed buffers as `cache_buffers` gives them, their capacity marked dynamic: a step
    compiled on them serves a cache of any capacity, with one compilation."""
    from torch._dynamo import mark_dynamic  # torch.compiler has no public name for it (2.13)

    shape = (1, fast.kv_heads, capacity, fast.head_dim)
    kinds = [[torch.zeros(shape, dtype=cache_dtype) for _ in fast.layers] for _ in range(2)]
    if cache_dtype == torch.int8:  # and one float32 scale per position and head
        kinds += [[torch.zeros(shape[:3], dtype=SCALE_DTYPE) for _ in fast.layers] for _ in range(2)]
    for buffer in (buffer for kind in kinds for buffer in kind):
        mark_dynamic(buffer, 2)
    return kinds


_CODE = (
    "fused.py",
    "families.py",
    "steps.py",
    "attention.py",
    "matvec.py",
    "norm.py",  # the trace asks it which norm to run
    "kernels.py",
    "decode_step.cpp",
    "decode_attention.cpp",
    "matvec.cpp",
    "matvec_rows.h",
    "simd.h",
    "../quant/w8.py",
    "../quant/w4.py",
    "../kvcache_layers.py",  # an int8 cache's new rows are quantized inside the step
)
"""The sources a compiled step is made of: a change to any makes a saved step stale (a test
checks that each llmchat source the step runs is here)."""
_CODE_DIGEST = hashlib.sha256(b"".join((Path(__file__).parent / f).read_bytes() for f in _CODE)).digest()
"""Those sources as this process read them when it started. Read at each compile instead, code
replaced under a running app (an upgrade) keyed the step a compile child made of the new code
by the files, and the app loaded code it does not run (a test run aborted so); now the child's
step is saved under a key of its own, and the app compiles its own."""


def _signature(weight) -> tuple | str:
    """What compiled code depends on in a weight: shape, dtype, strides (a w8 module's own description)."""
    if isinstance(weight, torch.Tensor):
        return (tuple(weight.shape), str(weight.dtype), weight.stride())
    return repr(weight)


def layer_signature(layer) -> tuple:
    """What a compiled block depends on in a layer. The regional step needs every layer's to be
    the same."""
    weights = (layer.wqkv, layer.wo, layer.wgu, layer.wdown)
    return tuple(_signature(w) for w in weights + tuple(getattr(layer, name) for name in layer.SMALL))


def saved_path(fast: FastLlama, cache_dtype: torch.dtype, kind: str) -> Path | None:
    """Where the compiled step of `kind` for this fast path and cache dtype is saved (`save`),
    keyed by everything its code depends on and runs unchecked (no guards): shapes, dtypes and
    strides, the model's constants, this torch and Python, the CPU's vector ISA, the thread
    count Inductor writes into its loops, whether it calls the matvec kernel, and llmchat's
    code. None without a cache directory."""
    root = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not root:
        return None
    shapes = [layer_signature(fast.layers[0]), _signature(fast.lm_head), _signature(fast.embed)]
    model = (kind, fast.family.name, len(fast.layers), fast.heads, fast.kv_heads, fast.head_dim, fast.eps)
    model += (
        fast.query_scale,
        fast.logit_softcap,
        fast.activation,
        None if fast.embed_scale is None else fast.embed_scale.item(),
    )
    model += tuple((layer.rope, layer.window) for layer in fast.layers)
    ropes = [(inv_freq.tolist(), scale) for inv_freq, scale in fast.ropes]
    key = hashlib.sha256(
        repr((*_this_build(), model, fast.transposed)).encode()
        + repr((shapes, str(fast.act_dtype), str(cache_dtype), ropes)).encode()
        + _CODE_DIGEST
    ).hexdigest()[:32]
    return Path(root) / "llmchat-steps" / f"{key}.step"


def _this_build() -> tuple:
    """What a compiled step depends on beside the model and llmchat's code: this torch and Python,
    the CPU's vector ISA, the thread count Inductor writes into its loops, whether it calls the
    matvec kernel."""
    isa, threads = torch.backends.cpu.get_cpu_capability(), configured_threads()
    return (torch.__version__, sys.version, isa, threads, matvec.enabled)


NOTHING = "-"
"""A note's content where the child found nothing to compile (no fast path for the model)."""


def _note_path(spec: str, precision: str, kind: str, cache_dtype: str) -> Path | None:
    """Where a compile child notes what it made for a model as the app names it (`note_made`).
    Keyed by what is known before the model is loaded: the spec (and its file's size and time),
    the precision, kind and cache dtype, and what `saved_path` keys beside the model."""
    root = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not root:
        return None
    try:
        stat = os.stat(spec)
        source = (spec, stat.st_size, stat.st_mtime_ns)
    except OSError:  # a hub id, or an alias
        source = (spec,)
    described = repr((source, precision, kind, cache_dtype, *_this_build()))
    key = hashlib.sha256(described.encode() + _CODE_DIGEST).hexdigest()[:32]
    return Path(root) / "llmchat-steps" / "made" / key


def note_made(spec: str, precision: str, kind: str, cache_dtype: str, saved: Path | None) -> None:
    """Note for later starts that the step for this model is saved at `saved` (None: nothing to
    compile), so that they start no compile child before loading the model (`made_before`)."""
    note = _note_path(spec, precision, kind, cache_dtype)
    if note is not None:
        with contextlib.suppress(OSError):  # only a hint: without it the next start's child looks again
            note.parent.mkdir(parents=True, exist_ok=True)
            note.write_text(NOTHING if saved is None else str(saved))


def made_before(spec: str, precision: str, kind: str, cache_dtype: str) -> bool:
    """Whether an earlier start's child saved this model's step (still there) or found nothing to
    compile for it."""
    note = _note_path(spec, precision, kind, cache_dtype)
    try:
        made = note.read_text() if note is not None else ""
    except OSError:
        return False
    return made == NOTHING or (bool(made) and Path(made).exists())
