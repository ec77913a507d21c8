"""Two phases measured: FLOP and byte counts by hand for the tiny config, rates, calibration."""

import json

import pytest
import torch

from engine import contention, models
from engine.bench import BANDWIDTH_READ, measure_bandwidth
from engine.events import TurnFinished
from engine.fast import kernels, matvec
from engine.instruments import phases
from engine.instruments.phases import (
    Calibration,
    ModelShape,
    PhaseMeasure,
    Spread,
    TurnPhases,
    calibrate,
    turn_phases,
)
from engine.sampling import SamplingSettings
from engine.session import ChatSession
from tests.tiny import build_tiny_model
from tui.screens.phases import machine_line, measure_rows, model_line, verdict


def test_the_tiny_config_as_counted(tiny_loaded):
    shape = ModelShape.of(tiny_loaded)
    # tests/tiny.py: hidden 64, 4 heads, 2 KV heads, head_dim 16, MLP 128, 2 layers, untied head.
    assert (shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.intermediate, shape.layers) == (
        64,
        4,
        2,
        16,
        128,
        2,
    )
    assert not shape.tied_embeddings
    # q 64·64 + k 64·32 + v 64·32 + o 64·64 + MLP 3·64·128 = 4096 + 2048 + 2048 + 4096 + 24576
    assert shape.layer_matmul_params == 36864
    assert shape.matmul_params == 73728
    assert shape.parameters == tiny_loaded.info.parameters  # the count covers every weight


@pytest.mark.parametrize("precision", ["fp32", "bf16", "w8", "w8a8", "w4"])
def test_a_pass_reads_the_table_only_where_the_head_multiplies_by_it(tmp_path, precision):
    """W, the weight bytes a pass reads, of a tied model: the whole table where the LM head
    multiplies by it; at w8 and w8a8 the head is an int8 matrix of its own (w4: 4-bit) and the
    float table is only looked up (W counted it, and F6 showed w8 decode at 194% of the bandwidth roof)."""
    loaded = models.load(str(build_tiny_model(tmp_path, tied=True)), precision, "cpu")
    ChatSession(loaded)  # the fast path re-homes the weights; the table must stay shared
    shape = ModelShape.of(loaded)
    table = loaded.model.get_input_embeddings().weight
    assert shape.tied_embeddings and shape.parameters == loaded.info.parameters
    looked_up = table.numel() * table.element_size() if precision in ("w8", "w8a8", "w4") else 0
    assert shape.streamed_weight_bytes == loaded.info.weight_bytes - looked_up
    # The LM head's share, which F6 states: its matrix as stored (w8: int8 and a scale a row).
    head = {"fp32": 4, "bf16": 2, "w8": 1 + 4 / 64, "w8a8": None, "w4": 0.5 + 2 / 32}[precision]
    if head is not None:
        assert shape.head_bytes == shape.vocab * (shape.hidden * head)
    share = f"{shape.head_bytes / shape.streamed_weight_bytes:.0%}, {shape.vocab:,} entries)"
    assert share in model_line(shape).plain


def test_flops_match_a_hand_count(tiny_loaded):
    shape = ModelShape.of(tiny_loaded)
    V = shape.vocab
    # Decode at context 10: 2·73728 (layers) + 2·64·V (LM head) + 4·2 layers·4 heads·16·11 keys
    assert shape.decode_flops(10) == 147456 + 128 * V + 5632
    # Prefill of 7 tokens after 3 cached: 2·73728·7 + 2·64·V + 512·(7·3 + 7·8/2)
    assert shape.prefill_flops(7, 3) == 1032192 + 128 * V + 512 * 49
    # Two chunks: the LM head runs once per chunk.
    assert shape.prefill_flops(7, 3, chunks=2) == shape.prefill_flops(7, 3) + 128 * V


