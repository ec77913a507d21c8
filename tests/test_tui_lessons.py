"""The lessons in the app: the context experiment (x in F6), the embeddings view (e in F2), the logit
lens (l in F2) and ablation (h in F2).

Driven through Pilot against the real engine and the tiny model, as tests/test_tui_instruments.py
drives the other instruments; the snapshot tests at the end pin how each view looks.
"""

from __future__ import annotations

import threading

import pytest
import torch
from textual.widgets import Input

from engine.events import PromptTokens, TurnFinished
from engine.instruments import context_sweep
from engine.instruments.ablation import MLP, Part, ablate
from engine.instruments.context_sweep import LLAMA_2_7B, LLAMA_2_70B, ContextSweep, shape_of
from engine.instruments.embeddings import token_embedding
from engine.instruments.explain import explain
from engine.instruments.logit_lens import context_before, logit_lens
from engine.kvcache import common_prefix
from engine.session import ChatSession
from tests.test_tui_instruments import (
    WIDE,
    Recorder,
    answered,
    on_engine,
    opened,
    recorder_of,
    run,
    session_of,
    settled,
    snapshot_app,
    tiny_app,
)
from tests.tui_screen import screen_text, wait_for
from tui.fmt import visible_piece
from tui.screens import context as context_screen
from tui.screens.ablation import AblationScreen
from tui.screens.context import ContextScreen, short_time
from tui.screens.embeddings import EmbeddingsScreen
from tui.screens.inspector import InspectorScreen
from tui.screens.lens import LensScreen
from tui.screens.phases import PhasesScreen
from tui.widgets.explanation import ExplanationPanel

SMALL = (80, 24)


async def swept(pilot) -> ContextScreen:
    """From F6, x starts the experiment; wait until every size is measured."""
    await opened(pilot, "f6", PhasesScreen)
    await opened(pilot, "x", ContextScreen)
    screen = pilot.app.screen
    await wait_for(
        pilot,
        lambda: screen.sizes and not screen.running and len(screen.points) == len(screen.sizes),
        timeout=120,
        what="the context sweep",
    )
    await pilot.pause(0.1)
    return screen


# -- the context experiment --------------------------------------------------------------------
def test_the_context_sweep_plots_each_size_and_the_chat_goes_on_as_before(tiny_model_dir, tmp_path):
    recorder = Recorder()

    async def scenario():
        app = tiny_app(recorder, tiny_model_dir, tmp_path)
        async with app.run_test(size=WIDE) as pilot:
            await answered(pilot, recorder)
            session = session_of(app)
            ids = list(session.cache.ids)
            keys = session.cache.layers[0].keys.clone()
            screen = await swept(pilot)
            assert [p.context for p in screen.points] == [16, 32, 64, 128, 256]  # the tiny window is 512
            assert "done: 5 sizes" in screen_text(app)
            assert "prefill ran the eager fast path, decode the eager fast path" in screen_text(app)
            screen.query_one("#body").scroll_end(animate=False)
            await pilot.pause(0.2)
            shown = screen_text(app)
            for p in screen.points:
                assert short_time(p.ttft_s) in shown and short_time(p.itl_s) in shown
            shape = shape_of(session)
            for s in (shape, LLAMA_2_7B, LLAMA_2_70B):
                assert f"c* = {s.crossover:,} tokens" in shown
            assert "computed from the formula" in shown
            # The chat's cache is as it was, and its next turn reuses it.
            assert session.cache.ids == ids and torch.equal(session.cache.layers[0].keys, keys)
            await pilot.press("escape")  # an instrument opened from another replaces it: back to the chat
            await wait_for(pilot, lambda: app.screen is app.default_screen)
            await pilot.press(*"And Germany?", "enter")
            await wait_for(pilot, lambda: len(recorder.of(TurnFinished)) == 2, timeout=60, what="turn 2")
            prompt = recorder.of(PromptTokens)[-1]
            assert prompt.reused == min(common_prefix(ids, list(prompt.ids)), len(prompt.ids) - 1) > 0

    run(scenario)


