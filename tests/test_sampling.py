"""The sampler: each filter alone from a small table, the settings' validation, and the draw."""

import math

import pytest
import torch

from engine.fast import kernels
from engine.sampling import (
    Sampler,
    SamplingSettings,
    apply_min_p,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k,
    apply_top_p,
)

NEG = float("-inf")
# Probabilities 0.5, 0.3, 0.15, 0.05 in a shuffled order, so filters cannot rely on sorted input.
PROBS = torch.tensor([0.15, 0.5, 0.05, 0.3])
LOGITS = PROBS.log()


def kept(logits: torch.Tensor) -> list[int]:
    return [i for i, v in enumerate(logits.tolist()) if v != NEG]


@pytest.mark.parametrize(
    "k, expected",
    [(0, [0, 1, 2, 3]), (1, [1]), (2, [1, 3]), (3, [0, 1, 3]), (4, [0, 1, 2, 3]), (99, [0, 1, 2, 3])],
)
def test_top_k_keeps_the_k_most_probable(k, expected):
    out = apply_top_k(LOGITS, k)
    assert kept(out) == expected
    assert torch.equal(out[expected], LOGITS[expected])  # survivors are untouched


@pytest.mark.parametrize(
    "p, expected",
    [(0.3, [1]), (0.45, [1]), (0.7, [1, 3]), (0.9, [0, 1, 3]), (0.99, [0, 1, 2, 3]), (1.0, [0, 1, 2, 3])],
)
def test_top_p_keeps_the_smallest_set_reaching_p(p, expected):
    out = apply_top_p(LOGITS, p)
    assert kept(out) == expected
    assert torch.equal(out[expected], LOGITS[expected])


def test_top_p_always_keeps_the_top_token():
    peaked = torch.tensor([0.0, 10.0, 0.0])
    assert kept(apply_top_p(peaked, 1e-6)) == [1]


@pytest.mark.parametrize(
    "min_p, expected",
    # Thresholds are min_p x 0.5 (the top probability).
    [(0.0, [0, 1, 2, 3]), (0.05, [0, 1, 2, 3]), (0.2, [0, 1, 3]), (0.5, [1, 3]), (0.8, [1]), (1.0, [1])],
)
def test_min_p_drops_tokens_below_a_fraction_of_the_top(min_p, expected):
    assert kept(apply_min_p(LOGITS, min_p)) == expected


@pytest.mark.parametrize("temperature, factor", [(0.0, 1.0), (1.0, 1.0), (0.5, 2.0), (2.0, 0.5)])
def test_temperature_scales_logits(temperature, factor):
    logits = torch.tensor([2.0, -1.0, 0.5])
    torch.testing.assert_close(apply_temperature(logits, temperature), logits * factor)


@pytest.mark.parametrize(
    "seen, penalty, expected",
    [
        ([], 2.0, [2.0, -2.0, 1.0]),
        ([0, 1], 1.0, [2.0, -2.0, 1.0]),
        ([0, 1], 2.0, [1.0, -4.0, 1.0]),  # positive divided, negative multiplied
        ([0, 0, 0], 2.0, [1.0, -2.0, 1.0]),  # a repeated id is penalised once
        ([2], 0.5, [2.0, -2.0, 2.0]),  # below 1 favours seen tokens
    ],
)
def test_repetition_penalty(seen, penalty, expected):
    logits = torch.tensor([2.0, -2.0, 1.0])
    out = apply_repetition_penalty(logits, torch.tensor(seen, dtype=torch.long), penalty)
    assert out.tolist() == expected
    assert logits.tolist() == [2.0, -2.0, 1.0]  # the input is not modified


@pytest.mark.parametrize(
    "field, value, range_text",
    [
        ("temperature", -0.1, "[0, 5]"),
        ("temperature", 5.5, "[0, 5]"),
        ("top_k", -1, "[0, 1e+06]"),
        ("top_p", 0.0, "(0, 1]"),
        ("top_p", 1.5, "(0, 1]"),
        ("min_p", -0.01, "[0, 1]"),
        ("min_p", 1.01, "[0, 1]"),
        ("repetition_penalty", 0.0, "(0, 10]"),
        ("repetition_penalty", 11.0, "(0, 10]"),
        ("max_new_tokens", 0, "[1, 1e+06]"),
        ("seed", -1, "[0,"),
    ],
)
def test_out_of_range_settings_name_the_field_and_range(field, value, range_text):
    with pytest.raises(ValueError) as error:
        SamplingSettings(**{field: value})
    message = str(error.value)
    assert message.startswith(f"{field} must be in ")
    assert range_text in message
    assert "\n" not in message


@pytest.mark.parametrize("field, value", [("temperature", float("nan")), ("top_p", "0.9"), ("top_k", True)])
def test_non_numbers_are_rejected(field, value):
    with pytest.raises(ValueError, match=f"^{field} must be a number"):
        SamplingSettings(**{field: value})