def test_bytes_match_a_hand_count(tiny_loaded):
    shape = ModelShape.of(tiny_loaded)
    V = shape.vocab
    weights = tiny_loaded.info.weight_bytes - V * 64 * 4  # the untied embedding is only looked up
    kv = 2 * 2 * 2 * 16 * 4  # K and V · layers · KV heads · head_dim · fp32
    assert shape.kv_bytes_per_token == kv == 512
    assert shape.decode_bytes(10) == weights + kv * 11 + kv
    assert shape.prefill_bytes(7, 3) == weights + kv * 10 + kv * 7


def test_prefill_is_dense_and_decode_is_thin(tiny_loaded):
    session = ChatSession(tiny_loaded, SamplingSettings(temperature=0.0, max_new_tokens=12))
    finished = [e for e in session.send("How does inference work? " * 4) if isinstance(e, TurnFinished)][-1]
    measured = turn_phases(ModelShape.of(tiny_loaded), finished.stats)
    prefill, decode = measured.prefill, measured.decode
    assert prefill.tokens == finished.stats.prefilled_tokens and prefill.seconds > 0
    assert decode.seconds == finished.stats.itl_p50_s
    assert decode.intensity < 1.0 < 4 * decode.intensity < prefill.intensity
    assert prefill.flop_s == pytest.approx(prefill.flops / prefill.seconds)
    peaks = Calibration("cpu", "float32", 1, matmul_flop_s=4e10, bandwidth_bytes_s=1e10, measured_at=0.0)
    assert peaks.balance == 4.0
    assert (prefill.bound(peaks), decode.bound(peaks)) == ("compute", "memory")


def test_a_step_mode_answer_times_no_decode_step(tiny_loaded):
    """Each token waited at the gate on the slow path: its 3.7 tok/s fed F6's 'last turn'."""
    import dataclasses

    from tui.screens.phases import measure_rows

    session = ChatSession(tiny_loaded, SamplingSettings(temperature=0.0, max_new_tokens=12))
    finished = [e for e in session.send("How does inference work?") if isinstance(e, TurnFinished)][-1]
    stepped = dataclasses.replace(finished.stats, step_path="step mode")
    measured = turn_phases(ModelShape.of(tiny_loaded), stepped)
    assert measured.decode is None and measured.prefill is not None
    assert "decode not timed: a step-mode answer" in " ".join(
        str(line) for line in measure_rows(measured, None)
    )


def test_the_roofline():
    peaks = Calibration("cpu", "float32", 1, matmul_flop_s=100.0, bandwidth_bytes_s=10.0, measured_at=0.0)
    thin = PhaseMeasure("decode", 1, 2.0, flops=50, bytes=100)
    dense = PhaseMeasure("prefill", 9, 1.0, flops=5000, bytes=100)
    assert thin.attainable_flop_s(peaks) == 5.0 and dense.attainable_flop_s(peaks) == 100.0
    assert thin.memory_use(peaks) == pytest.approx(5.0) and dense.compute_use(peaks) == 50.0