def test_esc_stops_the_sweep_and_a_second_esc_closes_it(tiny_model_dir, tmp_path, monkeypatch):
    recorder = Recorder()
    waiting, release = threading.Event(), threading.Event()
    measure = ContextSweep.measure

    def held(self, session, n, cancel=None):
        if n == 32:  # the second size waits until the test has pressed Esc
            waiting.set()
            release.wait(30)
        return measure(self, session, n, cancel)

    monkeypatch.setattr(ContextSweep, "measure", held)

    async def scenario():
        app = tiny_app(recorder, tiny_model_dir, tmp_path)
        async with app.run_test(size=WIDE) as pilot:
            await answered(pilot, recorder)
            await opened(pilot, "f6", PhasesScreen)
            await opened(pilot, "x", ContextScreen)
            await wait_for(pilot, waiting.is_set, timeout=60, what="the second size")
            await pilot.press("escape")
            await pilot.pause(0.1)
            assert isinstance(app.screen, ContextScreen) and "stopping" in screen_text(app)
            release.set()
            await wait_for(pilot, lambda: not app.screen.running, timeout=60, what="the sweep to stop")
            await pilot.pause(0.1)
            assert [p.context for p in app.screen.points] == [16]
            assert "stopped after 1 of 5 sizes" in screen_text(app)
            await pilot.press("r")  # runs again, from the first size
            await wait_for(pilot, lambda: not app.screen.running and len(app.screen.points) == 5, timeout=120)
            await pilot.pause(0.1)
            assert "done: 5 sizes" in screen_text(app)
            await pilot.press("escape")
            await wait_for(pilot, lambda: app.screen is app.default_screen)

    run(scenario)


# -- embeddings ----------------------------------------------------------------------------------
def test_e_in_the_inspector_shows_the_selected_tokens_embedding(tiny_model_dir, tmp_path):
    recorder = Recorder()

    async def scenario():
        app = tiny_app(recorder, tiny_model_dir, tmp_path)
        async with app.run_test(size=WIDE) as pilot:
            await answered(pilot, recorder)
            await opened(pilot, "f2", InspectorScreen)
            await pilot.press("home", "right")
            steps = app.screen.steps
            await opened(pilot, "e", EmbeddingsScreen)
            screen = app.screen
            await wait_for(pilot, lambda: screen.shown is not None, timeout=60, what="the embedding")
            assert screen.shown.token_id == steps[1].id
            expected = await on_engine(app, lambda s: token_embedding(s, steps[1].id))
            await pilot.pause(0.1)
            shown = screen_text(app)
            assert f"L2 norm {expected.norm:.3f}" in shown
            assert f"rank {expected.norm_rank:,} of {expected.vocab:,}" in shown
            for n in expected.neighbours:
                assert f"{n.cosine:+.3f}" in shown and visible_piece(n.piece) in shown
            assert "not tied" in shown and "The two q rows are equal" in shown
            await pilot.press("right")  # the next chip
            await wait_for(pilot, lambda: screen.shown.token_id == steps[2].id, timeout=60)

    run(scenario)


def test_the_palette_asks_for_text_and_bad_input_is_one_line(tiny_model_dir, tmp_path):
    recorder = Recorder()

    async def scenario():
        app = tiny_app(recorder, tiny_model_dir, tmp_path)
        async with app.run_test(size=WIDE) as pilot:
            await answered(pilot, recorder)
            await pilot.press("ctrl+p", *"Lesson: Embeddings")
            await pilot.pause(0.3)
            await pilot.press("enter")
            await wait_for(pilot, lambda: isinstance(app.screen, EmbeddingsScreen))
            screen = app.screen
            assert app.focused is screen.query_one("#text", Input)
            await pilot.press("space", "space", "enter")
            await wait_for(pilot, lambda: "✖ type some text" in screen_text(app))
            screen.query_one("#text", Input).value = " capital"
            await pilot.press("enter")
            session = session_of(app)
            first = session.tokenizer(" capital", add_special_tokens=False)["input_ids"][0]
            await wait_for(
                pilot, lambda: screen.shown is not None and screen.shown.token_id == first, timeout=60
            )
            assert "the 1 token of ' capital'" in screen_text(app) or "tokens of ' capital'" in screen_text(
                app
            )

    run(scenario)


def test_the_palette_opens_both_lessons_and_question_mark_explains_them(tiny_model_dir, tmp_path):
    recorder = Recorder()

    async def scenario():
        app = tiny_app(recorder, tiny_model_dir, tmp_path)
        async with app.run_test(size=WIDE) as pilot:
            await answered(pilot, recorder)
            for title, kind, name in (
                ("Lesson: Context length is not free", ContextScreen, "context"),
                ("Lesson: Embeddings", EmbeddingsScreen, "embeddings"),
            ):
                await pilot.press("ctrl+p", *title)
                await pilot.pause(0.3)
                await pilot.press("enter")
                await wait_for(pilot, lambda kind=kind: isinstance(app.screen, kind), what=title)
                if kind is EmbeddingsScreen:
                    app.set_focus(None)  # the text box would take the '?'
                panel = app.screen.query_one(ExplanationPanel)
                await pilot.press("question_mark")
                await pilot.pause(0.1)
                assert panel.is_open
                text = " ".join(screen_text(app).split())
                assert " ".join(explain(name).text.split()[:6]) in text
                assert explain(name).formula.split(";")[0].strip() in text
                if kind is ContextScreen:
                    await wait_for(pilot, lambda: not app.screen.running, timeout=120)
                await pilot.press("escape")
                await wait_for(pilot, lambda: not isinstance(app.screen, kind))

    run(scenario)


