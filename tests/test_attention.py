"""The decode-attention kernel: the same attention as SDPA, over the cache as the step holds it."""

import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import include_paths

from engine.fast import attention, kernels
from engine.kvcache_layers import QuantizedKV, quantize


@pytest.fixture(scope="module")
def kernel():
    problem = kernels.load("step")
    assert problem is None, problem  # CI has a compiler and ninja: the kernel must build
    return attention


@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (4, 4)])
@pytest.mark.parametrize("position", [0, 5, 255, 256, 300, 1023])
def test_kernel_attends_as_sdpa_does(kernel, heads, kv_heads, position):
    torch.manual_seed(position)
    d = 64
    buffer_k = torch.randn(1, kv_heads, 1024, d)  # a cache buffer with room: only 0..position count
    buffer_v = torch.randn(1, kv_heads, 1024, d)
    q = torch.randn(1, heads, 1, d)
    keys, values = buffer_k[:, :, : position + 1], buffer_v[:, :, : position + 1]  # strided views
    expected = F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
    for k, v in ((keys, values), (buffer_k, buffer_v)):  # a view of the cache, or the whole buffer
        grouped = q.reshape(1, kv_heads, heads // kv_heads, d)
        got = kernel.decode(grouped, k, v, torch.tensor([position])).reshape(1, heads, 1, d)
        torch.testing.assert_close(got, expected, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("first, position", [(0, 9), (3, 9), (250, 300), (1000, 1023), (700, 700)])
def test_a_sliding_window_attends_from_its_first_position_only(kernel, first, position):
    """A local layer's window (Gemma 3, Mistral): positions first..position, as SDPA over that slice."""
    torch.manual_seed(first)
    keys, values, q = torch.randn(1, 2, 1024, 64), torch.randn(1, 2, 1024, 64), torch.randn(1, 4, 1, 64)
    window = slice(first, position + 1)
    expected = F.scaled_dot_product_attention(q, keys[:, :, window], values[:, :, window], enable_gqa=True)
    got = kernel.decode(q.reshape(1, 2, 2, 64), keys, values, torch.tensor([position]), torch.tensor([first]))
    torch.testing.assert_close(got.reshape(1, 4, 1, 64), expected, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("tokens, last", [(2, 1), (5, 7), (5, 511), (9, 515), (16, 1023), (5, 600)])
def test_a_verify_s_tokens_attend_each_over_its_own_positions(kernel, threads, window, tokens, last):
    """A verify's n tokens at last-n+1..last in one call, the cache read once for all: token i sees
    the positions up to itself (from its own window's start), as SDPA does with their mask, also
    where a block of the cache holds none of an early token's keys (blocks of 512 or split per
    thread), and over an int8 cache."""
    torch.manual_seed(tokens * 1000 + last)
    kv_heads, group, d = 3, 3, 64
    keys, values = torch.randn(1, kv_heads, 1024, d), torch.randn(1, kv_heads, 1024, d)
    q = torch.randn(1, kv_heads * group, tokens, d)
    position = torch.arange(last - tokens + 1, last + 1)
    first = torch.zeros_like(position) if window is None else (position - window + 1).clamp(min=0)
    slots = torch.arange(1024)
    mask = (slots[None, :] <= position[:, None]) & (slots[None, :] >= first[:, None])
    expected = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
    grouped = q.reshape(1, kv_heads, group, tokens, d).transpose(2, 3).reshape(1, kv_heads, tokens * group, d)
    default = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kernel.decode(grouped, keys, values, position, first)
        quantized = [quantize(x) for x in (keys, values)]
        stored = QuantizedKV(quantized[0][0], quantized[0][1], quantized[1][0], quantized[1][1])
        got_int8 = kernel.decode_int8(grouped, stored, position, first)
    finally:
        torch.set_num_threads(default)
    back = lambda out: out.reshape(1, kv_heads, tokens, group, d).transpose(2, 3).reshape(q.shape)  # noqa: E731
    torch.testing.assert_close(back(got), expected, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(back(got_int8), expected, atol=0.05, rtol=0.05)  # int8's rounding apart


@pytest.mark.parametrize("d", [64, 96, 256, 40, 36])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_head_width_and_cache_type_attends_as_sdpa_does(kernel, d, dtype):
    """Phi-3's heads of 96 and Gemma 3's of 256 beside SmolLM2's 64 (40: 32 and 8; 36, no multiple of 8),
    over each float cache type, one token and a verify's three: what the kernel's tiles of keys
    and of head widths leave over is summed too."""
    torch.manual_seed(d)
    kv_heads, group, length = 2, 3, 523  # a length no tile divides
    keys, values = (torch.randn(1, kv_heads, length, d).to(dtype) for _ in range(2))
    for tokens in (1, 3):
        q = torch.randn(1, kv_heads * group, tokens, d)
        position = torch.arange(length - tokens, length)
        mask = torch.arange(length)[None, :] <= position[:, None]
        expected = F.scaled_dot_product_attention(
            q, keys.float(), values.float(), attn_mask=mask, enable_gqa=True
        )
        grouped = q.reshape(1, kv_heads, group, tokens, d).transpose(2, 3).reshape(1, kv_heads, -1, d)
        got = kernel.decode(grouped, keys, values, position, torch.zeros_like(position))
        got = got.reshape(1, kv_heads, tokens, group, d).transpose(2, 3).reshape(q.shape)
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("position", [63, 300, 1022])
def test_the_cache_is_split_evenly_over_any_number_of_threads(kernel, threads, position):
    # Each head's positions go in as many equal blocks as make the tasks a multiple of the
    # threads (3 heads on 4 threads: 4 blocks a head); the merged partials are SDPA's answer.
    torch.manual_seed(threads)
    keys, values, q = torch.randn(1, 3, 1024, 64), torch.randn(1, 3, 1024, 64), torch.randn(1, 9, 1, 64)
    length = position + 1
    expected = F.scaled_dot_product_attention(q, keys[:, :, :length], values[:, :, :length], enable_gqa=True)
    default = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kernel.decode(q.reshape(1, 3, 3, 64), keys, values, torch.tensor([position]))
    finally:
        torch.set_num_threads(default)
    torch.testing.assert_close(got.reshape(1, 9, 1, 64), expected, atol=2e-6, rtol=1e-5)


def test_kernel_is_used_for_the_cache_types_it_reads_on_the_cpu(kernel):
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int8):  # as stored (int8: + scales)
        assert kernel.can_attend(torch.zeros(1, 3, 8, 64, dtype=dtype))
    assert not kernel.can_attend(torch.zeros(1, 3, 8, 64, dtype=torch.float64))


CPUS = ("x86-64-v3", "x86-64", "skylake-avx512", "cooperlake")
"""AVX2 machines, plain x86-64, AVX-512 without and with bfloat16 dot products (the matvec's paths)."""


def _cpu_paths(source: Path) -> bool:
    """Whether `source`, or a file of ours it includes, has code for some CPUs only."""
    text = source.read_text()
    included = re.findall(r'#include "([^"]+)"', text)
    return "__AVX" in text or any(_cpu_paths(source.parent / name) for name in included)


def test_the_kernel_sources_compile_for_every_x86_cpu():
    """The kernels are built with -march=native: each CPU's paths must compile, the others fall away.
    The compilers run side by side (~10 s each on a 2-core machine, most of it torch's headers)."""
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("needs a C++ compiler targeting x86-64")
    flags = [f for f in kernels.FLAGS if not f.startswith("-march")]
    includes = [f"-I{path}" for path in (*include_paths(), sysconfig.get_paths()["include"])]
    # what is built, each library's one unit, where it has paths for some CPUs only
    sources = [str(source) for source in kernels.KERNELS.values() if _cpu_paths(source)]
    assert sources
    compiles = {
        cpu: subprocess.Popen(
            [compiler, "-std=c++17", "-fsyntax-only", f"-march={cpu}", *flags, *includes, *sources],
            stderr=subprocess.PIPE,
            text=True,
        )
        for cpu in CPUS
    }
    failed = {}
    for cpu, compile in compiles.items():
        _, stderr = compile.communicate(timeout=600)
        if compile.returncode != 0:
            failed[cpu] = [line for line in stderr.splitlines() if "error" in line][:5]
    assert not failed, failed


def _in_a_fresh_process(code: str, **env: str) -> str:
    """The last line `code` printed, run by this Python with `env` added."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def built():
    """The step's kernel built in llmchat's cache by a process of its own, as the app builds it
    (this process may hold one loaded from another test's private cache, since removed)."""
    code = "from engine.fast import kernels; print(kernels.load('step'))"
    assert _in_a_fresh_process(code) == "None"


def test_a_built_kernel_loads_without_the_builder_and_a_missing_one_is_not_built(built, tmp_path):
    """`ask` takes the kernels an earlier run built (a dlopen) and never starts a build of seconds."""
    code = """
        import sys
        from engine.fast import kernels
        builder = "torch.utils.cpp_extension" in sys.modules
        print(kernels.load_built("step"), kernels.is_loaded("step"), builder)
    """
    assert _in_a_fresh_process(code) == "True True False"
    assert _in_a_fresh_process(code, XDG_CACHE_HOME=str(tmp_path)) == "False False False"
    assert not list(tmp_path.rglob("*.so"))


def test_ask_decodes_with_the_built_kernels(built, tiny_model_dir, tmp_path):
    """Before, `ask` ran torch's ops though the app had built the kernels (w8: 19 tok/s, not 100)."""
    code = f"""
        import json
        from typer.testing import CliRunner
        from tui.cli import app
        args = ["ask", "--json", "--no-save", "-n", "3", "-m", {str(tiny_model_dir)!r}, "hi"]
        lines = CliRunner().invoke(app, args).output.splitlines()
        print([json.loads(line)["attention"] for line in lines if '"decode_step"' in line])
    """
    data = str(tmp_path / "data")
    assert _in_a_fresh_process(code, LLMCHAT_COMPILE="1", LLMCHAT_DATA_DIR=data) == "['kernel']"
    off = _in_a_fresh_process(code, LLMCHAT_COMPILE="0", LLMCHAT_DATA_DIR=data)
    assert off == "['SDPA']"  # --no-compile / LLMCHAT_COMPILE=0: torch's ops, as before