def test_calibration_is_measured_once_and_cached(tmp_path, monkeypatch):
    path = tmp_path / "calibration.json"
    first = calibrate("cpu", size=64, megabytes=4, path=path)
    assert first.matmul_flop_s > 0 and first.bandwidth_bytes_s > 0 and path.is_file()

    def measuring_again(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(phases, "measure_matmul", measuring_again)
    assert calibrate("cpu", size=64, megabytes=4, path=path) == first
    assert phases.cached_calibration("cpu", torch.float32, path) == first
    monkeypatch.setattr(phases, "measure_matmul", lambda *args, **kwargs: 123.0)
    again = calibrate("cpu", size=64, megabytes=4, path=path, refresh=True)
    assert again.matmul_flop_s == 123.0 and again.measured_at >= first.measured_at


@pytest.mark.real_model
def test_smollm2_parameter_count(smollm2):
    shape = ModelShape.of(smollm2)
    assert shape.tied_embeddings and shape.parameters == smollm2.info.parameters
    # 30 layers of (576·576 + 2·576·192 + 576·576 + 3·576·1536) = 30 · 3,538,944
    assert shape.matmul_params == 30 * 3538944


def test_calibration_is_the_median_of_several_runs_with_their_spread(tmp_path, monkeypatch):
    matmul = iter([30e9, 10e9, 50e9, 20e9, 40e9])  # one slow run and one fast one among five
    bandwidth = iter([8e9, 9e9, 2e9, 10e9, 9.5e9])
    monkeypatch.setattr(phases, "measure_matmul", lambda *args, **kwargs: next(matmul))
    monkeypatch.setattr("engine.bench.measure_bandwidth", lambda *args, **kwargs: next(bandwidth))
    path = tmp_path / "calibration.json"
    peaks = calibrate("cpu", path=path, refresh=True)
    assert peaks.matmul_flop_s == 30e9 and peaks.bandwidth_bytes_s == 9e9  # medians, not the best
    assert peaks.matmul_runs == (30e9, 10e9, 50e9, 20e9, 40e9) and len(peaks.bandwidth_runs) == 5
    spread = Spread.of(peaks.matmul_runs)
    assert (spread.median, spread.low, spread.high, spread.runs) == (30e9, 10e9, 50e9, 5)
    assert spread.relative == pytest.approx(40 / 30)
    assert phases.cached_calibration("cpu", torch.float32, path) == peaks  # the runs survive the file
    line = machine_line(peaks).plain
    assert "peak matmul 30.00 GFLOP/s" in line and "median of 5 runs" in line
    assert "matmul 10.00 GFLOP/s to 50.00 GFLOP/s" in line


@pytest.mark.parametrize("read", [None, "matrix x vector"])
def test_a_calibration_whose_bandwidth_was_read_another_way_is_measured_again(tmp_path, monkeypatch, read):
    """Saved when the bandwidth was read by a plain sum (no `bandwidth_read`; its roof ~20% low: F6
    showed w8 decode at 110% of it) or by torch.mv alone (~45% below the step's own kernel on an
    AVX-512 EPYC): not shown again but measured anew."""
    old = {"device": "cpu", "dtype": "float32", "threads": 2, "matmul_flop_s": 4e10}
    old |= {"bandwidth_bytes_s": 1e10, "measured_at": 0.0} | ({"bandwidth_read": read} if read else {})
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({phases._machine_key("cpu", torch.float32): old}))
    assert phases.cached_calibration("cpu", torch.float32, path) is None
    monkeypatch.setattr(phases, "measure_matmul", lambda *args, **kwargs: 5e10)
    monkeypatch.setattr("engine.bench.measure_bandwidth", lambda *args, **kwargs: 3e10)
    peaks = calibrate("cpu", path=path, runs=1)
    assert (peaks.bandwidth_bytes_s, peaks.bandwidth_read) == (3e10, BANDWIDTH_READ)
    assert phases.cached_calibration("cpu", torch.float32, path) == peaks


@pytest.mark.skipif(not matvec.enabled, reason="the step's matvec kernel needs AVX2 or AVX-512")
def test_the_bandwidth_roof_is_read_also_by_the_kernel_a_step_reads_with(monkeypatch):
    """A Zen 5 `bench -p fp32` measured its roof at 20.1 GB/s by torch.mv and decoded at 31 GB/s
    a step: torch.mv reads a CPU's memory slower than the step's own kernel (here 16-18 GB/s
    against 30-32), so the roof is read by both, and the faster counts."""
    assert kernels.load("step") is None
    read_by_kernel = []
    multiply = matvec.multiply
    monkeypatch.setattr(matvec, "multiply", lambda x, w: read_by_kernel.append(w.nbytes) or multiply(x, w))
    assert measure_bandwidth("cpu", megabytes=64) > 0
    assert read_by_kernel and set(read_by_kernel) == {64 * 2**20}  # the whole buffer, every read


