"""A prompt the model cannot fit, sent in the app (issue 17): it leaves no conversation and no
title behind; the next prompt starts the conversation and names it."""

from __future__ import annotations

import asyncio

from engine.saved.store import Store
from tests.tui_fakes import fake_app
from tests.tui_screen import wait_for, widget_text
from tui.engine_link import inference_worker
from tui.widgets.chat_log import ChatLog
from tui.widgets.prompt_input import PromptInput

LONG = "inference " * 150


def test_a_refused_prompt_in_the_app_leaves_no_conversation_or_title(tiny_model_dir, tmp_path):
    async def scenario():
        app = fake_app(
            inference_worker,
            tmp_path,
            model=str(tiny_model_dir),
            device="cpu",
            context=100,
            sampling={"temperature": 0, "max_new_tokens": 4},
        )
        async with app.run_test(size=(160, 45)) as pilot:
            await wait_for(pilot, lambda: app.turns.ready, timeout=60, what="the model to load")
            app.query_one(PromptInput).text = LONG
            await pilot.press("enter")
            chat = app.query_one(ChatLog)
            await wait_for(pilot, lambda: "context window is 100" in widget_text(chat), timeout=60)
            with Store() as store:
                assert store.list_conversations() == []
            await pilot.press(*"short", "enter")
            await wait_for(pilot, lambda: app.history.conversation_id is not None, timeout=60)
            await wait_for(pilot, lambda: not app.turns.busy, timeout=60, what="the answer")
            with Store() as store:
                assert [c.title for c in store.list_conversations()] == ["short"]

    asyncio.run(scenario())
