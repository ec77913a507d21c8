"""`llmchat demo SCRIPT`: the chat app driven by a script (tui/demo_script.py), one step per key.

Each step applies its settings, asks its question (once: going back does not ask again), opens
its instrument when the answer is in, presses the step's keys there, and shows its caption under
whatever is on top. The demo's keys are the app's own while it runs (a presenter's clicker sends
PgDn/PgUp or the arrows); they give way to the script's own keys as it presses them, and to
typing where a text field has focus, so the lecturer can still ask a question of their own.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from textual.actions import SkipAction
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import Input, TextArea

from engine.events import ModelInfo, TurnStats
from tui.app import ChatApp
from tui.demo_script import SAMPLING_FIELDS, DemoScript, Settings
from tui.engine_link import EngineFactory, inference_worker
from tui.messages import EngineStarted
from tui.options import AppOptions
from tui.widgets.chat_log import ChatLog
from tui.widgets.demo_caption import DemoCaption
from tui.widgets.prompt_input import PromptInput

DEMO_ACTIONS = {"demo_step", "demo_end"}


class DemoApp(ChatApp):
    BINDINGS = [
        Binding("right,space,pagedown", "demo_step(1)", "Next", priority=True),
        Binding("left,pageup", "demo_step(-1)", "Back", priority=True),
        Binding("q", "demo_end", "End demo", priority=True),
    ]

    def __init__(
        self,
        script: DemoScript,
        options: AppOptions | None = None,
        engine_factory: EngineFactory = inference_worker,
    ) -> None:
        super().__init__(options, engine_factory)
        self.script = script
        self.at = -1
        """The step shown (0-based); -1 until the engine has started."""
        self.asked: set[int] = set()
        """Steps whose question was sent."""
        self.opened: int | None = None
        """The step whose instrument is open."""
        self.replaying = False
        """The script's keys are being pressed: the demo's bindings let them through."""
        self.ended = False
        self.original: dict[str, Any] = {}
        """Each setting the demo changed, as it was before: restored when going back past it."""

    # -- the steps -------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield from super().compose()
        yield DemoCaption()

    # Textual calls these after ChatApp's own handlers of the same name have run (each class in
    # the MRO handles a message), so they add to them rather than replace them.
    def on_mount(self) -> None:
        self.call_after_refresh(self.set_focus, None)  # the demo's keys act; Tab reaches the prompt
        self._show_caption()

    def on_engine_started(self, message: EngineStarted) -> None:
        self.call_later(self.go, 0)  # settings need the engine: the first step starts now

    async def go(self, index: int) -> None:
        """Show step `index`: its settings, its question (if not asked yet), then its instrument."""
        self.at = index
        step = self.script.steps[index]
        self._close_instruments()
        self._apply(self.script.settings_at(index))
        if step.prompt and index not in self.asked:
            self.asked.add(index)
            await self.submit(step.prompt)
        self._show_caption()
        await self._open_when_answered()

    def _close_instruments(self) -> None:
        while len(self.screen_stack) > 1:
            self.pop_screen()
        self.opened = None

    async def _open_when_answered(self) -> None:
        """The step's instrument, once the model is loaded and nothing is being answered."""
        step = self.script.steps[self.at]
        if step.instrument is None or self.opened == self.at:
            return
        if not self.turns.ready or self.turns.stoppable:
            return  # called again when the turn is over or the model is ready
        self.opened = index = self.at
        mounted = self.instruments.open(step.instrument)
        if mounted is None:
            return
        await mounted
        if index != self.at or len(self.screen_stack) == 1:
            return  # moved on meanwhile, or it was closed
        await self.screen.mount(DemoCaption())
        self._show_caption()
        self.call_later(self._take_keys, step.keys)  # after the focus the screen queued on mount

    def _take_keys(self, keys: tuple[str, ...]) -> None:
        """An instrument opened bare focuses its text box (the embeddings lesson), where the demo's
        keys would type spaces and the demo could not go on: the keys are the demo's and the
        script's (Tab or a click still reaches the box)."""
        if isinstance(self.focused, (Input, TextArea)):
            self.screen.set_focus(None)
        self._press(keys)

    def _press(self, keys: tuple[str, ...]) -> None:
        """Press the script's keys in the instrument; the demo's own bindings step aside for them
        (cleared by a callback queued after the keys, so after the app has read them)."""
        if not keys:
            return
        self.replaying = True
        for key in keys:
            self.simulate_key(key)
        self.call_later(setattr, self, "replaying", False)

    def _apply(self, settings: Settings) -> None:
        """The step's settings, each one the script stopped setting put back as it was."""
        if self.engine is None or self.sampling is None:
            return
        sampling = dict(settings.sampling)
        for name in sampling:
            self.original.setdefault(name, getattr(self.sampling, name))
        for name, value in self.original.items():
            if name in SAMPLING_FIELDS:
                sampling.setdefault(name, value)
        self.apply_sampling(dataclasses.replace(self.sampling, **sampling), remember=False)
        self._set_kv_cache(settings.kv_cache)
        self._set_speculation(settings.speculative)

    def _set_kv_cache(self, wanted: str | None) -> None:
        if wanted is not None:
            self.original.setdefault("kv_cache", self._kv_cache_now())
        wanted = wanted or self.original.get("kv_cache")
        if wanted is not None and wanted != self._kv_cache_now() and not self.options.remote:
            self.kv_cache = wanted
            self.engine.set_cache_precision(wanted)

    def _set_speculation(self, wanted: str | None) -> None:
        if wanted is not None:
            self.original.setdefault("speculative", self.speculation[0])
            drafter = None if wanted == "off" else wanted
        else:
            drafter = self.original.get("speculative", self.speculation[0])
        if drafter != self.speculation[0]:
            self.speculation = (drafter, self.speculation[1])
            self.engine.set_speculation(*self.speculation)

    # -- what the class reads ------------------------------------------------------------
    def _show_caption(self) -> None:
        steps = self.script.steps
        if self.at < 0:
            caption, state = steps[0].caption, "starting the engine"
        else:
            caption, state = steps[self.at].caption, self._state()
        for screen in self.screen_stack:
            for widget in screen.query(DemoCaption):
                widget.show(max(self.at, 0) + 1, len(steps), caption, state)

    def _state(self) -> str:
        """What the step still waits for, if anything."""
        if self.turns.loading:
            return "loading the model"
        if self.turns.warming and self.turns.waiting:
            return "waiting for the compiled step"
        if self.turns.stoppable:
            return "answering"
        return "the last step" if self.at == len(self.script.steps) - 1 else ""

    def _refresh_keys(self) -> None:
        super()._refresh_keys()  # called when a turn starts or ends, and when a load ends
        if not self.ended:
            self._show_caption()

    def _turn_finished(self, stats: TurnStats, error: str) -> None:
        super()._turn_finished(stats, error)
        if not self.ended and self.at >= 0:
            self.call_later(self._open_when_answered)

    def _model_ready(self, info: ModelInfo) -> None:
        super()._model_ready(info)
        if not self.ended and self.at >= 0:
            self.call_later(self._open_when_answered)

    # -- the keys ------------------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in DEMO_ACTIONS:
            return not self.ended  # hidden from the footer once the demo has ended
        return super().check_action(action, parameters)

    async def action_demo_step(self, delta: int) -> None:
        if self.replaying or self._typing() or self.at < 0:
            raise SkipAction()
        target = self.at + delta
        if 0 <= target < len(self.script.steps):
            await self.go(target)

    def action_demo_end(self) -> None:
        if self.replaying or isinstance(self.focused, (Input, TextArea)):
            raise SkipAction()  # q is a letter where one is typed
        self.ended = True
        for screen in self.screen_stack:
            for widget in screen.query(DemoCaption):
                widget.remove()
        self.part(ChatLog).add_note("The demo has ended: the chat is yours (Ctrl+Q quits).")
        self.part(PromptInput).focus()
        self.refresh_bindings()

    def _typing(self) -> bool:
        """A text field has focus and holds text: the keys are the typist's."""
        focused = self.focused
        if isinstance(focused, TextArea):
            return bool(focused.text)
        return isinstance(focused, Input) and bool(focused.value)