@pytest.mark.parametrize(
    "field, value", [("top_k", 2.5), ("top_k", 40.0), ("max_new_tokens", 10.5), ("seed", 1.5)]
)
def test_count_settings_must_be_whole_numbers(field, value):
    with pytest.raises(ValueError, match=f"^{field} must be a whole number"):
        SamplingSettings(**{field: value})


def test_edge_values_are_accepted():
    SamplingSettings(
        temperature=0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=10.0, seed=0, max_new_tokens=1
    )
    SamplingSettings(temperature=5.0, top_p=1e-3, min_p=1.0)


def _logits(vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 2


NO_IDS = torch.empty(0, dtype=torch.long)


def test_temperature_zero_is_argmax():
    logits = _logits()
    sampler = Sampler(SamplingSettings(temperature=0))
    draws = [sampler.sample(logits, NO_IDS) for _ in range(5)]
    assert {d.id for d in draws} == {int(torch.argmax(logits))}
    assert draws[0].top_ids[0] == draws[0].id


def test_temperature_zero_ignores_the_seed():
    logits = _logits()
    a = Sampler(SamplingSettings(temperature=0, seed=1)).sample(logits, NO_IDS)
    b = Sampler(SamplingSettings(temperature=0, seed=2)).sample(logits, NO_IDS)
    assert a == b


def _sequence(settings: SamplingSettings, n: int = 30) -> list[int]:
    sampler = Sampler(settings)
    return [sampler.sample(_logits(seed=step), NO_IDS).id for step in range(n)]


def test_seeded_sampling_is_reproducible():
    settings = SamplingSettings(temperature=1.0, seed=1234)
    first = _sequence(settings)
    assert _sequence(settings) == first
    assert _sequence(SamplingSettings(temperature=1.0, seed=1235)) != first
    assert len(set(first)) > 3  # it really sampled, it did not take the argmax every time


def test_reseed_restarts_the_same_sequence():
    sampler = Sampler(SamplingSettings(temperature=1.0, seed=5))
    logits = _logits()
    first = [sampler.sample(logits, NO_IDS).id for _ in range(10)]
    sampler.reseed()
    assert [sampler.sample(logits, NO_IDS).id for _ in range(10)] == first


@pytest.mark.parametrize(
    "settings",
    [
        SamplingSettings(temperature=0),
        SamplingSettings(temperature=1.0, seed=0),
        SamplingSettings(temperature=0.7, top_k=3, seed=0),
        SamplingSettings(temperature=1.3, top_p=0.8, seed=0),
        SamplingSettings(temperature=1.0, min_p=0.1, repetition_penalty=1.5, seed=0),
    ],
)
def test_draw_reports_a_consistent_distribution(settings):
    sampler = Sampler(settings, show_top_k=10)
    seen = torch.tensor([1, 2, 3])
    for step in range(20):
        draw = sampler.sample(_logits(seed=step), seen)
        assert len(draw.top_ids) == len(draw.top_probs) == 10
        assert draw.top_probs == sorted(draw.top_probs, reverse=True)
        assert sum(draw.top_probs) <= 1.0 + 1e-6
        assert all(0.0 <= p <= 1.0 for p in draw.top_probs)
        assert draw.logprob <= 0.0 and math.isfinite(draw.logprob)  # never a removed token
        if draw.id in draw.top_ids:
            chosen = draw.top_probs[draw.top_ids.index(draw.id)]
            assert chosen == pytest.approx(math.exp(draw.logprob), rel=1e-5)


def test_top_k_filter_shows_in_the_draw():
    draw = Sampler(SamplingSettings(temperature=1.0, top_k=3, seed=0)).sample(_logits(), NO_IDS)
    assert draw.top_ids[:3] == torch.topk(_logits(), 3).indices.tolist()
    assert sum(draw.top_probs[:3]) == pytest.approx(1.0, abs=1e-5)
    assert draw.top_probs[3:] == [0.0] * 7
    assert draw.id in draw.top_ids[:3]


@pytest.mark.parametrize("fused", [False, True], ids=["torch ops", "kernel"])
def test_samples_follow_the_reported_distribution(fused, request):
    """Empirical frequencies of many draws match the probabilities the draw reports."""
    if fused:
        request.getfixturevalue("kernels_loaded")
    logits = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, -3.0])
    settings = SamplingSettings(temperature=0.8, top_p=0.9, seed=42)
    sampler = Sampler(settings, show_top_k=6, fused=fused)
    draws = [sampler.sample(logits, NO_IDS) for _ in range(4000)]
    reported = dict(zip(draws[0].top_ids, draws[0].top_probs))
    counts = {i: 0 for i in range(6)}
    for d in draws:
        counts[d.id] += 1
    for token, prob in reported.items():
        assert counts[token] / len(draws) == pytest.approx(prob, abs=0.03), token
    assert all(counts[t] == 0 for t, p in reported.items() if p == 0.0)  # filtered tokens never drawn
    assert any(p == 0.0 for p in reported.values())  # and top-p did filter some


