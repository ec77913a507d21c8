"""`llmchat top`: a live view of a server's load. A worker thread polls the server
(engine/remote/server_stats.py) and only posts each reading; the handler updates the widgets, so
the screen never waits on the network. Esc or q quits (cutting a poll in flight)."""

from __future__ import annotations

import time
from collections import deque

from textual import on, work
from textual.app import App, ComposeResult
from textual.containers import Horizontal
from textual.message import Message
from textual.widget import Widget
from textual.widgets import Static

from engine.remote.cancel import CancelEvent
from engine.remote.server_stats import Reading, Watch
from tui.config import DEFAULT_THEME
from tui.fmt import plain_text
from tui.top.figures import FIGURES, Figure, header, history_line, slot_line, status, text

HISTORY = 120
"""Polls each sparkline keeps (two minutes at the default interval)."""


class Polled(Message):
    """A reading, from the poll thread to the UI thread."""

    def __init__(self, reading: Reading) -> None:
        super().__init__()
        self.reading = reading


class History(Widget):
    """A sparkline of a figure's last polls, one column each (a gap where a poll had no value),
    as wide as the space it is given."""

    def __init__(self, top: float | None) -> None:
        super().__init__()
        self.top = top
        self.values: deque[float | None] = deque(maxlen=HISTORY)

    def add(self, value: float | None) -> None:
        self.values.append(value)
        self.refresh()

    def render(self) -> str:
        return history_line(self.values, self.size.width, self.top)


class FigureRow(Horizontal):
    """A figure's label, its value this poll, and its recent history."""

    def __init__(self, figure: Figure) -> None:
        super().__init__(id=figure.key)
        self.figure = figure

    def compose(self) -> ComposeResult:
        yield Static(self.figure.label, classes="label")
        yield Static("", classes="value")
        yield History(self.figure.top)

    def show(self, reading: Reading) -> None:
        self.query_one(".value", Static).update(text(self.figure, reading))
        reported = not reading.snapshot.error and self.figure.reported(reading.snapshot)
        self.query_one(History).add(self.figure.value(reading) if reported else None)


class TopApp(App[None]):
    CSS = """
    Screen { padding: 0 1; }
    #header { color: $primary; text-style: bold; }
    #hint { color: $foreground 60%; }
    #status { color: $error; height: 1; text-wrap: nowrap; text-overflow: ellipsis; }
    FigureRow { height: 1; }
    FigureRow .label { width: 20; }
    FigureRow .value { width: 22; }
    FigureRow History { width: 1fr; height: 1; color: $primary; }
    #slots-title { margin-top: 1; color: $foreground 60%; }
    #slots { height: auto; }
    """
    BINDINGS = [("q", "quit", "Quit"), ("escape", "quit", "Quit")]

    def __init__(self, watch: Watch, interval_s: float) -> None:
        super().__init__()
        self.watch = watch
        self.interval_s = interval_s
        self.stop = CancelEvent()
        """Set on quit: ends the poll loop and cuts a poll in flight."""
        self.readings = 0

    def compose(self) -> ComposeResult:
        server, model = header(self.watch.server.info)
        yield Static(plain_text(server), id="header")
        yield Static(plain_text(f"{model} · every {self.interval_s:g} s · q or Esc quits"), id="hint")
        yield Static("", id="status")
        for figure in FIGURES:
            yield FigureRow(figure)
        yield Static("slots (tokens held / context)", id="slots-title")
        yield Static("", id="slots")

    def on_mount(self) -> None:
        from themes import load_themes

        for theme in load_themes():
            self.register_theme(theme)
        self.theme = DEFAULT_THEME
        self.query_one("#slots-title").display = False
        self._poll()

    @work(thread=True, exclusive=True, exit_on_error=False)
    def _poll(self) -> None:
        """Poll at a steady pace until `stop`; the readings go to the UI thread as messages."""
        next_at = time.monotonic()
        try:
            with self.watch.client.connections.cut_on(self.stop):
                while not self.stop.is_set():
                    reading = self.watch.poll()
                    if self.stop.is_set():
                        break
                    self.post_message(Polled(reading))
                    next_at = max(next_at + self.interval_s, time.monotonic())
                    self.stop.wait(next_at - time.monotonic())
        finally:
            self.watch.close()

    @on(Polled)
    def _show(self, message: Polled) -> None:
        reading = message.reading
        self.readings += 1
        self.query_one("#status", Static).update(plain_text(status(reading)))
        for row in self.query(FigureRow):
            row.show(reading)
        slots = reading.snapshot.slots
        self.query_one("#slots-title").display = bool(slots)
        self.query_one("#slots", Static).update("\n".join(slot_line(slot) for slot in slots or ()))

    def action_quit(self) -> None:
        self.stop.set()
        self.exit()

    def on_unmount(self) -> None:
        self.stop.set()