# -- snapshots --------------------------------------------------------------------------------
class WorkClock:
    """perf_counter that advances with the work fed (so the bars are the same on every run);
    the process always busy on 2 cores."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def process_time(self) -> float:
        return 2 * self.now

    def fed(self, new: int, cached: int) -> None:
        self.now += 0.004 + 0.0005 * new + 0.000004 * new * (cached + new)


def fixed_clock(monkeypatch) -> None:
    clock = WorkClock()
    forward = ChatSession.forward

    def timed(self, ids, cache=None):
        clock.fed(len(ids), len(self.cache if cache is None else cache))
        return forward(self, ids, cache)

    monkeypatch.setattr(ChatSession, "forward", timed)
    monkeypatch.setattr(context_sweep, "time", clock)
    monkeypatch.setattr(context_screen, "time", clock)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)


def test_snapshot_context_sweep(snap_compare, tiny_model_dir, tmp_path, monkeypatch):
    fixed_clock(monkeypatch)

    async def before(pilot):
        await answered(pilot, recorder_of(pilot))
        await swept(pilot)
        await settled(pilot)

    assert snap_compare(snapshot_app(tiny_model_dir, tmp_path), terminal_size=WIDE, run_before=before)


def test_snapshot_context_sweep_at_80x24(snap_compare, tiny_model_dir, tmp_path, monkeypatch):
    fixed_clock(monkeypatch)

    async def before(pilot):
        await answered(pilot, recorder_of(pilot))
        await swept(pilot)
        await settled(pilot)

    assert snap_compare(snapshot_app(tiny_model_dir, tmp_path), terminal_size=SMALL, run_before=before)


def from_the_inspector(key: str, kind, *moves: str):
    """A snapshot's run_before: answer, open F2, move to a step, open the lesson `key`, let it show."""

    async def before(pilot):
        await answered(pilot, recorder_of(pilot))
        await opened(pilot, "f2", InspectorScreen)
        await pilot.press(*moves)
        await opened(pilot, key, kind)
        await wait_for(pilot, lambda: pilot.app.screen.shown is not None, timeout=60)
        await settled(pilot)

    return before


def test_snapshot_embeddings(snap_compare, tiny_model_dir, tmp_path):
    before = from_the_inspector("e", EmbeddingsScreen, "home", "right")
    assert snap_compare(snapshot_app(tiny_model_dir, tmp_path), terminal_size=WIDE, run_before=before)


# -- the text chart ------------------------------------------------------------------------------
def test_bar_levels_fill_eighths_from_the_bottom():
    from tui.widgets.bar_chart import bar_levels

    assert bar_levels(10, 10, 2) == [8, 8]
    assert bar_levels(5, 10, 2) == [0, 8]
    assert bar_levels(7.5, 10, 2) == [4, 8]
    assert bar_levels(0.01, 10, 2) == [0, 1]  # above zero never vanishes
    assert bar_levels(0, 10, 2) == [0, 0]


def test_a_chart_shows_values_labels_and_pending_points():
    from tui.widgets.bar_chart import bar_chart

    lines = [
        line.plain for line in bar_chart(["16", "32", "64"], [1.0, 2.0, None], lambda v: f"{v:.1f} s", 2)
    ]
    assert "1.0 s" in lines[0] and "2.0 s" in lines[0]
    assert lines[1].startswith("2.0 s┤") and "█" in lines[1]
    assert "·" in lines[2]  # 64 not measured yet: a dot on the baseline
    assert lines[-1].split() == ["16", "32", "64"]
    assert len({len(line) for line in lines[1:-1]}) == 1  # the rows line up


