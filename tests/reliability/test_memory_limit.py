"""Issue 31: under `ulimit -v` of 0.6-1.4 GB, `ask` ended in MemoryError and "unable to mmap"
tracebacks. Each limit now ends in one line: the answer, or not enough memory, with what the
model's weights need at the precision asked for."""

from __future__ import annotations

import math
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from engine import models
from tests.tiny import build_tiny_model

ROOT = Path(__file__).resolve().parents[2]
LIMITS_MIB = range(600, 2100, 100)
"""Address-space limits from below what importing torch needs to enough for the whole answer."""


@pytest.fixture(scope="module")
def model_165mb(tmp_path_factory) -> Path:
    """A random-weight model of ~165 MB at fp32: big enough that a limit can let torch in and keep it out."""
    return build_tiny_model(tmp_path_factory.mktemp("big-llama"), layers=8, hidden=768)


def _ask_under(limit_mib: int, model: Path) -> subprocess.CompletedProcess:
    def cap() -> None:
        limit = limit_mib * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return subprocess.run(
        [sys.executable, "-m", "tui.cli", "ask", "--model", str(model), "--device", "cpu", "-n", "2", "hi"],
        cwd=ROOT,
        env={**os.environ, "MALLOC_ARENA_MAX": "2", "OPENBLAS_NUM_THREADS": "1"},
        preexec_fn=cap,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_each_memory_limit_ends_in_one_line_that_says_what_the_model_needs(model_165mb):
    needs = math.ceil(models.parameters_on_disk(model_165mb) * 4 / 2**20)
    said = []
    for limit in LIMITS_MIB:
        done = _ask_under(limit, model_165mb)
        if done.returncode == 0:
            break
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in done.stderr, f"{limit} MiB:\n{done.stderr}"
        assert lines[0].startswith("llmchat: not enough memory"), f"{limit} MiB: {lines[0]}"
        said.append(lines[0])
    else:
        pytest.fail(f"no answer even under {LIMITS_MIB[-1]} MiB")
    wanted = f"not enough memory for this model at this precision (needs ~{needs} MiB)"
    assert any(wanted in line for line in said), said


SHORTAGE = "llmchat: not enough memory to start (raise the limit: ulimit -v)"


def _run_raising(error: str, limit_above_mapped_mib: int | None = None) -> tuple[int, list[str]]:
    """`llmchat` whose command raises `error` (Python source), under an address-space limit that
    many MiB above what the process has mapped (None: no limit): (exit status, stderr's lines)."""
    script = "import errno, os, resource, tui.cli as cli\n"
    if limit_above_mapped_mib is not None:
        script += "mapped = int(open('/proc/self/statm').read().split()[0]) * os.sysconf('SC_PAGE_SIZE')\n"
        script += f"limit = mapped + {limit_above_mapped_mib} * 2**20\n"
        script += "resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))\n"
    script += f"def command(): raise {error}\ncli.app = command\ncli.run()\n"
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    return done.returncode, done.stderr.strip().splitlines()


def test_an_import_that_cannot_list_its_folder_is_out_of_memory_too():
    """Under ~560 MiB an import can fail listing its package's folder (OSError ENOMEM, not
    MemoryError): this printed a traceback; it is the same one line as any other shortage."""
    code, said = _run_raising("OSError(errno.ENOMEM, 'Cannot allocate memory', 'site-packages/tqdm')")
    assert code == 1 and said == [SHORTAGE], said


@pytest.mark.parametrize("limited", [True, False])
def test_an_error_at_the_memory_limit_is_a_shortage_and_elsewhere_a_traceback(limited):
    """At the limit's edge CPython can lose the MemoryError of a failed import and raise
    "SystemError: error return without exception set": one line there, a traceback anywhere else."""
    code, said = _run_raising("SystemError('error return without exception set')", 64 if limited else None)
    assert code == 1
    if limited:
        assert said == [SHORTAGE], said
    else:
        assert said[0] == "Traceback (most recent call last):" and said[-1].startswith("SystemError"), said
