"""The llmchat app: layout, keys, and handing engine events to the widgets.

The engine runs on its own thread and is reached only through `Engine` calls; its events
come back as messages (see `tui.messages`). Handlers here are the only place widgets change.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from functools import partial
from pathlib import Path
from typing import Callable, Iterable, TypeVar

from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.notifications import SeverityLevel
from textual.screen import Screen
from textual.theme import Theme
from textual.timer import Timer
from textual.widget import Widget
from textual.widgets import Footer, Static

from engine.events import (
    CachePrecisionChanged,
    ConversationLoaded,
    DecodeStep,
    Event,
    Failed,
    MessageSaved,
    ModelInfo,
    ModelReady,
    SamplingResolved,
    TurnFinished,
    TurnStats,
)
from themes import load_themes
from tui import config
from tui.engine_link import Engine, EngineFactory, inference_worker, resolve_sampling
from tui.fmt import model_sampling_note, system_default_note, visible_controls
from tui.history import History
from tui.instruments import INSTRUMENT_BINDINGS, Instruments
from tui.messages import Doorbell, EngineEvent, EngineStarted, Inbox, Pacer, gathered
from tui.options import AppOptions
from tui.router import Router, turn_summary
from tui.stop_signals import catch_stop_signals, end_later
from tui.turns import TurnState
from tui.widgets.chat_log import ChatLog, ChatMessage, UserMessage
from tui.widgets.kv_cache import SHORT_DTYPE, KVCachePanel
from tui.widgets.phase import PhasePanel
from tui.widgets.prompt_input import PromptInput
from tui.widgets.status_bar import StatusBar
from tui.widgets.token_stream import TokenStream
from tui.widgets.top_k import TopKPanel

WidgetType = TypeVar("WidgetType", bound=Widget)
PANELS_HINT = "Panels: ↑↓ PgUp PgDn or the mouse wheel scroll them · Ctrl+T back to the chat"
"""Shown on a small terminal while the panels replace the chat (they are taller than the screen)."""
SHUTDOWN_S = 15.0
"""How long quitting waits for the engine to save and stop (a forward step or a save; not a load)."""
NO_MODEL = "✖ not sent: no model is loaded (choose another precision in Settings, or restart with --model)"


class ChatApp(App[None]):
    CSS_PATH = "app.tcss"
    # The screen gets these classes by size; app.tcss collapses the panels on small terminals.
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (100, "-medium"), (140, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (28, "-tall")]
    BINDINGS = [
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+n", "new_chat", "New"),
        Binding("ctrl+r", "regenerate", "Regenerate"),
        Binding("ctrl+s", "settings", "Settings"),
        Binding(
            "ctrl+o", "conversations", "Chats", show=False
        ),  # the 80-column footer is full; F1 and Ctrl+P list it
        Binding("alt+up", "select_message", "Select message", show=False),
        Binding("ctrl+t", "toggle_panels", "Panels"),
        Binding("f1", "help", "Help"),
        Binding("ctrl+q", "quit", "Quit", priority=True),
        *INSTRUMENT_BINDINGS,  # F2-F9: the teaching instruments (tui/instruments.py)
    ]

    def __init__(
        self, options: AppOptions | None = None, engine_factory: EngineFactory = inference_worker
    ) -> None:
        super().__init__()
        self.options = options or AppOptions()
        self.engine_factory = engine_factory
        self.engine: Engine | None = None
        self.sampling = None
        self.model_sampling: tuple[tuple[str, ...], str | None] = ((), None)
        """The sampling fields that hold the loaded model's own defaults, and where they come from."""
        self.precision = "server" if self.options.remote else self.options.precision
        self.speculation: tuple[str | None, int] = (self.options.speculative, self.options.draft_tokens)
        """The drafter (None: plain decoding) and K, as last asked for (Settings shows them)."""
        self.kv_cache: str | None = self.options.kv_cache
        """The KV cache precision as last asked for (None: the model precision's own)."""
        self.turns = TurnState()
        self.turns.warming = self.options.warm_first and not self.options.remote
        self.inbox = Inbox()
        self.pacer = Pacer()
        self.router = Router(self)
        self.history = History(self)
        self.instruments = Instruments(self)
        self._update_timer: Timer | None = None
        self._keys_state: tuple[bool, bool] | None = None
        self._parts: dict[type, Widget] = {}
        self._restore_signals: Callable[[], None] = lambda: None

    def part(self, kind: type[WidgetType]) -> WidgetType:
        """The main screen's widget of this kind, also while a dialog is on top
        (`query_one` asks the top screen)."""
        found = self._parts.get(kind)
        if found is None:
            found = self._parts[kind] = self.screen_stack[0].query_one(kind)
        return found

    def notify(
        self,
        message: str,
        *,
        title: str = "",
        severity: SeverityLevel = "information",
        timeout: float | None = None,
        markup: bool = False,
    ) -> None:
        """Every toast is plain text with its control characters shown: a toast carries a server's
        error body, a path or an exception's words, where `[/]` would end the app with MarkupError."""
        if not markup:
            message, title = visible_controls(message), visible_controls(title, one_line=True)
        super().notify(message, title=title, severity=severity, timeout=timeout, markup=markup)

    def _fatal_error(self) -> None:
        """Textual's crash report, without the frames' local variables (Textual shows them, and
        they may hold the API key or the conversation)."""
        import rich
        from rich.segment import Segments
        from rich.traceback import Traceback

        self.bell()
        report = Traceback(show_locals=False, width=None, suppress=[rich])
        self._exit_renderables.append(Segments(self.console.render(report, self.console.options)))
        self._close_messages_no_wait()

    def compose(self) -> ComposeResult:
        yield StatusBar()
        with Horizontal(id="body"):
            with Vertical(id="left"):
                yield ChatLog(id="chat")
                yield TokenStream(id="tokens")
            with VerticalScroll(id="side"):
                yield PhasePanel(id="phase")
                yield KVCachePanel(id="kv")
                yield TopKPanel(id="topk")
        yield Static(PANELS_HINT, id="panels-hint", markup=False)
        yield PromptInput(id="prompt")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        for theme in load_themes():
            self.register_theme(theme)
        self._start_theme()
        prompt = self.part(PromptInput)
        prompt.cursor_blink = self.options.cursor_blink
        prompt.focus()
        if self.options.remote:
            from engine.remote.target import shown_url  # a query in the URL may hold a key

            self.part(StatusBar).connecting(shown_url(self.options.server))
        else:
            self.part(StatusBar).starting(self.options.model, self.precision)
        # Importing torch takes seconds: do it off the UI thread so the app is usable at once.
        threading.Thread(target=self._start_engine, name="llmchat-engine-start", daemon=True).start()
        loop = asyncio.get_running_loop()
        self._restore_signals = catch_stop_signals(partial(self._stop_signal, loop))

    def _stop_signal(self, loop: asyncio.AbstractEventLoop, signum: int, hung_up: bool) -> None:
        """SIGTERM or SIGHUP (in a signal handler): quit as Ctrl+Q does, exit code 128 + the signal.

        The answer is stopped at once, so the engine saves it whatever the screen is doing."""
        if self.engine is not None:
            self.engine.cancel()
        loop.call_soon_threadsafe(partial(self.exit, return_code=128 + signum))
        if hung_up:  # a safety net: the quit may block on the terminal that is gone
            end_later(128 + signum, partial(self.engine.shutdown, 60.0) if self.engine else None)

    def _start_theme(self) -> None:
        """Open with the flag's or the config file's theme; an unknown one is reported, never saved over."""
        wanted = self.options.theme
        if wanted in self.available_themes:
            self.theme = wanted
            if self.options.theme_from_flag:  # `--theme` is remembered; the file's own is left as it is
                self._save_theme(wanted, quiet=True)
        else:
            self.notify(
                f"unknown theme {wanted!r}; using {config.DEFAULT_THEME} (the config file is left as it is)",
                severity="warning",
            )
            self.theme = config.DEFAULT_THEME
        # Subscribed after the start theme's own change is published (call_next runs in order):
        # only the user's later choices are saved from here on.
        self.call_next(self.theme_changed_signal.subscribe, self, self._theme_chosen)

    def _theme_chosen(self, theme: Theme) -> None:
        self._save_theme(theme.name)

    def _save_theme(self, name: str, quiet: bool = False) -> None:
        """Write the theme into the config file; `quiet` at start, where load_config reported a bad file."""
        try:
            config.save_theme(name, self.options.config_path)
        except config.ConfigError as e:
            if not quiet:
                self.notify(str(e), severity="warning")
        except OSError as e:
            self.notify(f"the theme was not saved: {e}", severity="warning")

    def _save_sampling(self, changed: dict[str, object]) -> None:
        """Remember the changed sampling fields for the next start (the theme is remembered the same way)."""
        try:
            config.save_sampling(changed, self.options.config_path)
        except config.ConfigError as e:  # an unreadable file is never rewritten
            self.notify(str(e), severity="warning")
        except OSError as e:
            self.notify(f"could not save the sampling settings: {e}", severity="warning")

    # -- engine events -------------------------------------------------------------
    def _start_engine(self) -> None:
        """On a background thread: import the engine, create its worker, and say so."""
        try:
            sampling, problem, chosen = resolve_sampling(self.options.sampling)
            engine = self.engine_factory(self._emit, sampling, self.options.system, self.options.context)
            engine.set_sampling(sampling, chosen=chosen)  # kept when the model has defaults of its own
        except Exception as e:  # an engine that cannot start is shown; the app stays open
            self._emit(Failed(f"the engine could not start: {type(e).__name__}: {e}"))
            return
        self.post_message(EngineStarted(engine, sampling, problem))

    def _emit(self, event: Event) -> None:
        """Called on the inference thread: hand the event to the UI thread (see tui.messages)."""
        if not gathered(event):
            self.post_message(EngineEvent(event, before=self.inbox.before_ordered()))
        elif self.inbox.put(event):
            self.post_message(Doorbell())

    def on_engine_started(self, message: EngineStarted) -> None:
        self.engine, self.sampling = message.engine, message.sampling
        self.part(TopKPanel).set_sampling(message.sampling)
        if message.problem:  # flags were checked before the app opened: these come from config.json
            path = self.options.config_path or config.config_path()
            self._error(f"sampling settings in {path}: {message.problem}")
        if self.options.remote:
            self.engine.connect(self.options.target())
        else:
            if self.kv_cache:  # before the load: the first cache is made at this precision
                self.engine.set_cache_precision(self.kv_cache)
            self._load_model()
            if self.speculation[0]:  # queued after the load: the draft needs the model's tokenizer
                self.engine.set_speculation(*self.speculation)
        self.history.engine_started()  # a --resume goes after the load in the engine's queue

    def on_doorbell(self) -> None:
        if self._update_timer is None:
            self._update_timer = self.set_timer(max(0.001, self.pacer.delay(time.monotonic())), self._update)

    async def _update(self) -> None:
        """Show what the inbox gathered since the last update."""
        if self._update_timer is not None:
            self._update_timer.stop()
            self._update_timer = None
        tokens, figures = self.inbox.take()
        if tokens or figures:
            self.pacer.updated(time.monotonic())
            await self.router.show_gathered(tokens, figures)

    async def on_engine_event(self, message: EngineEvent) -> None:
        try:
            await self._show_in_order(message)
        finally:
            if self.inbox.ordered_shown():  # tokens that came after it waited for it
                self.on_doorbell()

    async def _show_in_order(self, message: EngineEvent) -> None:
        tokens, figures = message.before  # what was gathered before this event, shown first
        if tokens or figures:
            await self.router.show_gathered(tokens, figures)
        await self.instruments.on_event(message.event)  # step mode, fork, measurements
        match message.event:
            case ModelReady(info):
                self._model_ready(info)
            case SamplingResolved():
                self._sampling_resolved(message.event)
            case CachePrecisionChanged(info):
                self.part(KVCachePanel).set_model(info)  # empty now: the next turn prefills again
            case TurnFinished(stats, _, error):
                self._turn_finished(stats, error)
            case Failed(text):
                await self._failed(text)
            case ConversationLoaded() | MessageSaved():
                await self.history.show(message.event)
            case DecodeStep(compile=state):
                await self.router.show(message.event)
                if self.turns.warming and state != "building":  # ready, or it never will be
                    self.turns.warming = False
                    self._pump()
            case event:
                await self.router.show(event)

    def _sampling_resolved(self, event: SamplingResolved) -> None:
        """The loaded model's own sampling defaults took the fields the user did not set: say so."""
        from engine.sampling import SamplingSettings

        self.sampling = SamplingSettings(**event.settings)
        self.model_sampling = (event.from_model, event.source)
        self.part(TopKPanel).set_sampling(self.sampling)
        if event.from_model:
            self.part(ChatLog).add_note(f"Sampling: {model_sampling_note(event)}; Settings changes it.")
        if self.options.system_is_default and self.options.resume is None:
            note = system_default_note(self.options.system)
            self.part(ChatLog).add_note(f"System prompt {note}; Settings changes it.")

    def _turn_finished(self, stats: TurnStats, error: str) -> None:
        self.part(ChatLog).finish(turn_summary(stats, error))
        self.part(PhasePanel).finish(stats, self.instruments.speedup)
        self.part(KVCachePanel).finish(stats)
        self.router.repaint_stats()
        if stats.server is not None and stats.server.fingerprint:
            self.part(StatusBar).fingerprint(stats.server.fingerprint)
        if error:  # the partial answer is kept; the turn is over like any other
            self.notify(error, title="Error", severity="error", timeout=8)
        self._turn_over()

    def _model_ready(self, info: ModelInfo) -> None:
        switched = self.part(StatusBar).info is not None
        self.turns.load_finished(have_model=True)
        self.precision = info.precision
        self.part(StatusBar).ready(info)
        self.part(KVCachePanel).set_model(info)
        self.part(TopKPanel).set_model(info)
        if info.server is not None:
            self.part(PhasePanel).set_server(info.server.kind)  # it decodes: its step is not known here
            self.part(ChatLog).add_note(server_note(info))
        elif switched:
            self.part(ChatLog).add_note(
                f"Now running at {info.precision} on {info.device}. The conversation is kept; the KV cache "
                "starts empty, so the next turn prefills the whole conversation again."
            )
        self._pump()

    async def _failed(self, text: str) -> None:
        self._error(text)
        if self.turns.busy:  # the running turn failed
            self.part(ChatLog).finish(f"✖ {text}")
            self._turn_over()
        elif self.turns.loading:  # the load failed; an earlier model, if any, stays in use
            status = self.part(StatusBar)
            self.turns.load_finished(have_model=status.info is not None)
            self.precision = status.info.precision if status.info else self.precision
            status.failed(text)
            if not self.turns.ready:
                self._withdraw(NO_MODEL)
            self._pump()

    def _error(self, text: str) -> None:
        self.part(ChatLog).add_note(f"✖ {text}", error=True)
        self.notify(text, title="Error", severity="error", timeout=8)

    # -- turns ---------------------------------------------------------------------
    async def on_prompt_input_submitted(self, message: PromptInput.Submitted) -> None:
        if message.editing is not None:
            await self.history.submit_edit(message.editing, message.text)
            return
        await self.submit(message.text)  # the prompt box emptied itself when it sent the text

    async def submit(self, text: str) -> None:
        """Ask `text`: shown in the chat at once, sent when the engine can take it."""
        chat = self.part(ChatLog)
        await chat.add_user(text)
        await chat.expect_answer(self.turns.submit(text))
        self._pump()

    def _pump(self) -> None:
        """Hand the next waiting prompt to the engine when it can take it."""
        prompt = self.turns.next_prompt() if self.engine is not None else None
        if prompt is not None:
            self.engine.send(prompt)
        self._refresh_keys()

    def _load_model(self) -> None:
        """Load the model at the precision in force, as the options say it is prompted."""
        options = self.options
        prompted = (options.raw, options.template_text, options.thinking)
        self.engine.load(options.model, self.precision, options.device, *prompted)

    def _turn_over(self) -> None:
        self.turns.turn_over()
        self._pump()

    def _withdraw(self, note: str) -> None:
        """Take back the waiting prompts; the first goes back into the input rather than being lost."""
        prompts = self.turns.withdraw()
        for answer in self.part(ChatLog).take_waiting():
            answer.set_note(note)
        prompt = self.part(PromptInput)
        if prompts and not prompt.text:
            prompt.put_back(prompts[0])

    # -- actions -----------------------------------------------------------------
    def _refresh_keys(self) -> None:
        """Redraw the footer only when a key's state changed (redrawing it is not free)."""
        state = (self.turns.stoppable, self.turns.ready and not self.turns.busy)
        if state != self._keys_state:
            self._keys_state = state
            self.refresh_bindings()
            # A steady cursor while the model answers: each blink is a repaint the decode would pay for.
            self.part(PromptInput).cursor_blink = self.options.cursor_blink and not self.turns.busy

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Dim keys that would do nothing right now (None shows them disabled)."""
        if action == "stop":
            return True if self.turns.stoppable else None
        if action == "regenerate":
            return True if (self.turns.ready and not self.turns.busy) else None
        return True

    def action_stop(self) -> None:
        if self.turns.waiting:
            self._withdraw("⏹ not sent (Esc)")
        if self.turns.busy and self.engine is not None:
            self.engine.cancel()
        self._refresh_keys()

    async def action_new_chat(self) -> None:
        self.turns.withdraw()
        if self.engine is not None:
            self.engine.cancel()
            self.engine.new_chat(self.options.system)
        self.history.new_chat()
        await self.part(ChatLog).clear()
        for panel in (TokenStream, TopKPanel, KVCachePanel, PhasePanel):
            self.part(panel).clear()
        self.instruments.last_stats = None
        self.part(PromptInput).focus()

    async def action_regenerate(self) -> None:
        if self.engine is None or not self.turns.start_other():
            return
        chat = self.part(ChatLog)
        await chat.drop_last_answer()
        await chat.expect_answer("regenerating…")
        self.engine.regenerate()
        self._refresh_keys()

    def deliver_screenshot(
        self, filename: str | None = None, path: str | None = None, time_format: str | None = None
    ) -> str | None:
        """The palette's Screenshot: an SVG of the screen, saved where the user said (`--shots`,
        config.json) or in the data dir, and the path said. Textual's default, ~/Downloads, need
        not exist ("Failed to save screenshot"); in a browser the browser downloads it."""
        if self.is_web:
            return super().deliver_screenshot(filename, path, time_format)
        from engine.saved.store import data_dir

        folder = Path(path or self.options.shots or data_dir() / "screenshots").expanduser()
        try:
            folder.mkdir(parents=True, exist_ok=True)
            saved = self.save_screenshot(filename, str(folder), time_format)
        except OSError as e:
            self.notify(f"screenshot not saved in {folder}: {e.strerror or e}", severity="error")
            return None
        self.notify(f"screenshot saved: {saved}", title="Screenshot")
        return saved

    def action_settings(self) -> None:
        if self.sampling is None:
            self.notify("Settings open once the engine has started (a few seconds).")
            return
        self.push_screen(self._settings_screen())

    def _settings_screen(self) -> Screen:
        """Settings as they are now; the app's own themes first."""
        from tui.screens.settings import SettingsScreen  # imports torch, so only once the engine has

        info = self.part(StatusBar).info
        themes = sorted(self.available_themes, key=lambda name: (not name.startswith("llmchat-"), name))
        return SettingsScreen(
            self.precision,
            info.device if info else self.options.device,
            self.sampling,
            themes,
            (*self.speculation, self.options.model),
            server=info.server if info else None,
            kv_cache=self._kv_cache_now(),
            model_sampling=self.model_sampling,
        )

    def _kv_cache_now(self) -> str:
        """The KV cache precision in use (the KV panel's model info follows every change)."""
        info = self.part(KVCachePanel).info
        if info is None:
            return self.kv_cache or "fp32"
        return SHORT_DTYPE.get(info.cache_dtype, info.cache_dtype)

    def on_settings_screen_kvcache_chosen(self, message) -> None:
        self.kv_cache = message.precision
        if self.engine is not None and not self.options.remote:
            self.engine.set_cache_precision(message.precision)

    def on_settings_screen_speculation_chosen(self, message) -> None:
        self.speculation = (message.choice, message.k)
        if self.engine is not None:
            self.engine.set_speculation(message.choice, message.k)

    def on_settings_screen_precision_chosen(self, message) -> None:
        if self.engine is None or self.options.remote:
            return
        self.precision = message.precision
        self.turns.load_started()
        self.part(StatusBar).loading(self.options.model, self.precision, "queued", 0.0)
        self._load_model()
        self._refresh_keys()

    def on_settings_screen_sampling_applied(self, message) -> None:
        self.apply_sampling(message.settings, remember=True)

    def apply_sampling(self, settings, remember: bool) -> None:
        """Sample with `settings` from the next token, and say what changed; `remember` saves the
        changed fields for the next start (a demo's are not)."""
        from tui.screens.settings import changes, describe_changes

        old, self.sampling = self.sampling, settings
        changed = changes(old, settings)
        if not changed:
            return
        if self.engine is not None:
            self.engine.set_sampling(settings, chosen=changed)
        from_model, source = self.model_sampling
        self.model_sampling = (tuple(name for name in from_model if name not in changed), source)
        self.part(TopKPanel).set_sampling(settings)

        when = "from the next answer" if self.options.remote else "from the next token"
        self.notify(describe_changes(old, settings) + f" ({when})", title="Sampling")
        if remember:
            self._save_sampling(changed)

    def action_conversations(self) -> None:
        from tui.screens.conversations import ConversationsScreen

        def chosen(conversation_id: int | None) -> None:
            if conversation_id is not None:
                self.history.resume(conversation_id)

        self.push_screen(ConversationsScreen(self.history.conversation_id), chosen)

    def action_select_message(self) -> None:
        self.history.select_last()

    def on_chat_message_version_step(self, message: ChatMessage.VersionStep) -> None:
        self.history.step(message.index, message.step)

    def on_user_message_edit_requested(self, message: UserMessage.EditRequested) -> None:
        self.history.request_edit(message.index, message.text)

    def on_chat_message_leave(self) -> None:
        self.part(PromptInput).focus()

    def action_toggle_panels(self) -> None:
        screen = self.screen_stack[0]
        screen.toggle_class("-panels")
        if screen.has_class("-narrow") or screen.has_class("-short"):  # the panels replace the chat
            if screen.has_class("-panels"):
                screen.query_one("#side").focus()  # so the arrow keys scroll them
            else:
                self.part(PromptInput).focus()

    def action_help(self) -> None:
        from tui.screens.help import HelpScreen

        self.push_screen(HelpScreen())

    def action_instrument(self, name: str, step: int | None = None) -> None:
        """Open a teaching instrument (F2-F9, the palette, a click on a token chip)."""
        self.instruments.open(name, step)

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        for title, help_text, callback in PALETTE:
            yield SystemCommand(title, help_text, callback(self))
        yield from self.instruments.commands()
        yield from super().get_system_commands(screen)

    def on_unmount(self) -> None:
        if self.engine is not None:
            # Stops the answer; the engine saves it and the KV cache. Given time to finish: a process
            # that exits while the engine thread is still in torch (a save on a busy machine) can
            # die in interpreter shutdown instead of exiting with its code.
            self.engine.shutdown(timeout=SHUTDOWN_S)
        self._restore_signals()