def _decode_at(fraction: float) -> PhaseMeasure:
    """A 50 ms decode step at 0.5 FLOP/B that moved `fraction` of PEAKS' bandwidth."""
    moved = int(fraction * 10e9 * 0.05)
    return PhaseMeasure("decode", 30, 0.05, flops=moved // 2, bytes=moved)


PEAKS = Calibration("cpu", "float32", 2, matmul_flop_s=50e9, bandwidth_bytes_s=10e9, measured_at=0.0)


def test_the_verdict_names_the_roof_and_how_far_below_it_a_phase_is():
    # F6's report: prefill at 3.9% of peak FLOP/s, decode at 10.7% of the bandwidth.
    prefill = PhaseMeasure("prefill", 200, 1.0, flops=int(0.039 * 50e9), bytes=int(0.039 * 50e9 / 100))
    decode = PhaseMeasure(
        "decode", 30, 0.05, flops=int(0.107 * 10e9 * 0.05 / 2), bytes=int(0.107 * 10e9 * 0.05)
    )
    assert (prefill.bound(PEAKS), decode.bound(PEAKS)) == ("compute", "memory")
    assert prefill.roof_use(PEAKS) == pytest.approx(0.039, rel=1e-3)
    assert decode.roof_use(PEAKS) == pytest.approx(0.107, rel=1e-3)
    assert prefill.limit(PEAKS) == decode.limit(PEAKS) == "neither"
    text = "\n".join(line.plain for line in verdict(TurnPhases(prefill, decode), PEAKS))
    assert "prefill, the whole pass: 100.0 FLOP/B ≥ balance 5.0, so its roof is compute" in text
    assert "decode, per step: 0.5 FLOP/B < balance 5.0, so its roof is memory" in text
    assert "3.9% of it: far from both roofs" in text and "10.7% of it: far from both roofs" in text
    # It said "came within 20% of either roof", which means close to one: the opposite.
    assert "Both phases stayed under 20% of both roofs" in text
    assert "compute-bound" not in text and "memory-bound" not in text  # no claim that a roof was reached


def test_a_phase_near_its_roof_is_limited_by_it_and_a_busy_turn_says_so():
    decode = _decode_at(0.8)
    busy = contention.contention(0.45, 3.1, 2)
    text = "\n".join(line.plain for line in verdict(TurnPhases(None, decode, busy), PEAKS))
    assert "80.0% of it: near the roof: this roof is what limits it." in text
    assert "Both phases" not in text and "far from both" not in text
    eager = "\n".join(line.plain for line in verdict(TurnPhases(None, decode, step_path="fused"), PEAKS))
    assert "⚠ This answer was decoded on the eager step, not the compiled step" in eager
    assert "decoded on" not in text  # the turn above says nothing of its step: none slower named
    above = "\n".join(line.plain for line in verdict(TurnPhases(None, _decode_at(1.1)), PEAKS))
    assert "10% above it: above the measured roof: part of what it read came from the chip's caches" in above
    table = "\n".join(line.plain for line in measure_rows(TurnPhases(None, _decode_at(1.1)), PEAKS))
    assert "110" not in table and table.count("above it: see below") == 2  # of the bandwidth, of the roof
    assert "This turn ran on a busy machine (CPU share 45%, load 3.1 on 2 cores)" in text
    middle = PhaseMeasure("decode", 30, 0.05, flops=int(0.3 * 10e9 * 0.05 / 2), bytes=int(0.3 * 10e9 * 0.05))
    assert middle.limit(PEAKS) == "below"
    calm = "\n".join(
        line.plain for line in verdict(TurnPhases(None, middle, contention.contention(0.97, 1, 2)), PEAKS)
    )
    assert "well under the roof" in calm and "busy" not in calm


def test_a_busy_calibration_is_flagged():
    busy_peaks = Calibration("cpu", "float32", 2, 50e9, 10e9, 0.0, (50e9,), (10e9,), cpu_share=0.4, busy=True)
    decode = PhaseMeasure("decode", 30, 0.05, flops=1000, bytes=1000)
    text = "\n".join(line.plain for line in verdict(TurnPhases(None, decode), busy_peaks))
    assert (
        "The calibration ran on a busy machine" in text and "CPU share 40%" in machine_line(busy_peaks).plain
    )
