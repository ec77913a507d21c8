"""Read what a Textual app under test shows, as plain text lines (for assertions)."""

from __future__ import annotations

import asyncio
from typing import Callable

from textual.app import App
from textual.pilot import Pilot


def screen_text(app: App) -> str:
    """The whole screen (top layer included) as text, one line per row."""
    strips = app.screen._compositor.render_strips()
    return "\n".join(strip.text.rstrip() for strip in strips)


async def wait_for(
    pilot: Pilot, condition: Callable[[], bool], timeout: float = 10.0, what: str = ""
) -> None:
    """Let the app run until `condition()` holds; fail with the screen shown if it never does."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what or condition}\n{screen_text(pilot.app)}")
        await pilot.pause(0.02)
    await pilot.pause()


def widget_text(widget) -> str:
    """What one widget shows: its region cut out of the screen (by cells, so wide characters are fine)."""
    region = widget.region
    strips = widget.app.screen._compositor.render_strips()[region.y : region.bottom]
    return "\n".join(strip.crop(region.x, region.right).text.rstrip() for strip in strips)
