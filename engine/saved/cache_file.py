"""A conversation's KV cache on disk: one self-describing safetensors file.

The file holds each layer's K and V for the positions in use, plus string metadata: the
token ids those positions hold, the model (spec, name and a fingerprint of its weights),
the precision, the cache's dtype (its precision: float32, bfloat16, float16, or int8 with a
float32 scale tensor per layer for K and for V), the shapes, and a sha256 checksum over all of that and every
tensor byte. A load checks every one of them against the model in memory and hands back a
cache only when all match; anything else (another model or precision, a damaged or
truncated file, values changed after saving, a file without a checksum) is ignored with a
notice, never trusted. A cache is a pure function of its token ids and the model, so a
matching file is as good as prefilling those ids again.

The file is written to a temporary name and renamed over the old one, so a crash leaves
either the old file or the new one, never half of one; the temporary file of a writer that
was killed is removed by the next save or load in that directory.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.errors import one_line
from engine.events import ModelInfo
from engine.kvcache import KVCache, cache_precision_of, common_prefix
from engine.models import LoadedModel

FORMAT = "llmchat-kv-cache"
FORMAT_VERSION = 1


class CacheFileError(RuntimeError):
    """A cache file that could not be written; the message is one line."""


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A short hash of the first rows of the input embeddings: tells two models with one name apart."""
    rows = model.get_input_embeddings().weight[:8].detach().float().cpu().contiguous()
    return hashlib.sha256(rows.numpy().tobytes()).hexdigest()[:16]


def describe(loaded: LoadedModel, info: ModelInfo | None = None) -> dict[str, str]:
    """The metadata a cache made by `loaded` carries (everything but the token ids); `info` is the
    session's (its cache precision may differ from the model precision's own)."""
    info = info or loaded.info
    return {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "model_spec": info.spec,
        "model_name": info.name,
        "weights": weights_fingerprint(loaded.model),
        "precision": info.precision,
        "dtype": info.cache_dtype,
        "layers": str(info.layers),
        "kv_heads": str(info.kv_heads),
        "head_dim": str(info.head_dim),
    }


def checksum(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
    """sha256 over the metadata (all but this field) and the sha256 of each tensor's name, dtype,
    shape and bytes; the tensors are hashed in parallel (hashlib lets go of the GIL)."""
    fields = {key: value for key, value in metadata.items() if key != "checksum"}
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode())
    names = sorted(tensors)
    with ThreadPoolExecutor(min(len(names), os.cpu_count() or 1, 8)) as pool:
        for part in pool.map(lambda name: _tensor_digest(name, tensors[name]), names):
            digest.update(part)
    return "sha256:" + digest.hexdigest()


def _tensor_digest(name: str, tensor: torch.Tensor) -> bytes:
    tensor = tensor.contiguous()
    digest = hashlib.sha256(f"{name} {tensor.dtype} {tuple(tensor.shape)}".encode())
    digest.update(tensor.view(torch.uint8).numpy())  # the raw bytes, whatever the dtype; no copy
    return digest.digest()


def save_cache(cache: KVCache, loaded: LoadedModel, path: Path, info: ModelInfo | None = None) -> int:
    """Write the cache's used positions and ids to `path` atomically; returns the file size in bytes."""
    if len(cache) == 0:
        raise CacheFileError("the KV cache is empty; nothing to save")
    tensors = _tensors(cache)
    metadata = _signed_metadata(cache, loaded, info, tensors)
    path = Path(path)
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temp_files(path.parent)
        save_file(tensors, str(staging), metadata=metadata)
        _fsync(staging)
        os.replace(staging, path)
        return path.stat().st_size
    except Exception as e:  # safetensors raises its own SafetensorError for I/O errors too
        with contextlib.suppress(OSError):
            staging.unlink(missing_ok=True)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        raise CacheFileError(f"cannot save the KV cache to {path}: {_why(e, size)}") from None


def _signed_metadata(
    cache: KVCache, loaded: LoadedModel, info: ModelInfo | None, tensors: dict[str, torch.Tensor]
) -> dict[str, str]:
    """The file's metadata: the model and cache that made it, its token ids, and a checksum over
    those and the tensors."""
    metadata = {**describe(loaded, info), "tokens": str(len(cache)), "token_ids": json.dumps(cache.ids)}
    starts = [layer.start for layer in cache.layers]
    if any(starts):  # sliding windows that dropped their oldest positions (older files: none did)
        metadata["starts"] = json.dumps(starts)
    metadata["checksum"] = checksum(tensors, metadata)
    return metadata


def _why(error: BaseException, size: int) -> str:
    """One line; a full disk (which safetensors reports as text) said plainly."""
    text = one_line(error, 200)
    needed = f"{size / 1e6:.1f} MB" if size >= 100_000 else f"{size / 1e3:.0f} kB"
    if getattr(error, "errno", None) == errno.ENOSPC or "No space left on device" in text:
        return f"the disk is full ({needed} needed)"
    if getattr(error, "errno", None) == errno.EDQUOT or "Disk quota exceeded" in text:
        return f"the disk quota is used up ({needed} needed)"
    return text