PALETTE: list[tuple[str, str, Callable[[ChatApp], Callable[[], object]]]] = [
    ("Stop", "Stop the answer; the partial answer stays (Esc)", lambda app: app.action_stop),
    ("New chat", "Clear the conversation and the cache (Ctrl+N)", lambda app: app.action_new_chat),
    ("Regenerate", "Answer the last prompt again (Ctrl+R)", lambda app: app.action_regenerate),
    ("Settings", "Precision, sampling and theme (Ctrl+S)", lambda app: app.action_settings),
    (
        "Conversations",
        "Saved chats: search, resume, rename, delete, export (Ctrl+O)",
        lambda app: app.action_conversations,
    ),
    (
        "Edit last message",
        "Edit your last message and answer it again; the old branch stays",
        lambda app: app.history.edit_last,
    ),
    (
        "Previous version",
        "Show the previous version (branch) of the newest message that has one",
        lambda app: partial(app.history.step_last, -1),
    ),
    (
        "Next version",
        "Show the next version (branch) of the newest message that has one",
        lambda app: partial(app.history.step_last, 1),
    ),
    (
        "Select message",
        "Select a message: ↑↓ move, ←→ versions, e edit (Alt+↑)",
        lambda app: app.action_select_message,
    ),
    ("Toggle panels", "Show or hide the inference panels (Ctrl+T)", lambda app: app.action_toggle_panels),
    ("Help", "Keys and what each panel shows (F1)", lambda app: app.action_help),
]
"""The chat's commands in the palette (Ctrl+P): title, help, and the app's callback for it;
the instruments add theirs (tui/instruments.py)."""


