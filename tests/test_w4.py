"""w4: llama.cpp's Q4_0 blocks at load, the matvec kernel against the dequantized matrix, and a
tiny Llama's fast path against its own dequantized-fp32 reference."""

import copy

import numpy as np
import pytest
import torch
from torch import nn

from engine import models
from engine.fast import fused, kernels, matvec
from engine.instruments.precision_compare import compare_precisions
from engine.kvcache import KVCache
from engine.quant import w4, w8
from engine.quant.precision import PrecisionError, cpu_note, precision_for
from engine.session import ChatSession, Message

STEPS = 32


@pytest.fixture(scope="module")
def kernel():
    problem = kernels.load("step")
    assert problem is None, problem  # CI has a compiler and ninja: the kernel must build
    return matvec


def test_a_block_is_quantized_as_llama_cpp_does():
    block = torch.arange(-16, 16, dtype=torch.float32) / 2  # -8 has the largest |w|: the scale is 1
    q, scale = w4.quantize_blocks(block[None])
    assert scale.dtype == torch.float16 and scale.tolist() == [[1.0]]
    assert q.dtype == torch.uint8 and q.shape == (1, 16)
    assert q[0, 0].item() == 0x80  # value 0 (w -8, q 0) low, value 16 (w 0, q 8) high
    values = w4.dequantize(q, scale)[0]
    assert values[0] == -8 and values[1] == -7 and values[-1] == 7  # -7.5 rounds up, 7.5 clamps to 7


def test_blocks_are_byte_for_byte_those_of_ggufs_q4_0():
    quants = pytest.importorskip("gguf.quants")
    torch.manual_seed(0)
    weight = torch.randn(8, 96)
    q, scale = w4.quantize_blocks(weight)
    theirs = quants.quantize(weight.numpy(), quants.GGMLQuantizationType.Q4_0).reshape(8, 3, 18)
    assert np.array_equal(theirs[..., :2].copy().view(np.float16)[..., 0], scale.numpy())
    assert np.array_equal(theirs[..., 2:].reshape(8, 48), q.numpy())


