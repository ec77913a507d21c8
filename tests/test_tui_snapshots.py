"""Snapshot tests (pytest-textual-snapshot): the main screen mid-answer, wide and 80x24, and settings.

The fake engine emits fixed events and holds the answer after five tokens, the cursor does
not blink, and the config file is a temporary one, so each picture is the same every run.
Update after an intended change with `pytest tests/test_tui_snapshots.py --snapshot-update`.
"""

from __future__ import annotations

from textual.widgets import Input

from tests.tui_fakes import FakeFactory, fake_app
from tests.tui_screen import wait_for, widget_text
from tui.screens.settings import SettingsScreen


async def mid_answer(pilot) -> None:
    factory = pilot.app.engine_factory
    await wait_for(pilot, lambda: pilot.app.turns.ready)
    await pilot.press(*"What is the capital of France?", "enter")
    await wait_for(pilot, lambda: factory.engine.holding.is_set())
    # On the screen, not only in the answer's text: a loaded machine may paint a frame later.
    await wait_for(pilot, lambda: "France" in widget_text(pilot.app.query_one("Answer")))
    # The panels repaint twice a second: paint them now, so the picture shows all five tokens
    # held, whether or not the half second passed.
    pilot.app.router.repaint_stats()
    await pilot.pause(0.2)


def test_main_screen_mid_answer(snap_compare, tmp_path):
    app = fake_app(FakeFactory(hold_after=5), tmp_path)
    assert snap_compare(app, terminal_size=(160, 45), run_before=mid_answer)


def test_main_screen_mid_answer_80x24(snap_compare, tmp_path):
    app = fake_app(FakeFactory(hold_after=5), tmp_path)
    assert snap_compare(app, terminal_size=(80, 24), run_before=mid_answer)


def test_settings_with_an_invalid_value(snap_compare, tmp_path):
    async def open_settings(pilot) -> None:
        await wait_for(pilot, lambda: pilot.app.turns.ready)
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: isinstance(pilot.app.screen, SettingsScreen))
        pilot.app.screen.query_one("#top_p", Input).value = "1.5"
        # the check runs on the Changed message: on a busy machine a fixed pause can miss it
        await wait_for(pilot, lambda: pilot.app.screen.query_one("#top_p-error").display)
        await pilot.pause(0.2)

    app = fake_app(FakeFactory(), tmp_path)
    assert snap_compare(app, terminal_size=(100, 40), run_before=open_settings)