def server_note(info: ModelInfo) -> str:
    """Said once in the chat when a server answers: which it is, and what its panels lack."""
    server = info.server
    lines = [
        f"Connected to {server.kind} {server.version or ''} at {server.url}, model {info.name}."
        " The server keeps the weights and the KV cache; the panels show what it reports.",
        f"· top-k: {server.top_k_note}",
        *(f"· not reported: {line}" for line in server.unreported),
    ]
    return "\n".join(lines)


def make_app(options: AppOptions | None = None, engine_factory: EngineFactory = inference_worker) -> ChatApp:
    """The app factory: tests pass a fake engine; the CLI passes options from flags and config."""
    return ChatApp(options, engine_factory)


def run_app(make: Callable[[AppOptions], ChatApp] = make_app, **flags) -> None:
    """Entry point for `llmchat` with no subcommand (and `lecture`; `demo` makes its own app):
    flags override the config file."""
    from tui.options import options_from

    _need_a_terminal()
    loaded, problem = config.load_config()
    app = make(options_from(loaded, **flags))
    if problem:
        app.call_later(app.notify, problem, severity="warning")
    app.run()
    code = app.return_code or 0  # 143 after SIGTERM, 129 after SIGHUP
    compiled = sys.modules.get("engine.fast.compiled")  # only if torch was ever loaded
    if compiled is not None:
        compiled.exit_if_compiling(code)  # the engine has saved and stopped
    if code:
        sys.exit(code)


def _need_a_terminal() -> None:
    """Exit 2 unless stdin and stdout are a terminal: Textual would wait for keys that never come
    (under `llmchat web` they are textual-serve's pipes, which bring the browser's keys)."""
    if os.environ.get("TEXTUAL_DRIVER", "").endswith(":WebDriver"):
        return
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        print(
            "llmchat: the chat app needs a terminal (stdin and stdout are not one); "
            "for answers without one use `llmchat ask PROMPT`",
            file=sys.stderr,
        )
        raise SystemExit(2)
