"""Speculation measured in the app: the speed-up against a plain answer of the same session (phase
panel), and the phases view's verify pass against one decode step (counted, and timed)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from rich.cells import cell_len
from textual.geometry import Size

from engine.events import Contention, DraftRound, ModelReady, TurnFinished, TurnStats, to_json
from engine.instruments.phases import ModelShape, turn_phases
from engine.instruments.verify_cost import measured_rounds, verify_cost
from engine.sampling import SamplingSettings
from engine.session import ChatSession
from engine.speculative.drafters import PromptLookup
from engine.speculative.loop import Speculation
from engine.speculative.speedup import PlainBaseline
from tests.test_speculative import PROMPTS
from tests.test_tui_model import WIDE, Recorder, turns_done
from tests.tui_fakes import real_tiny_app
from tests.tui_screen import screen_text, wait_for, widget_text
from tui.fmt import ms
from tui.screens.phases import PhasesScreen
from tui.widgets.phase import PANEL_CELLS, PhasePanel


def stats(
    tok_s: float, speculative: str | None = None, path: str | None = "fused", tokens: int = 10
) -> TurnStats:
    return TurnStats(
        prompt_tokens=20,
        reused_tokens=0,
        prefilled_tokens=20,
        generated_tokens=tokens,
        ttft_s=0.1,
        itl_p50_s=1 / tok_s,
        itl_p90_s=1 / tok_s,
        prefill_tok_s=200.0,
        decode_tok_s=tok_s,
        stop="eos",
        speculative=speculative,
        step_path=path,
    )


def test_the_speed_up_is_against_the_newest_plain_answer_decoded_the_same_way(tiny_loaded):
    info = tiny_loaded.info
    base = PlainBaseline()
    first = base.finished(stats(30.0, "lookup, K 4"), info)
    assert first.plain is None and "no comparable plain answer yet" in first.describe()
    assert base.finished(stats(20.0, path="compiled"), info) is None  # plain answer 2
    assert base.finished(stats(99.0, path="step mode"), info) is None  # waits for the user: no speed
    up = base.finished(stats(30.0, "lookup, K 4"), info)
    assert up.ratio == pytest.approx(1.5) and not up.same_path
    assert up.describe() == "1.50× plain: 30.0 vs 20.0 tok/s (plain answer 2, ran compiled)"
    assert up.short() == "1.50× vs plain 20.0 tok/s (#2, compiled)"
    base.finished(stats(10.0), info)  # plain answer 5, the eager path a round runs
    up = base.finished(stats(30.0, "lookup, K 4"), info)
    assert up.ratio == pytest.approx(3.0) and up.same_path
    assert up.describe() == "3.00× plain: 30.0 vs 10.0 tok/s (plain answer 5)"
    other = dataclasses.replace(info, precision="bf16")
    assert base.finished(stats(30.0, "lookup, K 4"), other).plain is None  # another precision


def test_a_speculative_answer_is_never_compared_with_an_unlike_plain_one(tiny_loaded):
    """It read "7.29x vs plain 6.0 tok/s (#5)": #5 was eager, fp32 cache, on a busy machine, the
    speculative answer had an int8 cache."""
    info = tiny_loaded.info
    int8 = dataclasses.replace(info, cache_dtype="int8", cache_scale_bytes=4)
    base = PlainBaseline()
    busy = Contention(cpu_share=0.47, source="schedstat", load_1m=3.0, cores=2, busy=True)
    base.finished(dataclasses.replace(stats(6.0), contention=busy), int8)  # busy: no baseline
    base.finished(stats(6.0, path="reference"), int8)  # the HF forward: another path
    base.finished(stats(20.0), info)  # an fp32 cache
    up = base.finished(stats(30.0, "lookup, K 4"), int8)
    assert up.plain is None and up.short().startswith("no comparable plain answer yet")
    base.finished(stats(12.0, path="compiled"), int8)
    assert (
        base.finished(stats(30.0, "lookup, K 4"), int8).short() == "2.50× vs plain 12.0 tok/s (#5, compiled)"
    )


def test_turn_stats_say_how_the_answer_was_decoded(tiny_loaded):
    chat = ChatSession(tiny_loaded, SamplingSettings(temperature=0, max_new_tokens=12))
    plain = [e for e in chat.send(PROMPTS[0]) if isinstance(e, TurnFinished)][-1].stats
    assert (plain.speculative, plain.step_path) == (None, "fused")
    chat.speculation = Speculation(PromptLookup(), 3)
    spec = [e for e in chat.send(PROMPTS[0]) if isinstance(e, TurnFinished)][-1].stats
    assert (spec.speculative, spec.step_path) == ("lookup, K 3", "fused")
    line = to_json(TurnFinished(spec, "x"))
    assert line["speculative"] == "lookup, K 3" and line["step_path"] == "fused"


def test_a_verify_pass_moves_about_one_steps_bytes_for_k_plus_one_times_the_flops(tiny_loaded):
    shape = ModelShape.of(tiny_loaded)
    assert verify_cost(shape, 0, 50).verify_flops == shape.decode_flops(50)  # K = 0 is a decode step
    assert verify_cost(shape, 0, 50).verify_bytes == shape.decode_bytes(50)
    cost = verify_cost(shape, 4, 50)
    # the same weights, plus 4 more tokens' K/V written and read
    assert cost.verify_bytes - cost.step_bytes == 2 * 4 * shape.kv_bytes_per_token
    # every token through every matrix and the LM head, each against its own prefix
    matmuls = 5 * (2 * shape.matmul_params + 2 * shape.head_params)
    assert cost.verify_flops == matmuls + shape.attention_flops(5, 50)
    assert 5.0 <= cost.flops_ratio < 5.1  # a little over K+1: later drafts attend to more keys


def test_a_speculative_answer_has_no_plain_decode_step_to_time(tiny_loaded):
    shape = ModelShape.of(tiny_loaded)
    assert turn_phases(shape, stats(20.0)).decode is not None
    spec = turn_phases(shape, dataclasses.replace(stats(20.0, "lookup, K 4"), itl_p50_s=1e-5))
    assert spec.decode is None and spec.prefill is not None


def test_measured_rounds_time_the_usual_k():
    rounds = [
        DraftRound(1, "lookup", (1, 2, 3, 4), ("a",) * 4, 2, 9, 0.001, 0.030),
        DraftRound(4, "lookup", (1, 2), ("a",) * 2, 2, 9, 0.001, 0.010),  # a shorter draft: cheaper
        DraftRound(7, "lookup", (1, 2, 3, 4), ("a",) * 4, 4, 9, 0.002, 0.050),
        DraftRound(12, "lookup", (1, 2, 3, 4), ("a",) * 4, 0, 9, 0.001, 0.040),
    ]
    measured = measured_rounds(rounds)
    assert (measured.k, measured.rounds, measured.verify_s) == (4, 3, 0.040)
    assert measured_rounds([]) is None


class QuietMeter:
    """The suite's own load is no busy spell: a busy plain answer is no baseline."""

    def stop(self, paused_s: float = 0.0) -> Contention:
        return Contention(cpu_share=1.0, source="test", load_1m=0.0, cores=2, busy=False)