def test_settings_names_lists_every_field():
    assert SamplingSettings.names() == [
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "repetition_penalty",
        "seed",
        "max_new_tokens",
    ]


# -- the summary kernel: the same Draw in one call ---------------------------------------------
@pytest.fixture(scope="module")
def kernels_loaded():
    problem = kernels.load("sampling")
    assert problem is None, problem  # CI has a compiler and ninja: the kernels must build
    assert kernels.is_loaded("sampling")


def _same_draw(got, expected):
    shown = sum(p > 0 for p in expected.top_probs)  # a removed token's place in the top k means nothing
    assert (got.id, got.top_ids[:shown]) == (expected.id, expected.top_ids[:shown])
    # Deep in the tail, torch ranks by logprobs rounded after the softmax's shift, where neighbours
    # can become equal; the kernel compares the logits themselves.
    assert got.rank == expected.rank if expected.rank <= 10 else abs(got.rank - expected.rank) <= 2
    assert got.logprob == pytest.approx(expected.logprob, rel=1e-5, abs=1e-6)
    assert got.entropy == pytest.approx(expected.entropy, rel=1e-5, abs=1e-6)
    assert got.top_probs == pytest.approx(expected.top_probs, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("vocab", [50, 49_152])  # a toy, and the built-in model's vocabulary
@pytest.mark.parametrize(
    "settings",
    [
        SamplingSettings(temperature=0),
        SamplingSettings(temperature=0.7, seed=3),
        SamplingSettings(temperature=1.0, seed=0),
        SamplingSettings(temperature=0.7, top_k=3, seed=0),
        SamplingSettings(temperature=1.3, top_p=0.8, seed=0),
        SamplingSettings(temperature=1.0, min_p=0.1, repetition_penalty=1.5, seed=0),
    ],
)
def test_the_kernel_draws_and_reports_what_torch_ops_do(kernels_loaded, settings, vocab):
    by_kernel = Sampler(settings, show_top_k=10)
    by_torch = Sampler(settings, show_top_k=10, fused=False)
    seen = torch.tensor([1, 2, 3])
    for step in range(20):
        logits = _logits(vocab, seed=step)
        got, expected = by_kernel.sample(logits, seen), by_torch.sample(logits, seen)
        if got.id != expected.id:  # the same u, landing on the boundary of two tokens' CDF intervals
            logprobs = by_torch.distribution(logits, seen)
            assert _mass_between(logprobs, got.id, expected.id) < 1e-4, (step, got.id, expected.id)
            expected = by_torch.describe(logprobs, got.id)
        _same_draw(got, expected)


def _mass_between(logprobs: torch.Tensor, a: int, b: int) -> float:
    """The probability of the tokens from the lower of ids a, b up to the higher, the higher
    excluded: how far apart one u put two inverse-CDF draws. The kernel sums exp'd logits in
    float32, 16 at a time, torch's ops cumsum exp'd log-probabilities: over ~10^4 terms their
    running sums differ by ~10^-5 of the total, which the vector width the CPU's build picks moves
    (on a Zen 1, seed 3 at T 0.7 over 49,152 tokens drew 13,557 against torch's 13,560: 1.8e-5
    of probability apart)."""
    low, high = sorted((a, b))
    return float(logprobs[low:high].double().exp().sum())


def test_the_kernel_takes_the_first_of_equal_tops_as_argmax_does(kernels_loaded):
    logits = torch.full((49_152,), -5.0)
    logits[[700, 31, 40_000]] = 3.0  # three equal most probable tokens
    draw = Sampler(SamplingSettings(temperature=0)).sample(logits, NO_IDS)
    assert draw.id == int(torch.argmax(logits)) == 31
    assert draw.top_ids[:3] == [31, 700, 40_000] and draw.rank == 1


def test_the_kernel_describes_a_given_token_even_a_removed_one(kernels_loaded):
    settings = SamplingSettings(temperature=1.0, top_k=5)
    logprobs = Sampler(settings, fused=False).distribution(_logits(300), NO_IDS)
    removed = int(torch.argmin(logprobs))
    for chosen in (int(torch.topk(logprobs, 3).indices[-1]), removed):
        got = Sampler(settings).describe(logprobs, chosen)
        _same_draw(got, Sampler(settings, fused=False).describe(logprobs, chosen))
    assert got.logprob == NEG and got.top_probs[5:] == [0.0] * 5  # only 5 kept: the rest shown as 0


def test_the_kernel_refuses_logits_it_cannot_read(kernels_loaded):
    every_token_removed = torch.full((10,), NEG)
    with pytest.raises(RuntimeError, match="every token was removed"):
        torch.ops.llmchat.sample_summary(every_token_removed, 1.0, -1, None, 3)
    with pytest.raises(RuntimeError, match="one contiguous float32 row"):
        torch.ops.llmchat.sample_summary(torch.zeros(10, dtype=torch.float64), 1.0, -1, None, 3)
