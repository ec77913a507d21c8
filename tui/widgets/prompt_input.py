"""The multi-line prompt: Enter sends, Ctrl+J (or Shift/Alt+Enter where the terminal reports
them) inserts a newline.

It also edits an earlier user message: `start_edit` fills it with that message, and the
next Enter sends it as an edit of that message (Esc cancels the edit).
"""

from __future__ import annotations

from textual import events
from textual.binding import Binding
from textual.message import Message
from textual.widgets import TextArea

NEWLINE_KEYS = "ctrl+j,shift+enter,alt+enter"


class PromptInput(TextArea):
    DEFAULT_CSS = """
    PromptInput { height: auto; min-height: 3; max-height: 10; border: round $primary 60%; }
    PromptInput:focus { border: round $primary; }
    PromptInput .text-area--placeholder { color: $text 75%; }  /* Textual's 40% reads 2-4:1 */
    """
    BINDINGS = [
        Binding(NEWLINE_KEYS, "newline", "Newline", show=False),
        Binding("escape", "cancel_edit", "Cancel edit"),
    ]
    HINT = "Enter send · Ctrl+J newline"

    class Submitted(Message):
        def __init__(self, text: str, editing: int | None = None) -> None:
            super().__init__()
            self.text = text
            self.editing = editing
            """The index of the user message this replaces; None for a new prompt."""

    def __init__(self, **kwargs) -> None:
        super().__init__(
            soft_wrap=True,
            show_line_numbers=False,
            placeholder="Ask something…  Enter sends · Ctrl+J new line",
            **kwargs,
        )
        self.border_subtitle = self.HINT
        self.editing: int | None = None
        """The index of the user message being edited, if any."""
        self._draft = ""

    async def _on_key(self, event: events.Key) -> None:
        # TextArea inserts a newline on Enter; here Enter sends instead.
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.action_submit()
            return
        await super()._on_key(event)

    def action_submit(self) -> None:
        """Send the text; a new prompt leaves the box at once, so a repeated Enter sends nothing.

        An edit stays until the app takes it (it may ask to wait for the answer to end first).
        """
        text = self.text.strip()
        if not text:
            return
        self.post_message(self.Submitted(text, self.editing))
        if self.editing is None:
            self.clear()

    def put_back(self, text: str) -> None:
        """Give back a prompt that was not sent, the cursor at its end so that typing continues it."""
        self.text = text
        self.move_cursor(self.document.end)

    def start_edit(self, index: int, text: str) -> None:
        """Fill the prompt with message `index` to edit; what was typed comes back if the edit is
        cancelled."""
        if self.editing is None:
            self._draft = self.text
        self.editing = index
        self.text = text
        self.move_cursor(self.document.end)
        self.border_title = "editing an earlier message: Enter sends it as a new branch · Esc cancels"
        self.border_subtitle = "the old branch is kept (‹ › on the message)"
        self.focus()

    def end_edit(self, restore: bool = False) -> None:
        """Leave edit mode; `restore` puts back what was typed before the edit began."""
        self.editing = None
        self.border_title = None
        self.border_subtitle = self.HINT
        if restore:
            self.text = self._draft
            self.move_cursor(self.document.end)
        self._draft = ""

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "cancel_edit":
            return self.editing is not None  # otherwise Esc goes on to the app (stop)
        return super().check_action(action, parameters)

    def action_cancel_edit(self) -> None:
        self.end_edit(restore=True)

    def action_newline(self) -> None:
        self.insert("\n")
