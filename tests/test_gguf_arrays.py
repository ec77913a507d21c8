"""The conversion's GGUF reader (engine/gguf_arrays.py) gives every metadata value and tensor that
gguf's own reader gives, as transformers reads them, on a file written here with each kind of
array; on the built-in model's file too, and its conversion is byte for byte the same."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter
from transformers.integrations.ggml import _gguf_parse_value

from engine.gguf_arrays import BulkArrayReader


def _values(reader: GGUFReader) -> dict[str, tuple]:
    """Every field as transformers reads it (or the error it raises: it reads no nested array),
    and as gguf's `contents` gives it."""
    return {name: (_parsed(field), field.contents(), field.types) for name, field in reader.fields.items()}


def _parsed(field) -> list | str:
    try:
        return [_gguf_parse_value(field.parts[i], field.types) for i in field.data]
    except ValueError as e:
        return str(e)


def _same(mine: GGUFReader, theirs: GGUFReader) -> None:
    assert _values(mine) == _values(theirs)
    assert [(t.name, t.tensor_type, t.shape.tolist()) for t in mine.tensors] == [
        (t.name, t.tensor_type, t.shape.tolist()) for t in theirs.tensors
    ]
    for a, b in zip(mine.tensors, theirs.tensors):
        assert np.array_equal(a.data, b.data)


def test_each_kind_of_array_reads_as_gguf_reads_it(tmp_path):
    path = tmp_path / "arrays.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_array("test.strings", ["<pad>", "▁the", "é", "", "日本語", "a" * 300])
    writer.add_array("test.floats", [-1000.0, 0.5, 3.25])
    writer.add_array("test.ints", [3, 1, 4, 1, 5])
    writer.add_array("test.bools", [True, False])
    writer.add_array("test.empty", [])
    writer.add_array("test.nested", [[1, 2], [3, 4]])
    writer.add_string("test.name", "tiny")
    writer.add_uint32("test.count", 7)
    writer.add_tensor("weights", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    mine, theirs = BulkArrayReader(path), GGUFReader(path)
    _same(mine, theirs)
    assert mine.fields["test.strings"].contents() == ["<pad>", "▁the", "é", "", "日本語", "a" * 300]


@pytest.mark.real_model
def test_the_built_in_models_file_reads_as_gguf_reads_it(smollm2):
    from engine import models

    gguf = models.resolve(models.DEFAULT_MODEL).location
    _same(BulkArrayReader(gguf), GGUFReader(gguf))