def test_the_app_shows_the_speed_up_and_f6_the_verify_pass(tiny_model_dir, tmp_path, monkeypatch):
    from engine import session

    monkeypatch.setattr(session, "ContentionMeter", QuietMeter)
    recorder = Recorder()

    async def scenario():
        app = real_tiny_app(recorder, tiny_model_dir, tmp_path, {"temperature": 0, "max_new_tokens": 24})
        async with app.run_test(size=WIDE) as pilot:
            await wait_for(pilot, lambda: app.turns.ready, timeout=60)
            app.speculation = ("lookup", 4)  # as Settings does, before any plain answer
            app.engine.set_speculation("lookup", 4)
            await pilot.press(*PROMPTS[0], "enter")
            await turns_done(pilot, recorder, 1)
            phase = widget_text(app.query_one(PhasePanel))
            assert "no comparable plain answer yet" in phase

            app.speculation = (None, 4)
            app.engine.set_speculation(None, 4)
            await pilot.press(*PROMPTS[0], "enter")
            await turns_done(pilot, recorder, 2)
            plain = recorder.of(TurnFinished)[-1].stats
            assert plain.speculative is None
            assert "speed-up" not in widget_text(app.query_one(PhasePanel))

            app.speculation = ("lookup", 4)
            app.engine.set_speculation("lookup", 4)
            await pilot.press(*PROMPTS[0], "enter")
            await turns_done(pilot, recorder, 3)
            spec = recorder.of(TurnFinished)[-1].stats
            assert spec.speculative == "lookup, K 4"
            ratio = spec.decode_tok_s / plain.decode_tok_s
            phase = widget_text(app.query_one(PhasePanel))
            assert f"decode {spec.decode_tok_s:.1f} tok/s" in phase
            assert f"speed-up {ratio:.2f}× vs plain {plain.decode_tok_s:.1f} tok/s (#2)" in phase

            rounds = recorder.events[recorder.events.index(recorder.of(TurnFinished)[1]) :]
            measured = measured_rounds([e for e in rounds if isinstance(e, DraftRound)])
            assert measured is not None  # the answer repeats the prompt: lookup finds drafts
            await pilot.press("f6")
            await wait_for(pilot, lambda: isinstance(app.screen, PhasesScreen), what="the phases view")
            shown = screen_text(app)
            info = recorder.of(ModelReady)[0].info
            context = spec.prompt_tokens + spec.generated_tokens // 2
            cost = verify_cost(ModelShape.of(app.engine.session.loaded), measured.k, context)
            assert f"K = {measured.k} drafts" in shown and f"at context {context:,}" in shown
            assert f"verify pass ({measured.k + 1} tokens)" in shown
            assert f"{cost.flops_ratio:.2f}×" in shown and f"{cost.bytes_ratio:.4f}×" in shown
            assert f"{ms(measured.verify_s)} (median of {measured.rounds})" in shown
            assert f"{ms(plain.itl_p50_s)} (answer 2, fused)" in shown
            assert f"{measured.verify_s / plain.itl_p50_s:.2f}×" in shown
            assert "The last answer was speculative (lookup, K 4)" in shown
            assert info.precision == "fp32"

    asyncio.run(scenario())


