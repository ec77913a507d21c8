"""The serving lab screen (F9) through Pilot against the real engine and the tiny model:
it shows the engine's own numbers, Esc stops the lab and frees its pool while the chat's
KV cache stays as it was, bad input is one line, and a snapshot pins how it looks."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from textual.widgets import Input, Select

from engine.events import TurnFinished
from engine.instruments import phases
from engine.instruments.explain import explain
from engine.lab import run as lab_run
from engine.lab import scheduler, sweep
from tests.test_tui_instruments import (
    FIXED_PEAKS,
    WIDE,
    FakeClock,
    Recorder,
    answered,
    opened,
    run,
    session_of,
    settled,
    snapshot_app,
    tiny_app,
)
from tests.tui_screen import screen_text, wait_for
from tui.screens.lab import SATURATE, VIEWS, LabScreen
from tui.widgets.explanation import ExplanationPanel


def fill(screen: LabScreen, **values: str) -> None:
    for name, value in values.items():
        screen.query_one(f"#{name}", Input).value = value


def cache_state(app) -> tuple[list[int], list[torch.Tensor]]:
    cache = session_of(app).cache
    return list(cache.ids), [layer.keys.clone() for layer in cache.layers if layer.keys is not None]


def test_lab_shows_the_engine_numbers_and_frees_its_pool(tiny_model_dir, tmp_path):
    recorder = Recorder()

    async def scenario():
        app = tiny_app(recorder, tiny_model_dir, tmp_path)
        async with app.run_test(size=WIDE) as pilot:
            await answered(pilot, recorder)
            ids, keys = cache_state(app)
            screen = await opened(pilot, "f9", LabScreen) and app.screen
            fill(screen, requests="3", max_batch="2", budget_mib="1")
            await pilot.press("r")
            await wait_for(pilot, lambda: screen.result is not None, timeout=120, what="the lab")
            await pilot.pause(0.4)
            shown = screen_text(app)
            data = screen.result.to_json()
            for p in data["policies"]:
                row = f"{p['policy']:<11}{p['throughput_tok_s']:>8.1f}{p['ttft_ms_p50']:>10.0f}"
                assert row in shown
            for point in screen.result.sweep:
                assert f"{point.batch:>3}{point.aggregate_tok_s:>17.1f}" in shown
            assert (
                f"{data['pool']['blocks']} blocks × 16 tokens" in shown and data["pool"]["formula"] in shown
            )
            assert "● measured" in str(screen.query_one("#plot").render())
            assert "done: every policy gave" in shown
            assert screen.lab.pool.num_blocks == 0 and screen.lab.pool.keys == []  # freed
            after_ids, after_keys = cache_state(app)
            assert after_ids == ids and all(torch.equal(a, b) for a, b in zip(keys, after_keys))

    run(scenario)


def test_saturate_runs_a_workload_the_engine_limits_and_says_so(tiny_model_dir, tmp_path):
    recorder = Recorder()

    async def scenario():
        app = tiny_app(recorder, tiny_model_dir, tmp_path)
        async with app.run_test(size=WIDE) as pilot:
            await wait_for(pilot, lambda: app.turns.ready, timeout=60)
            screen = await opened(pilot, "f9", LabScreen) and app.screen
            fill(screen, max_batch="2", budget_mib="1")
            screen.query_one("#arrivals", Select).value = SATURATE
            await pilot.press("r")
            await wait_for(pilot, lambda: screen.result is not None, timeout=120, what="the lab")
            await pilot.pause(0.4)
            config = screen.result.config
            assert (config.requests, config.arrivals, config.min_new) == (8, "once", 1)
            assert screen.query_one("#requests", Input).value == "8"  # the form shows what ran
            assert "engine-bound: every request arrived at once" in screen_text(app)

    run(scenario)


def test_escape_stops_the_lab_frees_the_pool_and_the_chat_goes_on(tiny_model_dir, tmp_path):
    recorder = Recorder()

    async def scenario():
        app = tiny_app(recorder, tiny_model_dir, tmp_path)
        async with app.run_test(size=WIDE) as pilot:
            await answered(pilot, recorder)
            ids, keys = cache_state(app)
            screen = await opened(pilot, "f9", LabScreen) and app.screen
            fill(screen, requests="400", budget_mib="2")  # minutes of work: Esc comes first
            await pilot.press("r")
            await wait_for(
                pilot, lambda: screen.lab is not None and screen.lab.pool.used_blocks > 0, timeout=60
            )
            await pilot.press("escape")
            await wait_for(pilot, lambda: screen.lab.pool.num_blocks == 0, timeout=30, what="the pool freed")
            assert not isinstance(app.screen, LabScreen) and screen.result is None
            after_ids, after_keys = cache_state(app)
            assert after_ids == ids and all(torch.equal(a, b) for a, b in zip(keys, after_keys))
            await pilot.press(*"And Germany?", "enter")
            await wait_for(
                pilot, lambda: len(recorder.of(TurnFinished)) == 2, timeout=60, what="the next answer"
            )

    run(scenario)


def test_bad_input_is_one_line_and_nothing_runs(tiny_model_dir, tmp_path):
    recorder = Recorder()

    async def scenario():
        app = tiny_app(recorder, tiny_model_dir, tmp_path)
        async with app.run_test(size=WIDE) as pilot:
            await wait_for(pilot, lambda: app.turns.ready, timeout=60)
            screen = await opened(pilot, "f9", LabScreen) and app.screen
            for values, message in (
                ({"max_batch": "0"}, "max-batch must be at least 1"),
                ({"max_batch": "4", "budget_mib": "0.001"}, "holds no block"),
                ({"budget_mib": "0.02"}, "raise --budget-mib"),
                ({"budget_mib": "lots"}, "pool MiB must be a number"),
            ):
                fill(screen, **values)
                await pilot.press("r")
                await wait_for(pilot, lambda: "✖" in screen_text(app) and not screen.running, timeout=60)
                assert message in screen_text(app) and screen.result is None
                screen.query_one("#status").update("")

    run(scenario)


def test_question_mark_explains_every_view(tiny_model_dir, tmp_path):
    recorder = Recorder()

    async def scenario():
        app = tiny_app(recorder, tiny_model_dir, tmp_path)
        async with app.run_test(size=WIDE) as pilot:
            await wait_for(pilot, lambda: app.turns.ready, timeout=60)
            await opened(pilot, "f9", LabScreen)
            panels = list(app.screen.query(ExplanationPanel))
            assert len(panels) == 1 + len(VIEWS) and not any(p.is_open for p in panels)
            await pilot.press("question_mark")
            await pilot.pause(0.1)
            assert all(p.is_open for p in panels)
            assert [p.explanation for p in panels] == [
                explain(k) for k in ("lab", *(f"lab.{v}" for v in VIEWS))
            ]
            shown = " ".join(screen_text(app).split())
            assert " ".join(explain("lab").text.split()[:6]) in shown
            for view in VIEWS:  # each view's panel sits right above the view
                title = app.screen.query_one(f"#{view}-title")
                explained = app.screen.query_one(f"#{view}-explain")
                assert explained.region.y > title.region.y and explained.region.height > 2
            await pilot.press("question_mark")
            await pilot.pause(0.1)
            assert not any(p.is_open for p in panels)

    run(scenario)


class QuietMeter:
    def stop(self):
        return SimpleNamespace(busy=False)


def test_snapshot_lab(snap_compare, tiny_model_dir, tmp_path, monkeypatch):
    # Every step 10 ms on the lab's clock, and fixed peaks: the same picture on every run.
    monkeypatch.setattr(scheduler, "time", FakeClock())
    monkeypatch.setattr(sweep, "time", FakeClock())
    monkeypatch.setattr(sweep, "ContentionMeter", QuietMeter)  # the suite's own load is no busy spell
    monkeypatch.setattr(lab_run, "ContentionMeter", QuietMeter)
    monkeypatch.setattr(phases, "cached_calibration", lambda device, dtype, path=None: FIXED_PEAKS)

    async def before(pilot):
        await wait_for(pilot, lambda: pilot.app.turns.ready, timeout=60)
        await opened(pilot, "f9", LabScreen)
        screen = pilot.app.screen
        fill(screen, requests="4", max_batch="2", budget_mib="0.25")
        await pilot.press("r")
        await wait_for(pilot, lambda: screen.result is not None, timeout=120)
        await settled(pilot)

    assert snap_compare(snapshot_app(tiny_model_dir, tmp_path), terminal_size=(160, 60), run_before=before)