_TEMP_NAME = re.compile(r"^\..+\.safetensors\.(\d+)\.tmp$")
"""What save_cache names the file it is writing: `.<name>.<writer pid>.tmp`."""

STALE_AFTER_S = 30.0
"""A temporary file untouched this long whose writer is gone is litter (a writer seen from another
PID namespace may look gone, but a live one keeps its file fresh: it is renamed right after writing)."""


def remove_stale_temp_files(directory: Path) -> list[Path]:
    """Delete the temporary files of cache writers that are gone (killed mid-save); returns them."""
    removed = []
    now = time.time()
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            match = _TEMP_NAME.match(entry.name)
            if match is None or _running(int(match.group(1))):
                continue
            with contextlib.suppress(OSError):
                if now - entry.stat().st_mtime >= STALE_AFTER_S:
                    os.unlink(entry.path)
                    removed.append(Path(entry.path))
    return removed


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists but is not ours (EPERM), or the check is not possible: keep its file
        return True
    return True


def _tensors(cache: KVCache) -> dict[str, torch.Tensor]:
    tensors = {}
    for i, layer in enumerate(cache.layers):
        if layer.get_seq_length() != len(cache):
            raise CacheFileError(
                f"layer {i} holds {layer.get_seq_length()} positions, the cache {len(cache)} ids"
            )
        tensors[f"layers.{i}.keys"] = layer.keys.contiguous().cpu()  # hashed here, then written
        tensors[f"layers.{i}.values"] = layer.values.contiguous().cpu()
        if cache.quantized:
            tensors[f"layers.{i}.key_scales"] = layer.key_scales.contiguous().cpu()
            tensors[f"layers.{i}.value_scales"] = layer.value_scales.contiguous().cpu()
    return tensors


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_cache(
    path: Path,
    loaded: LoadedModel,
    history: Sequence[int] | None = None,
    needed: int | None = None,
    info: ModelInfo | None = None,
) -> tuple[KVCache | None, str]:
    """A KVCache from `path` if it was made by this very model, precision and cache precision
    (`info`'s, default the model's own); else (None, why).

    `history` is the templated conversation the cache is for (default: the file's own ids): the
    cache keeps only its longest common prefix with it. `needed` is how many of those tokens it
    must hold for the next turn to prefill nothing of the history (default: all of them). The
    second value is a one-line notice for the user either way, saying how many tokens are reused.
    """
    path = Path(path)
    remove_stale_temp_files(path.parent)
    if not path.is_file():
        return None, "no saved KV cache: the history will be prefilled"
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            info = info or loaded.info
            ids = _check_metadata(metadata, loaded, info)
            starts = _check_starts(metadata, ids, info)
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        _check_tensors(tensors, ids, info, starts)
        _check_checksum(tensors, metadata)
    except _Mismatch as e:
        return None, f"saved KV cache ignored ({e}): the history will be prefilled"
    except Exception as e:  # safetensors raises several types for a damaged file
        return None, f"saved KV cache ignored (unreadable: {one_line(e, 200)}): the history will be prefilled"
    history = ids if history is None else list(history)
    needed = len(history) if needed is None else needed
    reused = common_prefix(ids, history)
    if reused == 0:
        why = "none of its tokens match this conversation"
        return None, f"saved KV cache ignored ({why}): the history will be prefilled"
    cache = _fill(tensors, ids, loaded, info, starts)
    reused = cache.keepable(reused)
    if reused == 0:
        why = "its sliding windows no longer hold where this conversation departs from it"
        return None, f"saved KV cache ignored ({why}): the history will be prefilled"
    cache.crop(reused)
    if reused >= needed:
        return cache, f"KV cache loaded from disk: {reused} tokens, no prefill needed"
    return cache, (
        f"KV cache loaded from disk: {reused} of its {len(ids)} tokens match this conversation; "
        f"the rest of the history ({needed - reused} tokens) will be prefilled"
    )


def held_ids(path: Path, vocab: int) -> list[int] | None:
    """The token ids a cache file says it holds (read from its metadata alone), or None where it
    has none to read. Not checked against the model: `load_cache` does that."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return _token_ids(f.metadata() or {}, vocab)
    except Exception:  # no file, a damaged one, or ids that are not ids: load_cache says which
        return None


class _Mismatch(ValueError):
    """The file is readable but was not made by this model, or does not add up."""


def _check_metadata(metadata: dict[str, str], loaded: LoadedModel, info: ModelInfo) -> list[int]:
    """Compare every field with the model in memory; returns the token ids."""
    if metadata.get("format") != FORMAT:
        raise _Mismatch("not an llmchat KV cache file")
    if metadata.get("format_version") != str(FORMAT_VERSION):
        raise _Mismatch(
            f"format version {metadata.get('format_version')}, this llmchat reads {FORMAT_VERSION}"
        )
    _check_same_model(metadata, loaded, info)
    return _token_ids(metadata, loaded.info.vocab_size)


def _check_same_model(metadata: dict[str, str], loaded: LoadedModel, info: ModelInfo) -> None:
    """Raise _Mismatch unless the file was made by this model with this chat's cache precision."""
    for key, expected in describe(loaded, info).items():
        if key in ("format", "format_version"):  # checked first, by _check_metadata
            continue
        if key == "dtype" and metadata.get(key) != expected:
            made = cache_precision_of(str(metadata.get(key)))
            raise _Mismatch(
                f"its KV cache precision is {made}, this chat's is {cache_precision_of(expected)}"
            )
        if metadata.get(key) != expected:
            raise _Mismatch(_MISMATCH[key].format(made=metadata.get(key), now=expected))


