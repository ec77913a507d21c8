"""The eager forward's RMSNorm kernel (engine/fast/rms_norm.cpp): torch's rms_norm in one call."""

import pytest
import torch
import torch.nn.functional as F

from engine.fast import kernels, norm


@pytest.fixture(scope="module")
def loaded():
    problem = kernels.load("step")
    assert problem is None, problem  # CI has a compiler and ninja: the kernel must build


# A step's one row, a verify's five, a prefill's hundreds (split across threads); SmolLM2's hidden
# size, a q/k norm's head (Qwen3, Gemma 3), and a width past every vector step's multiple.
@pytest.mark.parametrize("shape", [(1, 576), (5, 576), (300, 576), (3, 4, 64), (2, 33)])
def test_the_kernel_normalizes_as_torch_does(loaded, shape):
    torch.manual_seed(sum(shape))
    x, weight = torch.randn(shape) * 3, torch.randn(shape[-1]) + 1  # + 1: Gemma's (1 + w) folded in
    assert norm.in_kernel(x, weight)
    got = norm.rms_norm(x, weight, 1e-6)
    wide = x.double()
    exact = (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()).float()
    assert got.shape == x.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, exact, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, F.rms_norm(x, (shape[-1],), weight, 1e-6), atol=1e-5, rtol=1e-5)


def test_a_zero_row_stays_zero_and_eps_is_used(loaded):
    x = torch.zeros(2, 576)
    x[1] = 1e-4  # mean square 1e-8: eps (1e-2 here) dominates, as torch's would
    got = norm.rms_norm(x, torch.ones(576), 1e-2)
    assert torch.equal(got[0], torch.zeros(576))
    torch.testing.assert_close(got[1], torch.full((576,), 1e-4 / (1e-8 + 1e-2) ** 0.5))


def test_what_the_kernel_does_not_take_goes_to_torch(loaded):
    """16-bit activations (a GPU's, never a CPU step's), a strided view: torch's rms_norm answers."""
    weight = torch.randn(64)
    half = torch.randn(3, 64).to(torch.bfloat16)
    assert not norm.in_kernel(half, weight.to(torch.bfloat16))
    strided = torch.randn(3, 128)[:, ::2]
    assert not norm.in_kernel(strided, weight)
    torch.testing.assert_close(norm.rms_norm(strided, weight, 1e-6), F.rms_norm(strided, (64,), weight, 1e-6))


def test_a_compiled_function_keeps_torchs_norm(loaded):
    """Traced, the check is false before it looks at the kernel: Inductor fuses torch's norm."""
    seen = []

    def normed(x, weight):
        seen.append(norm.in_kernel(x, weight))
        return norm.rms_norm(x, weight, 1e-6)

    x, weight = torch.randn(2, 576), torch.randn(576)
    compiled = torch.compile(normed, fullgraph=True)
    torch.testing.assert_close(compiled(x, weight), F.rms_norm(x, (576,), weight, 1e-6))
    assert seen == [False]  # the trace's one call
