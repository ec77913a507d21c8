"""gguf's file reader with its metadata arrays read in bulk, for a first start's conversion.

`gguf.GGUFReader` reads each element of a metadata array as numpy views of its memory map, one
element at a time: Gemma 3's 262,144-entry vocabulary (its tokens, scores and types) made ~4.9M
of them, ~17 s of a ~40 s conversion, and transformers then read each back through `list()` over
numpy scalars. Here an array of numbers is read as one array and handed out a row per element,
and an array of strings as one bytes object per element: the same values where transformers
reads them (`field.parts[i]` for each i in `field.data`), at a fraction of the cost.
"""

from __future__ import annotations

import struct

import numpy as np
from gguf import GGUFReader, GGUFValueType


class _Text(bytes):
    """One string element: `list()` gives its bytes as transformers reads them; `tobytes` and
    `nbytes` as gguf's own `ReaderField.contents` and size sums read a numpy part."""

    def tobytes(self) -> bytes:
        return bytes(self)

    @property
    def nbytes(self) -> int:
        return len(self)


class BulkArrayReader(GGUFReader):
    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        length = self._get(orig_offs + 4, np.uint64)
        itype, count, offs = GGUFValueType(int(raw_itype[0])), int(length[0]), orig_offs + 12
        if itype == GGUFValueType.STRING and self.byte_order == "I":
            elements, offs = self._strings(offs, count)
        elif itype in self.gguf_scalar_to_np:
            values = np.array(self._get(offs, self.gguf_scalar_to_np[itype], count))  # out of the map
            elements, offs = list(values.reshape(count, 1)), offs + values.nbytes
        else:  # nested arrays, a byte order of its own: gguf's reader, element by element
            return super()._get_field_parts(orig_offs, raw_type)
        types = [GGUFValueType.ARRAY, itype] if count else [GGUFValueType.ARRAY]  # as gguf's reader
        return offs - orig_offs, [raw_itype, length, *elements], list(range(2, 2 + count)), types

    def _strings(self, offs: int, count: int) -> tuple[list[_Text], int]:
        """`count` strings from `offs`, each a u64 length (the file's byte order, this machine's
        here) then its bytes."""
        view, texts = memoryview(self.data), []
        for _ in range(count):
            (size,) = struct.unpack_from("=Q", view, offs)
            texts.append(_Text(view[offs + 8 : offs + 8 + size]))
            offs += 8 + size
        return texts, offs
