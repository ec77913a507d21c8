"""w8: int8 weights with float activations, fused as views, close to fp32 on the real model."""

import pytest
import torch
from torch import nn

from engine import models
from engine.quant import w8
from engine.quant.precision import PrecisionError, precision_for
from tests.quantized import answer_against_fp32, greedy_tokens


def _relative_error(y: torch.Tensor, reference: torch.Tensor) -> float:
    return ((y - reference).norm() / reference.norm()).item()


def test_weights_are_int8_and_the_product_stays_close():
    torch.manual_seed(0)
    linear = nn.Linear(256, 96, bias=False)
    quantized = w8.W8Linear.from_linear(linear)
    assert quantized.q.dtype == torch.int8 and quantized.q.shape == (96, 256)
    x = torch.randn(4, 256)
    with torch.inference_mode():
        assert 0 < _relative_error(quantized(x), linear(x)) < 0.01  # rounded, yet close
        one = x[:1]
        torch.testing.assert_close(quantized.matvec(one), quantized(one))  # the compiled step's form


def test_fused_rows_are_views_and_each_module_keeps_its_answer():
    torch.manual_seed(0)
    modules = [w8.W8Linear.from_linear(nn.Linear(64, rows, bias=False)) for rows in (32, 16)]
    x = torch.randn(3, 64)
    with torch.inference_mode():
        before = [m(x) for m in modules]
        fused = w8.W8Linear.fuse(modules)
        assert fused.q.shape == (48, 64)
        for module, answer in zip(modules, before):
            assert module.q.untyped_storage().data_ptr() == fused.q.untyped_storage().data_ptr()  # not a copy
            torch.testing.assert_close(module(x), answer)


def test_w8_is_a_cpu_precision():
    with pytest.raises(PrecisionError, match="CPU precision"):
        precision_for("w8", "cuda")
    assert precision_for("w8", "cpu").cache_dtype == torch.float32


def test_tiny_w8_counts_its_bytes_and_the_fast_path_matches_the_reference(tiny_model_dir, tiny_loaded):
    loaded = models.load(str(tiny_model_dir), "w8", "cpu")
    assert not any(isinstance(m, nn.Linear) for m in loaded.model.modules())
    assert loaded.info.parameters == tiny_loaded.info.parameters
    assert loaded.info.weight_bytes == loaded.model.get_memory_footprint()  # int8 buffers are tensors
    assert loaded.info.weight_bytes < tiny_loaded.info.weight_bytes
    assert greedy_tokens(tiny_model_dir, "w8", fast=True) == greedy_tokens(tiny_model_dir, "w8", fast=False)


@pytest.mark.real_model
def test_smollm2_w8_answers_and_stays_near_fp32(smollm2):
    loaded = models.load(models.DEFAULT_MODEL, "w8", "cpu")
    assert loaded.info.weight_bytes < 0.5 * smollm2.info.weight_bytes  # int8 matrices, fp32 embedding
    answer, compared = answer_against_fp32(smollm2, loaded)
    assert "Paris" in answer
    assert compared.agreement >= 0.9 and compared.mean_kl < 0.05  # w8a8 here: ~0.85 and ~0.06 nats
