"""A burst of Enter in the app (issue 17): a prompt is sent once, an empty box sends nothing."""

from __future__ import annotations

import asyncio

from textual import events

from tests.tui_fakes import FakeEngine, FakeFactory, fake_app
from tests.tui_screen import wait_for
from tui.widgets.chat_log import UserMessage
from tui.widgets.prompt_input import PromptInput

WIDE = (160, 45)


def burst(prompt: PromptInput, presses: int = 30) -> None:
    """Enter pressed `presses` times, all arriving before the app has handled the first one."""
    for _ in range(presses):
        prompt.post_message(events.Key("enter", "\r"))


async def settled(pilot) -> None:
    app = pilot.app
    await pilot.pause(0.5)
    await wait_for(pilot, lambda: not app.turns.busy and not app.turns.waiting, what="the turns to end")
    await pilot.pause(0.2)


def sends(engine: FakeEngine) -> list[tuple]:
    return [call for call in engine.calls if call[0] == "send"]


def test_a_burst_of_enter_sends_the_prompt_once(tmp_path):
    async def scenario():
        factory = FakeFactory()
        app = fake_app(factory, tmp_path)
        async with app.run_test(size=WIDE) as pilot:
            await wait_for(pilot, lambda: app.turns.ready, what="the model to load")
            prompt = app.query_one(PromptInput)
            await pilot.press(*"hello")
            burst(prompt)
            await settled(pilot)
            assert sends(factory.engine) == [("send", "hello")]
            assert len(app.query(UserMessage)) == 1 and prompt.text == ""
            burst(prompt)  # an empty box sends nothing
            await settled(pilot)
            assert sends(factory.engine) == [("send", "hello")]

    asyncio.run(scenario())
