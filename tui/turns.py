"""When a prompt may go to the engine: one turn at a time, and none while a model loads.

Plain state, no widgets: the app asks it what to do and shows the answers.
"""

from __future__ import annotations

from collections import deque

WARMING = (
    "⏳ waiting for the compiled decode step (the Phase panel shows its progress), so the first "
    "answer runs at its real speed: sent as soon as it is ready"
)


class TurnState:
    """Whether a prompt may go to the engine now, and the prompts waiting (the conversation's own
    turns are engine/conversation.py `Turns`)."""

    def __init__(self) -> None:
        self.loading = True
        """A model is being loaded (at start, or after a precision switch)."""
        self.ready = False
        """A model is loaded and can answer."""
        self.busy = False
        """A turn is running on the engine (at most one is ever handed to it)."""
        self.waiting: deque[str] = deque()
        """Prompts waiting for the model to load or for the current answer to end."""
        self.warming = False
        """Prompts wait for the compiled step too (`llmchat lecture`: the class sees its real speed)."""

    def submit(self, text: str) -> str:
        """Queue a prompt; the note to show where its answer will appear."""
        self.waiting.append(text)
        if self.loading:
            return "⏳ waiting for the model to load: this prompt is sent as soon as it is ready"
        if not self.ready:
            return "⏳ no model is loaded: this prompt is sent once one is"
        if self.busy:
            return "⏳ queued: sent when the current answer ends"
        if self.warming:
            return WARMING
        return "sending…"

    def next_prompt(self) -> str | None:
        """The prompt to send now, if the engine can take one (the turn then counts as running)."""
        if self.ready and not self.busy and not self.warming and self.waiting:
            self.busy = True
            return self.waiting.popleft()
        return None

    def start_other(self) -> bool:
        """Start a turn that is not a queued prompt (regenerate); False if one cannot start now."""
        if not self.ready or self.busy:
            return False
        self.busy = True
        return True

    def turn_over(self) -> None:
        self.busy = False

    def load_started(self) -> None:
        self.loading, self.ready = True, False

    def load_finished(self, have_model: bool) -> None:
        """A load ended; after a failure an earlier model, if any, is still there."""
        self.loading, self.ready = False, have_model

    def withdraw(self) -> list[str]:
        """Take back every waiting prompt."""
        prompts = list(self.waiting)
        self.waiting.clear()
        return prompts

    @property
    def stoppable(self) -> bool:
        return self.busy or bool(self.waiting)