_MISMATCH = {
    "model_spec": "it was made by another model ({made}), not the loaded {now}",
    "model_name": "it was made by another model ({made}), not the loaded {now}",
    "weights": "the loaded model's weights are not the ones it was made with (a changed model file)",
    "precision": "it was made at {made} precision, the model is loaded at {now}",
    "layers": "it was made for a model of {made} layers, the loaded one has {now}",
    "kv_heads": "it was made for a model of {made} K/V heads, the loaded one has {now}",
    "head_dim": "it was made for heads of {made} dimensions, the loaded model's have {now}",
}
"""Why a cache file does not fit the loaded model, in words (the fields of `describe`)."""


def _token_ids(metadata: dict[str, str], vocab: int) -> list[int]:
    """The file's token ids; _Mismatch unless they are ids below `vocab`, as many as it says."""
    try:
        ids = json.loads(metadata["token_ids"])
    except (KeyError, ValueError):
        raise _Mismatch("its token ids are missing or damaged") from None
    if not isinstance(ids, list) or not all(isinstance(i, int) and 0 <= i < vocab for i in ids):
        raise _Mismatch("its token ids are not ids of this model's vocabulary")
    if not ids or metadata.get("tokens") != str(len(ids)):
        raise _Mismatch("its token count does not match its token ids")
    return ids


def _check_starts(metadata: dict[str, str], ids: list[int], info: ModelInfo) -> list[int]:
    """Each layer's first position held: 0, or where a sliding window had dropped the ones before
    (still holding what the next token sees)."""
    if "starts" not in metadata:
        return [0] * info.layers
    try:
        starts = json.loads(metadata["starts"])
    except ValueError:
        raise _Mismatch("its layers' first positions are damaged") from None
    windows = info.layer_windows or (None,) * info.layers
    if not isinstance(starts, list) or len(starts) != info.layers:
        raise _Mismatch("its layers' first positions are not one per layer")
    for start, window in zip(starts, windows):
        if not isinstance(start, int) or start < 0:
            raise _Mismatch("its layers' first positions are damaged")
        if start and (window is None or len(ids) - start < window - 1):
            raise _Mismatch("a layer lacks positions its attention needs")
    return starts


def _check_tensors(
    tensors: dict[str, torch.Tensor], ids: list[int], info: ModelInfo, starts: list[int]
) -> None:
    kinds = ("keys", "values") + (("key_scales", "value_scales") if info.cache_scale_bytes else ())
    expected_names = {f"layers.{i}.{kind}" for i in range(info.layers) for kind in kinds}
    if set(tensors) != expected_names:
        scales = " with their scales" if info.cache_scale_bytes else ""
        raise _Mismatch(f"its tensors are not one K and one V per layer{scales}")
    for name, tensor in tensors.items():
        scales = name.endswith("_scales")
        held = len(ids) - starts[int(name.split(".")[1])]
        shape = (1, info.kv_heads, held) if scales else (1, info.kv_heads, held, info.head_dim)
        dtype = "float32" if scales else info.cache_dtype
        if tuple(tensor.shape) != shape:
            raise _Mismatch(f"{name} has shape {tuple(tensor.shape)}, expected {shape}")
        if str(tensor.dtype).removeprefix("torch.") != dtype:
            raise _Mismatch(f"{name} is {tensor.dtype}, this chat's cache holds {dtype}")
        if not torch.isfinite(tensor).all():
            raise _Mismatch(f"{name} holds NaN or infinite values")


def _check_checksum(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Any change to the file since it was saved (a zeroed tensor, swapped layers, other ids) shows here."""
    stored = metadata.get("checksum")
    if stored is None:
        raise _Mismatch("it has no checksum (written by an older llmchat), so it cannot be verified")
    if checksum(tensors, metadata) != stored:
        raise _Mismatch("its checksum does not match its contents: it was changed or damaged after saving")


def _fill(
    tensors: dict[str, torch.Tensor], ids: list[int], loaded: LoadedModel, info: ModelInfo, starts: list[int]
) -> KVCache:
    """A fresh KVCache holding the loaded positions as stored (int8 with its scales), on the device."""
    device = next(loaded.model.parameters()).device
    cache = KVCache.for_model(info)
    kinds = ("keys", "values") + (("key_scales", "value_scales") if cache.quantized else ())
    for i, layer in enumerate(cache.layers):
        layer.load_positions(*(tensors[f"layers.{i}.{kind}"].to(device) for kind in kinds), start=starts[i])
    cache.appended(ids)
    return cache