def test_bench_speculative_reports_a_plain_step_beside_the_verify_round(tiny_loaded):
    from engine.speculative.bench import bench_speculative

    result = bench_speculative(tiny_loaded, "lookup", 4, tokens=12, repeats=1, compile=False)
    assert result["identical"]
    for row in (result, *result["prompts"].values()):
        assert row["plain_step_ms"] > 0 and row["verify_ms_per_round"] >= 0
        assert row["speedup"] == pytest.approx(row["tok_s"] / row["plain_tok_s"], abs=2e-3)


def test_bench_says_beside_its_speculative_table_whether_the_answers_were_the_plain_ones():
    """`identical` was in --json only: the table's speed-ups read the same whether or not the
    speculative answers matched the plain ones."""
    from tui.cli.bench_table import speculative_identity

    said = speculative_identity([
        {"precision": "fp32", "speculative": {"identical": True}},
        {"precision": "w8", "speculative": {"identical": False}},
        {"precision": "bf16", "speculative": {}},
    ])  # fmt: skip
    assert said.splitlines() == [
        "  fp32: every speculative answer equals the plain one",
        "  w8: speculative answers DIFFER from the plain ones: greedy decoding must not (a bug)",
    ]


def test_bench_speculative_puts_speculation_against_the_compiled_step_from_its_first_answer(tiny_loaded):
    """With compile on, every plain answer decodes on the compiled step: each answer's session
    used to start while the step was still loading, so its first tokens ran eager (on SmolLM2 the
    plain step read 42-47 ms where the compiled one takes 37)."""
    from engine.speculative.bench import bench_speculative

    result = bench_speculative(tiny_loaded, "lookup", 4, tokens=8, repeats=1, compile=True)
    assert result["identical"]
    for row in (result, *result["prompts"].values()):
        assert row["plain_step_path"] == "compiled"


def test_a_speculative_answers_itl_is_its_time_per_token_not_a_rounds_gap():
    """A round's kept tokens arrive together: their gaps (~0) read 'ITL 0.1 ms'."""
    panel = PhasePanel()
    spec = dataclasses.replace(stats(25.0, "lookup, K 4"), itl_p50_s=1e-4)
    panel.final = spec
    assert panel.median_itl == pytest.approx(0.04)
    panel.ttft_s = 4.904  # the demo's int8 turn on a busy machine: the longest TTFT shown
    lines = str(panel._timings()).splitlines()
    assert "ITL 40.0 ms/token (round ÷ tokens)" in lines[0]
    assert max(cell_len(line) for line in lines) <= PANEL_CELLS  # it was cut: "(a round's token…"
    panel.final = stats(25.0)
    assert "/token" not in str(panel._timings())


def test_the_phase_panels_lines_fit_a_46_column_side():
    """Between 100 and 139 columns the side is 46 wide (41 cells of text): "median 1…", "(top = 9…"
    and "ITL 40.0 ms/token (round ÷ tok…" were cut there."""

    class Narrow(PhasePanel):
        content_size = Size(41, 7)

    for speculative in (None, "lookup, K 4"):
        panel = Narrow()
        panel.final = dataclasses.replace(stats(25.0, speculative), itl_p50_s=0.0153)
        panel.ttft_s, panel.itl = 4.548, [0.0744, 1.276]
        lines = [*str(panel._timings()).splitlines(), str(panel._caption())]
        assert max(cell_len(line) for line in lines) <= 41, lines
        assert "median" in lines[0] or "/token" in lines[0]
    assert "(top 1276 ms)" in lines[-1] or "speed-up" in lines[-1]


def test_the_80_column_strip_keeps_the_last_turn_whole():
    """It read "… · compiled  last tu…" at 80x24."""
    from engine.events import DecodeStep

    panel = PhasePanel()
    panel.decode_step = DecodeStep("compiled", "kernel", "ready", "", 58.0)
    panel.final = dataclasses.replace(stats(43.5, path="compiled", tokens=512), ttft_s=0.120, stop="length")
    strip = panel._strip()
    assert strip.plain.endswith("512 tokens · length") and strip.cell_length <= 78  # inside the border