def test_the_module_multiplies_by_the_dequantized_matrix_and_stays_near_the_float_one():
    torch.manual_seed(0)
    linear = nn.Linear(256, 96, bias=False)
    quantized = w4.W4Linear.from_linear(linear)
    x = torch.randn(4, 256)
    with torch.inference_mode():
        torch.testing.assert_close(quantized(x), x @ quantized.dequantized().T, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(quantized.matvec(x[:1]), quantized(x[:1]), rtol=1e-5, atol=1e-5)
        error = ((quantized(x) - linear(x)).norm() / linear(x).norm()).item()
    assert 0 < error < 0.15  # 16 levels a block: coarser than w8's ~0.005


def test_a_width_not_a_multiple_of_32_is_refused_and_its_layer_stays_float():
    with pytest.raises(ValueError, match="multiple of 32"):
        w4.quantize_blocks(torch.randn(4, 48))
    model = nn.Sequential(nn.Linear(64, 8, bias=False), nn.Linear(8, 48, bias=False))
    assert w4.quantize_linears(model) == ["1"]
    assert isinstance(model[0], w4.W4Linear) and isinstance(model[1], nn.Linear)


def test_fused_rows_are_views_and_each_module_keeps_its_answer():
    torch.manual_seed(0)
    modules = [w4.W4Linear.from_linear(nn.Linear(64, rows, bias=False)) for rows in (32, 16)]
    x = torch.randn(3, 64)
    with torch.inference_mode():
        before = [m(x) for m in modules]
        fused_module = w4.W4Linear.fuse(modules)
        assert fused_module.q.shape == (48, 32) and fused_module.scale.shape == (48, 2)
        for module, answer in zip(modules, before):
            assert module.q.untyped_storage().data_ptr() == fused_module.q.untyped_storage().data_ptr()
            torch.testing.assert_close(module(x), answer)


def test_w4_is_a_cpu_precision_with_a_note():
    with pytest.raises(PrecisionError, match="CPU precision"):
        precision_for("w4", "cuda")
    assert precision_for("w4", "cpu").cache_dtype == torch.float32 and precision_for("w4", "cpu").bits == 4
    assert "Q4_0" in cpu_note("w4")


# Widths: one block, odd counts (3, 5, 7: the kernel's steps of 4 and 2 blocks and a last one),
# SmolLM2's hidden and MLP widths (not all multiples of 16 blocks).
@pytest.mark.parametrize("rows, width", [(7, 32), (65, 96), (9, 160), (9, 224), (3072, 576), (5, 1536)])
@pytest.mark.parametrize("n", [1, 2, 5, 16])
def test_kernel_streams_q4_0_blocks_as_the_dequantized_matrix_multiplies(kernel, rows, width, n):
    torch.manual_seed(rows * n)
    q, scale = w4.quantize_blocks(torch.randn(rows, width))
    x = torch.randn(n, width)
    got = kernel.multiply_q4(x, q, scale)
    weight = w4.dequantize(q, scale).double()
    exact = x.double() @ weight.T
    assert got.shape == (n, rows) and got.dtype == torch.float32
    floats = 2e-6 * width**0.5 * exact.abs().max().item()
    if n == 1:  # one row: x within half a step of 1/32767 of its largest |x| (w8's rounding), summed
        rounding = x.abs().max().double() / 32767 / 2 * weight.abs().sum(1)
        assert ((got.double() - exact).abs() <= rounding + floats).all()
    else:  # several: x as it is, each row widened to float32
        torch.testing.assert_close(got.double(), exact, atol=floats, rtol=1e-5)


def test_one_row_of_x_that_integers_cannot_carry_is_summed_in_floats(kernel):
    weight = torch.randn(4, 64)  # unseeded: the suite's order decides the draw
    weight[:, 3] = 1  # never rounded to 0: 1e30 below decides each row (a 0 there failed the test)
    q, scale = w4.quantize_blocks(weight)
    x = torch.randn(1, 64)
    x[0, 3] = float("inf")
    assert kernel.multiply_q4(x, q, scale).isinf().any()
    x[0, 3] = 1e30  # finite, rounded over its own largest value: the others vanish, this one stays
    torch.testing.assert_close(
        kernel.multiply_q4(x, q, scale), x @ w4.dequantize(q, scale).T, rtol=1e-4, atol=0
    )


def test_kernel_refuses_what_is_not_q4_0_in_one_line(kernel):
    q, scale = w4.quantize_blocks(torch.randn(4, 64))
    with pytest.raises(RuntimeError, match="one float16 scale per block"):
        kernel.multiply_q4(torch.randn(1, 64), q, scale.float())
    with pytest.raises(RuntimeError, match="at most 16 rows"):
        kernel.multiply_q4(torch.randn(17, 64), q, scale)


def dequantized_copy(model: nn.Module) -> nn.Module:
    """The model with each W4Linear back as an nn.Linear of the matrix its blocks stand for."""
    reference = copy.deepcopy(model)
    for parent in list(reference.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, w4.W4Linear):
                linear = nn.Linear(child.in_features, child.out_features, bias=False)
                linear.weight = nn.Parameter(child.dequantized(), requires_grad=False)
                setattr(parent, name, linear)
    return reference


def test_tiny_w4_decodes_as_its_dequantized_fp32_reference(tiny_model_dir, tiny_loaded, kernel):
    loaded = models.load(str(tiny_model_dir), "w4", "cpu")
    assert not any(isinstance(m, nn.Linear) for m in loaded.model.modules())
    assert loaded.info.parameters == tiny_loaded.info.parameters
    assert loaded.info.weight_bytes < tiny_loaded.info.weight_bytes
    fast, cache = fused.FastLlama(loaded.model), KVCache.for_model(loaded.info)
    tokens = loaded.tokenizer("How does inference work?")["input_ids"]
    prompt, rows = len(tokens), []
    with torch.inference_mode():
        logits = fast.forward(torch.tensor([tokens]), cache)
        cache.appended(tokens)
        for _ in range(STEPS):  # one row a step: the kernel's rows_q4
            rows.append(logits)
            tokens.append(int(logits.argmax()))
            logits = fast.forward(torch.tensor([tokens[-1:]]), cache)
            cache.appended(tokens[-1:])
        rows.append(logits)
        reference = dequantized_copy(loaded.model)(input_ids=torch.tensor([tokens])).logits[0, prompt - 1 :]
    mine = torch.stack(rows)
    assert torch.equal(mine.argmax(-1), reference.argmax(-1))
    torch.testing.assert_close(mine, reference, atol=1e-3, rtol=1e-4)
    assert len(set(tokens[prompt:])) > 3


def test_f8_compares_w4_with_fp32(tiny_model_dir, tiny_loaded):
    loaded = models.load(str(tiny_model_dir), "w4", "cpu")
    ids = ChatSession(tiny_loaded).template([Message("user", "How does inference work?")])
    result = compare_precisions(tiny_loaded, loaded, ids, max_new_tokens=12)
    assert (result.reference.precision, result.other.precision) == ("fp32", "w4")
    assert 0.0 <= result.agreement <= 1.0 and result.mean_kl > 0
    assert result.other.weight_bytes < 0.5 * result.reference.weight_bytes


def test_a_verify_of_several_rows_gives_each_rows_own_logits(tiny_model_dir, kernel):
    """2 to 16 rows through the kernel's rows_many (a verify, the lab's batch) score each token
    as one row at a time does."""
    loaded = models.load(str(tiny_model_dir), "w4", "cpu")
    ids = loaded.tokenizer("How does inference work? Prefill then decode.")["input_ids"]
    fast = fused.FastLlama(loaded.model)
    with torch.inference_mode():
        cache = KVCache.for_model(loaded.info)
        fast.forward(torch.tensor([ids[:-5]]), cache)
        cache.appended(ids[:-5])
        every = fast.forward(torch.tensor([ids[-5:]]), cache, every=True)
        one = KVCache.for_model(loaded.info)
        singles = []
        for i, token in enumerate(ids):
            logits = fast.forward(torch.tensor([[token]]), one)
            one.appended([token])
            if i >= len(ids) - 5:
                singles.append(logits)
    torch.testing.assert_close(every, torch.stack(singles), atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("width", ["w4", "w8"])
def test_a_prefill_multiplies_in_bf16_where_the_cpu_has_bf16_products(monkeypatch, width):
    """More rows than the rows kernel takes (a prefill) go through a bf16 matmul where the CPU
    multiplies bf16 natively, at twice float32's rate: near the quantized matrix's exact product
    (x rounded to bf16), far nearer than the quantized weights are to the float ones."""
    torch.manual_seed(0)
    linear = nn.Linear(256, 96, bias=False)
    if width == "w4":
        quantized = w4.W4Linear.from_linear(linear)
        matrix = quantized.dequantized()
    else:
        quantized = w8.W8Linear.from_linear(linear)
        matrix = quantized.q.float() * quantized.scale[:, None]
    x = torch.randn(matvec.MAX_ROWS + 1, 256)
    exact = x @ matrix.T
    with torch.inference_mode():
        monkeypatch.setattr(w8, "cpu_matmul_native", lambda dtype: True)
        in_bf16 = quantized(x)
        monkeypatch.setattr(w8, "cpu_matmul_native", lambda dtype: False)
        in_fp32 = quantized(x)
    assert in_bf16.dtype == in_fp32.dtype == torch.float32
    torch.testing.assert_close(in_fp32, exact, rtol=1e-5, atol=1e-5)
    assert not torch.equal(in_bf16, in_fp32)  # the bf16 path ran
    assert ((in_bf16 - exact).norm() / exact.norm()).item() < 0.01
    torch.testing.assert_close(quantized(x[:4]), exact[:4], rtol=1e-5, atol=1e-5)  # a few rows: float32
