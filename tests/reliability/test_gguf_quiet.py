"""A first start converts the built-in GGUF with nothing drawn on stderr but our own progress
(transformers' GGUF reader draws a tqdm bar there, which in the app runs over the screen), and
reads the file once."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.reliability.endless import private_env

pytestmark = pytest.mark.real_model


def test_the_first_conversion_reads_the_gguf_once_and_draws_no_progress_bar(tmp_path):
    # transformers parsed the file three times (tokenizer, config, weights): ~25 s of a ~50 s first start
    env = private_env(tmp_path) | {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    code = (
        "from pathlib import Path; from engine import gguf_arrays, models\n"
        "parses, reader = [], gguf_arrays.BulkArrayReader\n"
        "gguf_arrays.BulkArrayReader = lambda *a, **k: (parses.append(a), reader(*a, **k))[1]\n"
        "models.convert_gguf(Path(models.resolve('smollm2-135m').location), lambda *a: None)\n"
        "print(len(parses))"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "config.json" in {p.name for p in (tmp_path / "cache").rglob("config.json")}
    assert "de-quantizing" not in done.stderr and "it/s" not in done.stderr, done.stderr[-500:]
    assert done.stdout.split() == ["1"]
