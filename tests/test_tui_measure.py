"""What a projected demo must not hide: which decode step runs (and why), and a busy machine.

Pilot tests on the Phase panel with the real engine (tiny model, LLMCHAT_COMPILE=0 as in all
tests) and with the fake engine driven through every compile state; snapshot tests of the
panel while a compile builds on a busy machine, and of it once the compiled step runs.
"""

from __future__ import annotations

import asyncio

import pytest

from engine.events import Contention, DecodeStep, TurnFinished
from tests.test_tui_instruments import Recorder, answered, tiny_app
from tests.tui_fakes import FakeFactory, fake_app
from tests.tui_screen import wait_for, widget_text
from tui.widgets import phase
from tui.widgets.chat_log import ChatLog
from tui.widgets.phase import PhasePanel

WIDE = (160, 48)
BUSY = Contention(0.45, "schedstat", 3.1, 2, busy=True)
CALM = Contention(0.97, "schedstat", 0.4, 2, busy=False)
FEWER = Contention(0.97, "schedstat", 1.1, 2, busy=True, threads=1, configured_threads=2, fewer_share=0.8)


def run(scenario) -> None:
    asyncio.run(scenario())


def panel_text(app) -> str:
    return widget_text(app.query_one(PhasePanel))


class Clock:
    """time.monotonic for the panel, moved by hand (the building time counts from it)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_a_narrow_phase_panel_says_why_in_short_not_cut(tiny_model_dir, tmp_path):
    """At 120 columns the reason lost its end ("--no-compile / LLMCHAT_COMP…"): now its short form."""

    async def scenario():
        app = tiny_app(Recorder(), tiny_model_dir, tmp_path)
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.turns.ready, timeout=60)
            await pilot.pause(0.2)
            lines = panel_text(app).splitlines()
            assert any(line.strip(" │").strip() == "compile off: --no-compile" for line in lines), lines
            assert not any("LLMCHAT_COMP" in line for line in lines)

    asyncio.run(scenario())


def test_the_real_engine_with_compile_off_says_eager_and_why(tiny_model_dir, tmp_path):
    recorder = Recorder()

    async def scenario():
        app = tiny_app(recorder, tiny_model_dir, tmp_path)
        async with app.run_test(size=WIDE) as pilot:
            await answered(pilot, recorder)
            shown = panel_text(app)
            assert "decode step eager fused · attention" in shown
            assert "compile off: --no-compile (or LLMCHAT_COMPILE=0)" in shown
            # Beside the figures: the CPU share the turn was measured at (busy or not, said).
            measured = recorder.of(TurnFinished)[0].stats.contention
            assert measured is not None
            if measured.fewer_threads:  # others took a core meanwhile (engine/threads.py)
                assert f"⚠ busy machine: {measured.threads} of 2 threads" in shown
            elif measured.busy:
                assert f"⚠ busy machine: CPU {measured.cpu_share:.0%}" in shown
            else:
                assert f"CPU share {measured.cpu_share:.0%}" in shown

    run(scenario)


def test_the_panel_follows_the_compile_from_building_to_compiled(tmp_path, monkeypatch):
    clock = Clock()
    monkeypatch.setattr(phase, "time", clock)
    building = DecodeStep("eager", "SDPA", "building", "compiling in the background", elapsed_s=12.0)

    async def scenario():
        app = fake_app(FakeFactory(decode_step=building), tmp_path)
        async with app.run_test(size=WIDE) as pilot:
            await wait_for(pilot, lambda: app.turns.ready)
            await wait_for(pilot, lambda: "compiling 0:12…" in panel_text(app))
            assert "decode step eager · SDPA · compiling 0:12…" in panel_text(app)
            clock.now += 53  # the build goes on: its time counts on without a new event
            await wait_for(pilot, lambda: "compiling 1:05…" in panel_text(app), timeout=5)
            ready = DecodeStep("compiled", "kernel", "ready", "torch.compile, ready after 65 s")
            await app.router.show(ready)
            await pilot.pause()
            shown = panel_text(app)
            assert "decode step compiled · attention kernel" in shown and "ready after 65 s" in shown
            assert "compiling" not in shown

    run(scenario)


def test_a_failed_or_given_up_compile_is_said_plainly(tmp_path):
    failed = DecodeStep("eager", "SDPA", "failed", "compile failed: no C++ compiler")
    given_up = DecodeStep(
        "eager",
        "SDPA",
        "given up",
        "compile given up: the build ran past 900 s",
    )

    async def scenario():
        app = fake_app(FakeFactory(decode_step=failed), tmp_path)
        async with app.run_test(size=WIDE) as pilot:
            await wait_for(pilot, lambda: app.turns.ready)
            await wait_for(pilot, lambda: "compile failed: no C++ compiler" in panel_text(app))
            await app.router.show(given_up)
            await pilot.pause()
            assert "compile given up: the build ran past 900 s" in panel_text(app)

    run(scenario)


@pytest.mark.parametrize(
    ("measured", "panel", "line"),
    [
        (BUSY, "⚠ busy machine: CPU 45%", "figures slowed (CPU share 45%"),
        # Others took a core: the forward ran on the one left (engine/threads.py).
        (FEWER, "⚠ busy machine: 1 of 2 threads", "figures slowed (ran on 1 of 2 threads 80% of"),
    ],
)
def test_a_turn_on_a_busy_machine_is_flagged_beside_its_figures(tmp_path, measured, panel, line):
    async def scenario():
        app = fake_app(FakeFactory(contention=measured), tmp_path)
        async with app.run_test(size=WIDE) as pilot:
            await wait_for(pilot, lambda: app.turns.ready)
            await pilot.press(*"Hi", "enter")
            await wait_for(pilot, lambda: not app.turns.busy and app.query_one(PhasePanel).final is not None)
            await pilot.pause(0.6)
            assert panel in panel_text(app)
            chat = " ".join(widget_text(app.query_one(ChatLog)).split())
            assert f"43.5 tok/s · ⚠ busy machine: {line}" in chat

    run(scenario)


def test_the_one_line_strip_says_busy_and_which_step(tmp_path):
    async def scenario():
        app = fake_app(FakeFactory(contention=BUSY), tmp_path)
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_for(pilot, lambda: app.turns.ready)
            await pilot.press(*"Hi", "enter")
            await wait_for(pilot, lambda: not app.turns.busy and app.query_one(PhasePanel).final is not None)
            await pilot.pause(0.6)
            strip = app.query_one(PhasePanel)._strip().plain
            assert "⚠ busy machine" in strip and "eager fused" in strip

    run(scenario)


async def _compile_building_on_a_busy_machine(pilot) -> None:
    app = pilot.app
    await wait_for(pilot, lambda: app.turns.ready)
    await pilot.press(*"What is the capital of France?", "enter")
    await wait_for(pilot, lambda: not app.turns.busy and app.query_one(PhasePanel).final is not None)
    await pilot.pause(0.7)


def test_snapshot_phase_panel_compiling_on_a_busy_machine(snap_compare, tmp_path, monkeypatch):
    monkeypatch.setattr(phase, "time", Clock())  # the building time stays at 0:12
    building = DecodeStep("eager", "SDPA", "building", "compiling in the background", elapsed_s=12.0)
    app = fake_app(FakeFactory(decode_step=building, contention=BUSY), tmp_path)
    assert snap_compare(app, terminal_size=WIDE, run_before=_compile_building_on_a_busy_machine)


def test_snapshot_phase_panel_compiled_on_a_calm_machine(snap_compare, tmp_path):
    ready = DecodeStep("compiled", "kernel", "ready", "torch.compile, ready after 58 s", 58.0)
    app = fake_app(FakeFactory(decode_step=ready, contention=CALM), tmp_path)
    assert snap_compare(app, terminal_size=WIDE, run_before=_compile_building_on_a_busy_machine)