# -- the logit lens and ablation (l and h in F2) -------------------------------------------------
def test_l_in_the_inspector_shows_the_lens_of_the_selected_step(tiny_model_dir, tmp_path):
    recorder = Recorder()

    async def scenario():
        app = tiny_app(recorder, tiny_model_dir, tmp_path)
        async with app.run_test(size=WIDE) as pilot:
            await answered(pilot, recorder)
            await opened(pilot, "f2", InspectorScreen)
            await pilot.press("home", "right")
            await opened(pilot, "l", LensScreen)
            screen = app.screen
            await wait_for(pilot, lambda: screen.shown is not None, timeout=60, what="the lens")
            trace = session_of(app).messages[-1].trace
            ids, chosen = context_before(trace, 1)
            expected = await on_engine(app, lambda s: logit_lens(s, ids, chosen))
            await pilot.pause(0.1)
            shown = screen_text(app)
            assert screen.shown.chosen.id == chosen == trace.steps[1].id
            for reading in expected.layers:  # every layer's row: its guesses and its entropy
                row = next(line for line in shown.splitlines() if line.startswith(f" {reading.layer:>5}  "))
                assert f"{reading.entropy_bits:5.2f}" in row and f"{reading.top[0].prob:6.1%}" in row
            assert "After the last layer the lens is the model's own distribution" in shown
            await pilot.press("right")  # the next step
            await wait_for(pilot, lambda: screen.shown.chosen.id == trace.steps[2].id, timeout=60)

    run(scenario)


def test_h_in_the_inspector_turns_a_part_off_and_arrows_choose_it(tiny_model_dir, tmp_path):
    recorder = Recorder()

    async def scenario():
        app = tiny_app(recorder, tiny_model_dir, tmp_path)
        async with app.run_test(size=WIDE) as pilot:
            await answered(pilot, recorder)
            await opened(pilot, "f2", InspectorScreen)
            await opened(pilot, "h", AblationScreen)
            screen = app.screen
            await wait_for(pilot, lambda: screen.shown is not None, timeout=60, what="the ablation")
            assert screen.shown.part == Part(1, MLP)  # the tiny model's last layer's MLP first
            await pilot.press("down")
            await wait_for(pilot, lambda: screen.shown.part == Part(1, 0), timeout=60, what="head 0")
            await pilot.press("left_square_bracket")
            await wait_for(pilot, lambda: screen.shown.part == Part(0, 0), timeout=60, what="layer 0")
            trace = session_of(app).messages[-1].trace
            ids, chosen = context_before(trace, len(trace.steps) - 1)
            expected = await on_engine(app, lambda s: ablate(s, ids, chosen, Part(0, 0)))
            await pilot.pause(0.1)
            shown = " ".join(screen_text(app).split())
            assert f"KL(as it is ‖ off) {expected.kl_nats:.4f} nats" in shown
            assert "with layer 0, head 0 off" in shown

    run(scenario)


@pytest.mark.parametrize("name", ["lens", "ablation"])
def test_the_palette_opens_the_step_lessons_and_question_mark_explains_them(tiny_model_dir, tmp_path, name):
    recorder = Recorder()
    kind = {"lens": LensScreen, "ablation": AblationScreen}[name]
    title = f"Lesson: {explain(name).title}"

    async def scenario():
        app = tiny_app(recorder, tiny_model_dir, tmp_path)
        async with app.run_test(size=WIDE) as pilot:
            await answered(pilot, recorder)
            await pilot.press("ctrl+p", *title)
            await pilot.pause(0.3)
            await pilot.press("enter")
            await wait_for(pilot, lambda: isinstance(app.screen, kind), what=title)
            await wait_for(pilot, lambda: app.screen.shown is not None, timeout=60, what="its result")
            await pilot.press("question_mark")
            await pilot.pause(0.1)
            text = " ".join(screen_text(app).split())
            assert " ".join(explain(name).text.split()[:6]) in text

    run(scenario)


def test_a_lens_row_fits_an_80_column_screen_whole():
    """A row's rank wrapped onto a line of its own at 80 columns ("…  0.0%" then "#3,018")."""
    from engine.instruments.logit_lens import Guess, LayerReading
    from tui.screens.lens import header, layer_row

    wide = Guess(1, "abcdefghijklmnop", 0.505)  # cut to its cells, with "…"
    widest = LayerReading(29, (wide, wide, wide), 15.59, 0.999, 49_152)
    appears = LayerReading(29, (wide, wide, wide), 15.59, 0.999, 1)
    for row in (layer_row(widest, 2, None), layer_row(appears, 1, 29), header()):
        assert row.cell_length <= 78, row.plain


def test_snapshot_logit_lens(snap_compare, tiny_model_dir, tmp_path):
    before = from_the_inspector("l", LensScreen, "home", "right")
    assert snap_compare(snapshot_app(tiny_model_dir, tmp_path), terminal_size=WIDE, run_before=before)


def test_snapshot_ablation_at_80x24(snap_compare, tiny_model_dir, tmp_path):
    before = from_the_inspector("h", AblationScreen)
    assert snap_compare(snapshot_app(tiny_model_dir, tmp_path), terminal_size=SMALL, run_before=before)
