"""w8a8: int8 weights and activations through fbgemm, smoothed, fused, and honest about its bytes."""

import pytest
import torch
from torch import nn

from engine import models
from engine.quant import int8
from engine.quant.precision import PrecisionError, precision_for
from tests.quantized import answer_against_fp32, greedy_tokens

pytestmark = pytest.mark.skipif(int8.available() is not None, reason="no fbgemm in this torch")


def _relative_error(y: torch.Tensor, reference: torch.Tensor) -> float:
    return ((y - reference).norm() / reference.norm()).item()


def test_quantized_linear_tracks_the_float_product():
    torch.manual_seed(0)
    linear = nn.Linear(256, 96, bias=False)
    x = torch.randn(4, 256)
    quantized = int8.Int8Linear.from_linear(linear, torch.ones(256))
    with torch.inference_mode():
        error = _relative_error(quantized(x), linear(x))
    assert 0 < error < 0.05  # rounded (not a float copy), yet close


def test_smoothing_rescues_inputs_with_outlier_channels():
    """Two channels 60x larger than the rest: one 7-bit grid per token cannot fit both without smoothing."""
    torch.manual_seed(0)
    linear = nn.Linear(256, 96, bias=False)
    x = torch.randn(8, 256)
    x[:, :2] *= 60
    plain = int8.Int8Linear.from_linear(linear, torch.ones(256))
    smooth = int8.Int8Linear.from_linear(linear, x.abs().amax(0) ** int8.ALPHA)
    with torch.inference_mode():
        reference = linear(x)
        assert _relative_error(smooth(x), reference) < 0.5 * _relative_error(plain(x), reference)


def test_fused_modules_answer_with_their_rows_and_own_no_bytes():
    torch.manual_seed(0)
    smooth = torch.rand(64) + 0.5
    parts = [int8.Int8Linear.from_linear(nn.Linear(64, rows, bias=False), smooth) for rows in (32, 16, 16)]
    x = torch.randn(3, 64)
    with torch.inference_mode():
        before = [p(x) for p in parts]
        fused = int8.Int8Linear.fuse(parts)
        after = [p(x) for p in parts]
        stacked = fused(x)
    for b, a in zip(before, after):
        assert torch.allclose(a, b, atol=1e-5)
    assert torch.allclose(stacked, torch.cat(before, dim=-1), atol=1e-5)
    assert fused.weight_bytes == 64 * (64 + 4) and all(p.weight_bytes == 0 for p in parts)


def test_linears_with_different_inputs_do_not_fuse():
    a = int8.Int8Linear.from_linear(nn.Linear(8, 4, bias=False), torch.ones(8))
    b = int8.Int8Linear.from_linear(nn.Linear(8, 4, bias=False), torch.full((8,), 2.0))
    with pytest.raises(ValueError, match="share their input"):
        int8.Int8Linear.fuse([a, b])


def test_w8a8_is_a_cpu_precision():
    with pytest.raises(PrecisionError, match="CPU kernels"):
        precision_for("w8a8", "cuda")
    assert precision_for("w8a8", "cpu").dtype == torch.float32  # activations and cache stay fp32


def test_tiny_w8a8_weights_take_about_a_quarter_and_fast_path_matches_reference(tiny_model_dir, tiny_loaded):
    loaded = models.load(str(tiny_model_dir), "w8a8", "cpu")
    assert not any(isinstance(m, nn.Linear) for m in loaded.model.modules())
    matrices = sum(m.weight_bytes for m in loaded.model.modules() if isinstance(m, int8.Int8Linear))
    assert loaded.info.weight_bytes == loaded.model.get_memory_footprint() + matrices
    assert loaded.info.parameters == tiny_loaded.info.parameters
    assert greedy_tokens(tiny_model_dir, "w8a8", fast=True) == greedy_tokens(
        tiny_model_dir, "w8a8", fast=False
    )


@pytest.mark.real_model
def test_smollm2_w8a8_answers_and_stays_near_fp32(smollm2):
    loaded = models.load(models.DEFAULT_MODEL, "w8a8", "cpu")
    assert loaded.info.weight_bytes < 0.55 * smollm2.info.weight_bytes  # int8 matrices, fp32 embedding
    answer, compared = answer_against_fp32(smollm2, loaded)
    assert "Paris" in answer
    assert compared.agreement >= 0.6 and compared.mean_kl < 0.5  # measured: ~0.85 and ~0.06 nats
