"""How engine events reach the UI thread without flooding it.

The inference thread calls `emit` for every event. Tokens and figures that only matter
in their newest form (cache size, prefill progress, loading progress) go into an `Inbox`
(a lock and two containers, so the inference thread pays about a microsecond per token),
and a `Doorbell` message is posted only when the inbox was empty: duplicates replace each
other in the queue (`can_replace`). Every other event is posted as an `EngineEvent` that
carries what the inbox had gathered before it, so the UI sees everything in emit order.
The UI drains the inbox on a paced timer (`Pacer`), so a 2,000-token answer at GPU speed
costs the UI a bounded number of repaints instead of one per token.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from textual.message import Message

from engine.events import CacheChanged, Event, ModelLoading, PrefillProgress, TokenSampled

if TYPE_CHECKING:
    from tui.engine_link import Engine

REPLACEABLE = (CacheChanged, PrefillProgress, ModelLoading)
"""Events where only the newest matters: a figure, not a history."""


def gathered(event: Event) -> bool:
    """Tokens and figures go through the inbox; everything else is posted at once, in order."""
    return isinstance(event, (TokenSampled, *REPLACEABLE))


Gathered = tuple[list[TokenSampled], list[Event]]


class EngineEvent(Message):
    """An event handled in order (a phase change, the end of a turn, an error), after what came before it."""

    def __init__(self, event: Event, before: Gathered) -> None:
        super().__init__()
        self.event = event
        self.before = before


class Doorbell(Message):
    """The inbox has something; one pending doorbell is as good as many."""

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, Doorbell)


class EngineStarted(Message):
    """The engine was imported and its worker created (on a background thread)."""

    def __init__(self, engine: "Engine", sampling: Any, problem: str | None) -> None:
        super().__init__()
        self.engine = engine
        self.sampling = sampling
        self.problem = problem


class Inbox:
    """Tokens in order and the newest figure of each kind, handed from the inference thread to the UI."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokens: list[TokenSampled] = []
        self._latest: dict[type, Event] = {}
        self._ordered = 0
        """In-order events posted and not yet shown: what is gathered meanwhile comes after them."""

    def put(self, event: Event) -> bool:
        """Keep an event (any thread); True when the inbox was empty, i.e. ring the doorbell."""
        with self._lock:
            empty = not self._tokens and not self._latest
            if isinstance(event, TokenSampled):
                self._tokens.append(event)
            else:
                self._latest[type(event)] = event
            return empty

    def take(self) -> Gathered:
        """Everything gathered so far: the tokens in order, then the newest figure of each kind;
        nothing while an in-order event is still to be shown (what came after it must wait: a
        fork's first token shown before its answer began was lost)."""
        with self._lock:
            if self._ordered:
                return [], []
            return self._take()

    def before_ordered(self) -> Gathered:
        """An in-order event is being posted (any thread): what was gathered before it."""
        with self._lock:
            self._ordered += 1
            return self._take()

    def ordered_shown(self) -> bool:
        """The in-order event was shown; True when what was gathered meanwhile may now be."""
        with self._lock:
            self._ordered -= 1
            return not self._ordered and bool(self._tokens or self._latest)

    def _take(self) -> Gathered:
        tokens, latest = self._tokens, list(self._latest.values())
        self._tokens, self._latest = [], {}
        return tokens, latest


class Pacer:
    """Spaces UI updates so drawing takes at most `share` of the UI thread's time.

    It measures the UI thread's own CPU time (`time.thread_time`) between updates: where
    drawing is cheap (a fast machine, a small terminal) updates come every `minimum`
    seconds; where it is dear they come less often, never rarer than every `maximum`.
    The inference thread needs the CPU and the GIL that drawing would take.
    """

    def __init__(self, minimum: float = 0.05, maximum: float = 1.0, share: float = 0.03) -> None:
        self.minimum, self.maximum, self.share = minimum, maximum, share
        self._cost = 0.0
        self._cpu = time.thread_time()
        self.last = 0.0

    def delay(self, now: float) -> float:
        """Seconds to wait before the next update, from `now`."""
        interval = min(self.maximum, max(self.minimum, self._cost / self.share))
        return max(0.0, self.last + interval - now)

    def updated(self, now: float) -> None:
        """Call on the UI thread at each update: the CPU spent since the last one is its cost."""
        cpu = time.thread_time()
        spent, self._cpu = cpu - self._cpu, cpu
        # Smooth it, and forget idle stretches (the spend since an update long ago is not one update's cost).
        self._cost = 0.7 * self._cost + 0.3 * min(spent, self.maximum * self.share * 2)
        self.last = now
