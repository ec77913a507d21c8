"""The matvec kernel: x @ W.T as the step's loop computes it, and a compiled step that calls it."""

import pytest
import torch

from engine.fast import kernels, matvec


@pytest.fixture(scope="module")
def kernel():
    problem = kernels.load("step")
    assert problem is None, problem  # CI has a compiler and ninja: the kernel must build
    return matvec


# Rows: odd (a pair and one left over), and a model's; in: past each vector step's multiple or not.
@pytest.mark.parametrize("rows, width", [(1, 16), (7, 576), (64, 200), (3072, 576), (5, 1536), (9, 33)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_multiplies_as_the_loop_does(kernel, rows, width, dtype):
    torch.manual_seed(rows * width)
    weight, x = torch.randn(rows, width).to(dtype), torch.randn(1, width).to(dtype)
    exact = (x.double() @ weight.double().T).to(dtype)  # the sum in float64, rounded once
    got = kernel.multiply(x, weight)
    loop = (x[:, None, :] * weight[None]).sum(-1)  # what the compiled step does without the kernel
    assert got.shape == (1, rows) and got.dtype == dtype
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got.float(), exact.float(), atol=tolerance * width**0.5, rtol=tolerance)
    torch.testing.assert_close(got.float(), loop.float(), atol=2 * tolerance * width**0.5, rtol=2 * tolerance)


@pytest.mark.parametrize("n", [2, 3, 5, 7, 9, 13, 16])  # every tile of x's rows, 1 to 8 (matvec_rows.h)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
@pytest.mark.parametrize("rows, width", [(200, 576), (7, 33)])
def test_several_rows_of_x_take_one_read_of_the_weights(kernel, n, dtype, rows, width):
    """A verify's K+1 tokens, the lab's batch: n float32 rows against W as stored, each sum in float32."""
    torch.manual_seed(n * width)
    if dtype == torch.int8:
        weight = torch.randint(-127, 128, (rows, width), dtype=torch.int8)
    else:
        weight = torch.randn(rows, width).to(dtype)
    x = torch.randn(n, width)
    got = kernel.multiply(x, weight)
    exact = x.double() @ weight.double().T
    assert got.shape == (n, rows) and got.dtype == torch.float32
    if dtype == torch.int8:  # each row of x rounded to 16 bits over its largest |x|, as one row is
        rounding = x.abs().amax(1, keepdim=True).double() / 32767 / 2 * weight.double().abs().sum(1)
        assert ((got.double() - exact).abs() <= rounding + 1e-3).all()
        return
    scale = weight.double().abs().max().item()
    torch.testing.assert_close(got.double(), exact, atol=1e-5 * scale * width**0.5, rtol=1e-5)


@pytest.mark.parametrize("n", [2, 5, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, width", [(200, 576), (7, 33)])
def test_several_16_bit_rows_of_x_give_each_rows_own_product_in_their_dtype(kernel, n, dtype, rows, width):
    """A bf16 model's verify: its activations as they are, each row's product as one row gives it."""
    torch.manual_seed(n + width)
    weight, x = torch.randn(rows, width).to(dtype), torch.randn(n, width).to(dtype)
    got = kernel.multiply(x, weight)
    assert got.shape == (n, rows) and got.dtype == dtype
    one_at_a_time = torch.cat([kernel.multiply(x[j : j + 1], weight) for j in range(n)])
    exact = x.double() @ weight.double().T
    tolerance = 2**-7 if dtype == torch.bfloat16 else 2**-10  # the result's own rounding
    torch.testing.assert_close(got.double(), exact, atol=tolerance * width**0.5, rtol=tolerance)
    torch.testing.assert_close(
        got.double(), one_at_a_time.double(), atol=tolerance * width**0.5, rtol=tolerance
    )


def test_several_int8_rows_of_x_each_give_what_one_row_gives(kernel):
    """A w8 verify's logits row by row as the plain step's: each row rounded over its own largest |x|."""
    torch.manual_seed(3)
    q, x = torch.randint(-127, 128, (300, 1536), dtype=torch.int8), torch.randn(9, 1536)
    x[4] *= 1000  # one row far larger than the others: its rounding must not coarsen theirs
    got = kernel.multiply(x, q)
    for j in range(9):  # the same integer sums, added up as floats in another order
        alone = kernel.multiply(x[j : j + 1], q)[0]
        torch.testing.assert_close(got[j], alone, atol=1e-6 * alone.abs().max().item(), rtol=1e-6)


def test_several_int8_rows_keep_a_non_finite_row_and_the_widest_integer_sums(kernel):
    q = torch.ones(4, 576, dtype=torch.int8)
    x = torch.randn(3, 576)
    x[1, 3] = float("nan")
    got = kernel.multiply(x, q)
    assert got[1].isnan().all() and got[[0, 2]].isfinite().all()  # the float path carries the NaN
    for width in (8192, 8193):  # every product at its largest: the int32 sums hold, or floats take it
        q = torch.tensor([[127], [-128]], dtype=torch.int8).repeat(1, width)
        x = torch.full((3, width), 3.0)
        expected = torch.tensor([[381.0 * width, -384.0 * width]]).repeat(3, 1)
        torch.testing.assert_close(kernel.multiply(x, q), expected)


def test_more_rows_than_the_kernel_takes_are_refused_in_one_line(kernel):
    with pytest.raises(RuntimeError, match="at most 16"):
        kernel.multiply(torch.randn(17, 32), torch.randn(8, 32))


def test_the_kernel_takes_only_the_weights_it_streams(kernel, monkeypatch):
    monkeypatch.setattr(matvec, "enabled", True)
    assert matvec.can_multiply(torch.zeros(8, 32))
    assert not matvec.can_multiply(torch.zeros(32, 8).t())  # a transposed view: rows not contiguous
    assert not matvec.can_multiply(torch.zeros(8, 32, dtype=torch.float64))
    monkeypatch.setattr(matvec, "enabled", False)  # a CPU without AVX-512 or AVX2
    assert not matvec.can_multiply(torch.zeros(8, 32))


@pytest.mark.parametrize("rows, width", [(7, 576), (3072, 576), (9, 33), (5, 1536), (3, 96)])
def test_kernel_multiplies_w8s_int8_rows_by_x_rounded_to_16_bits_at_most(kernel, rows, width):
    torch.manual_seed(rows)
    q, x = torch.randint(-127, 128, (rows, width), dtype=torch.int8), torch.randn(1, width)
    got = kernel.multiply(x, q)
    assert got.dtype == torch.float32
    exact = x.double() @ q.double().T
    # Each x within half a step of 1/32767 of the largest |x| (VNNI's integer sums), or float32's.
    rounding = x.abs().max().double() / 32767 / 2 * q.double().abs().sum(1)
    assert ((got.double() - exact).abs() <= rounding + 1e-3).all()


def test_int8_rows_keep_a_non_finite_x_and_widths_past_the_integer_sums_range(kernel):
    q = torch.ones(4, 576, dtype=torch.int8)
    x = torch.randn(1, 576)
    x[0, 3] = float("nan")
    assert kernel.multiply(x, q).isnan().all()  # integers cannot carry a NaN: the float path does
    x[0, 3] = float("inf")
    assert kernel.multiply(x, q).isinf().all()
    assert (kernel.multiply(torch.zeros(1, 576), q) == 0).all()
    wide, x = torch.randint(-127, 128, (3, 20_000), dtype=torch.int8), torch.randn(1, 20_000)
    exact = (x.double() @ wide.double().T).float()
    torch.testing.assert_close(kernel.multiply(x, wide), exact, atol=1e-2, rtol=1e-5)


@pytest.mark.parametrize("width", [4096, 4097, 16384])
def test_int8_rows_at_the_integer_sums_widest_do_not_overflow(kernel, width):
    """Every product at its largest (x at its peak, w at -128 and 127): the int32 sums hold."""
    q = torch.tensor([[127], [-128]], dtype=torch.int8).repeat(1, width)
    x = torch.full((1, width), 3.0)
    torch.testing.assert_close(kernel.multiply(x, q), torch.tensor([[381.0 * width, -384.0 * width]]))


def test_bad_inputs_get_a_clear_error(kernel):
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.llmchat.matvec(torch.zeros(1, 8), torch.zeros(8, 8).t())
    with pytest.raises(RuntimeError, match="dtype"):
        torch.ops.llmchat.matvec(torch.zeros(1, 8, dtype=torch.bfloat16), torch.zeros(8, 8))
    with pytest.raises(RuntimeError, match="float32 for int8"):
        torch.ops.llmchat.matvec(torch.zeros(1, 8, dtype=torch.bfloat16), torch.zeros(8, 8, dtype=torch.int8))


@pytest.mark.parametrize("precision, tolerance", [("bf16", 1e-3), ("fp16", 1e-3), ("fp32", 1e-4)])
def test_an_eager_verify_scores_each_token_as_the_one_token_steps_do(
    kernel, tiny_model_dir, precision, tolerance
):
    """A speculative verify (or a short prefill) of a 16-bit model rounds x to the weights' dtype as
    a one-token step does, and attends over the cache as stored through the attention kernel, the
    cache read once for all its tokens. Before, its rows went in as float32 against the widened
    weights (bf16: 0.054 from the steps' logits; the matrices took 1.6x as long) and its
    attention through SDPA over a float32 copy of the cache, made anew at each layer."""
    from engine import models
    from engine.sampling import SamplingSettings
    from engine.session import ChatSession
    from engine.speculative.loop import forward_all

    session = ChatSession(
        models.load(str(tiny_model_dir), precision, "cpu"), SamplingSettings(), compile=False
    )
    drafted = [5, 17, 200, 33, 81, 99, 150, 7, 300]
    with torch.inference_mode():
        session.forward([10, 11, 12, 13])
        with torch.profiler.profile() as profile:
            verified = forward_all(session, drafted)
        session.cache.crop(4)
        stepped = torch.stack([session.forward([token]) for token in drafted])
    assert (verified - stepped).abs().max() <= tolerance
    ran = {event.name for event in profile.events()}
    assert "llmchat::decode_attention" in ran and not any("scaled_dot_product" in name for name in ran)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "w8"])
def test_a_compiled_step_multiplies_in_the_kernel_with_the_loops_logits(
    kernel, tiny_model_dir, precision, monkeypatch
):
    from engine import models
    from engine.fast import fused, steps

    monkeypatch.setattr(matvec, "enabled", True)  # as on a CPU with AVX-512 or AVX2
    loaded = models.load(str(tiny_model_dir), precision, "cpu")
    fast = fused.for_model(loaded.model, compiled=True)
    cache_dtype = getattr(torch, loaded.info.cache_dtype)
    step = steps.assemble("regional", steps.compile_here("regional", fast, cache_dtype))
    buffers, again = steps.scratch_buffers(fast, cache_dtype), steps.scratch_buffers(fast, cache_dtype)
    with torch.inference_mode(), torch.profiler.profile() as profile:
        logits = step(fast, torch.tensor([5]), torch.tensor([0]), steps.no_offsets(fast), *buffers)
    assert "llmchat::matvec" in {event.name for event in profile.events()}
    monkeypatch.setattr(matvec, "enabled", False)  # Inductor's loop, as traced without the kernel
    with torch.inference_mode():
        inputs = (fast, torch.tensor([5]), torch.tensor([0]), steps.no_offsets(fast))
        expected = steps.whole_step(*inputs, *again)
    # bf16 rounds each product's sum to 16 bits; the kernel rounds w8's x to 16 bits (VNNI).
    tolerance = {"bf16": 5e-2, "w8": 2e-3}.get(precision, 1e-4)
    torch.testing.assert_close(logits.float(), expected.float(), atol=tolerance, rtol=tolerance)
