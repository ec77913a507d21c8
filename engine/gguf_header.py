"""A GGUF file's key-value header, read without the `gguf` package: its reader also parses every
tensor and the whole vocabulary (11 s for SmolLM2's file on a busy 2-core machine; this, 0.1 s),
for the few numbers llmchat wants (a server's KV-cache shape, a model's sampling defaults)."""

from __future__ import annotations

import struct
from pathlib import Path

_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9


def gguf_metadata(path: Path) -> dict[str, object]:
    """A GGUF file's key-value header, arrays skipped (the `gguf` package's reader also parses
    every tensor and the whole vocabulary: seconds, for a few numbers)."""
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError("not a GGUF file")
        _version, _tensors, count = struct.unpack("<IQQ", f.read(20))
        meta: dict[str, object] = {}
        for _ in range(count):
            key = _string(f)
            kind = struct.unpack("<I", f.read(4))[0]
            meta[key] = _read(f, kind)
        return meta


def _read(f, kind: int) -> object:
    if kind in _SCALARS:
        fmt = _SCALARS[kind]
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
    if kind == _STRING:
        return _string(f)
    if kind == _ARRAY:
        item, length = struct.unpack("<IQ", f.read(12))
        if item in _SCALARS:
            f.seek(length * struct.calcsize(_SCALARS[item]), 1)
        else:
            for _ in range(length):
                _read(f, item)
        return None
    raise ValueError(f"unknown GGUF value type {kind}")


def _string(f) -> str:
    (length,) = struct.unpack("<Q", f.read(8))
    return f.read(length).decode("utf-8", errors="replace")
