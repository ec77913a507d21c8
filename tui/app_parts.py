"""The app as its helpers see it: what tui/history.py, tui/router.py and tui/instruments.py use of
tui/app.py `ChatApp`, and what tui/instruments.py uses of an open instrument screen.

ChatApp builds those helpers and hands them itself; typing them against these Protocols, not
ChatApp or InstrumentScreen, keeps the imports one way: the app imports its helpers, the
instrument screens import tui/instruments.py, and neither is imported back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol, TypeVar, runtime_checkable

from textual.notifications import SeverityLevel
from textual.screen import Screen
from textual.timer import Timer
from textual.widget import Widget

if TYPE_CHECKING:
    from engine.events import Event, TurnStats
    from tui.engine_link import Engine
    from tui.options import AppOptions
    from tui.turns import TurnState

WidgetType = TypeVar("WidgetType", bound=Widget)


class MeasuresTurns(Protocol):
    last_stats: TurnStats | None
    """The figures of the last finished turn (tui/instruments.py Instruments)."""


class AppParts(Protocol):
    """What the helpers use of tui/app.py ChatApp: its state, its widgets, its screens."""

    options: AppOptions
    engine: Engine | None
    turns: TurnState
    precision: str
    instruments: MeasuresTurns

    def part(self, kind: type[WidgetType]) -> WidgetType:
        """The main screen's widget of this kind, also while a dialog is on top."""
        ...

    def notify(
        self,
        message: str,
        *,
        title: str = "",
        severity: SeverityLevel = "information",
        timeout: float | None = None,
        markup: bool = False,
    ) -> None: ...

    def action_stop(self) -> None: ...

    def refresh_bindings(self) -> None: ...

    def set_timer(self, delay: float, callback: Callable[[], Any] | None = None) -> Timer: ...

    def query_one(self, selector: type[WidgetType]) -> WidgetType: ...

    @property
    def screen(self) -> Screen[Any]: ...

    @property
    def screen_stack(self) -> list[Screen[Any]]: ...

    def push_screen(self, screen: Screen[Any]) -> Any: ...

    def switch_screen(self, screen: Screen[Any]) -> Any: ...

    def pop_screen(self) -> Any: ...


@runtime_checkable
class InstrumentView(Protocol):
    """An open instrument screen (tui/screens/instrument.py InstrumentScreen) as tui/instruments.py
    sees it: it hears the in-order engine events and explains itself."""

    def engine_said(self, event: Event) -> None: ...

    def action_explain(self) -> None: ...
