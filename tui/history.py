"""The saved side of the chat: resume a conversation, step between versions, edit a message.

The engine saves every finished message and says so (`MessageSaved`); when the current
branch changes (a resume, a step to another version) it sends the whole branch
(`ConversationLoaded`) and the log is redrawn from it. Like the router, this only shows
events and forwards requests; the app owns the turn state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.events import ConversationLoaded, Event, MessageSaved
from tui.fmt import visible_controls
from tui.widgets.chat_log import ChatLog, UserMessage
from tui.widgets.kv_cache import KVCachePanel
from tui.widgets.phase import PhasePanel
from tui.widgets.prompt_input import PromptInput
from tui.widgets.token_stream import TokenStream
from tui.widgets.top_k import TopKPanel

if TYPE_CHECKING:
    from tui.app_parts import AppParts

WAIT_TO_EDIT = "Wait for the answer to finish (or stop it with Esc), then press Enter to send the edit."


def heading(event: ConversationLoaded) -> str:
    turns = sum(1 for m in event.messages if m.role == "user")
    title = visible_controls(event.title, one_line=True) or "(untitled)"
    return f"Conversation {event.conversation_id} · {title} · {turns} turn{'s' if turns != 1 else ''}"


class History:
    def __init__(self, app: AppParts) -> None:
        self.app = app
        self.conversation_id: int | None = None
        """The saved conversation shown in the chat (None for a new chat not saved yet)."""
        self.pending: int | str | None = app.options.resume
        """A resume asked for before the engine started."""
        self._resuming = False
        self._focus: int | None = None

    # -- requests ---------------------------------------------------------------------
    def engine_started(self) -> None:
        """The engine exists (its model load is queued): send a resume asked for earlier."""
        if self.pending is not None:
            ref, self.pending = self.pending, None
            self.resume(ref)

    def resume(self, ref: int | str) -> None:
        """Make saved conversation `ref` current; an answer in progress is stopped (it stays saved)."""
        app = self.app
        if app.engine is None:
            self.pending = ref
            app.part(ChatLog).add_note(f"Conversation {ref} opens once the engine has started…")
            return
        if app.turns.stoppable:
            app.action_stop()
        self._resuming = True
        app.engine.resume(ref)

    def step(self, index: int, step: int) -> None:
        app = self.app
        if app.engine is None or app.turns.busy:
            app.notify("Wait for the answer to finish (or stop it with Esc) to switch versions.")
            return
        self._focus = index
        app.engine.step_version(index, step)

    def step_last(self, step: int) -> None:
        """Step the newest message that has other versions (for the command palette)."""
        versioned = [m for m in self.app.part(ChatLog).messages() if m.saved and m.saved.versions > 1]
        if not versioned:
            self.app.notify(
                "No message has other versions yet: edit a message or regenerate an answer first."
            )
            return
        self.step(versioned[-1].index, step)

    def request_edit(self, index: int, text: str) -> None:
        self.app.part(PromptInput).start_edit(index, text)

    def edit_last(self) -> None:
        users = [m for m in self.app.part(ChatLog).query_children(UserMessage) if m.index is not None]
        if not users:
            self.app.notify("There is no saved message to edit yet.")
            return
        self.request_edit(users[-1].index, users[-1].text)

    async def submit_edit(self, index: int, text: str) -> None:
        """Send an edited message: the log drops it and what followed; the engine keeps the old branch."""
        app = self.app
        prompt = app.part(PromptInput)
        if app.engine is None or not app.turns.start_other():
            app.notify(WAIT_TO_EDIT)
            return
        chat = app.part(ChatLog)
        prompt.end_edit()
        prompt.clear()
        await chat.truncate_from(index)
        await chat.add_user(text)
        await chat.expect_answer("sending the edited message (a new branch; the old one is kept)…")
        app.engine.edit(index, text)
        app.refresh_bindings()

    def new_chat(self) -> None:
        self.conversation_id = None
        self._resuming = False
        prompt = self.app.part(PromptInput)
        if prompt.editing is not None:
            prompt.end_edit()

    def select_last(self) -> None:
        messages = self.app.part(ChatLog).messages()
        if messages:
            messages[-1].focus()

    # -- events ---------------------------------------------------------------------
    async def show(self, event: Event) -> None:
        match event:
            case ConversationLoaded():
                await self._loaded(event)
            case MessageSaved(conversation_id, index, message):
                self.conversation_id = conversation_id
                self.app.part(ChatLog).attach_saved(index, message)

    async def _loaded(self, event: ConversationLoaded) -> None:
        app = self.app
        prompt = app.part(PromptInput)
        if prompt.editing is not None:  # the message being edited may no longer be shown
            prompt.end_edit(restore=True)
        focus, self._focus = self._focus, None
        self.conversation_id = event.conversation_id
        if self._resuming:
            self._resumed(focus)
        else:  # another version is shown: the panels' tokens were those of the version left
            app.part(TokenStream).clear(
                "another version is shown; the tokens of the next turn appear here (F2 inspects answers)"
            )
            app.part(TopKPanel).clear()
        await app.part(ChatLog).show_history(heading(event), event.messages, focus)

    def _resumed(self, focus: int | None) -> None:
        """A resumed conversation: the panels start over. Called before the redraw is awaited, as the
        paced update may show the resumed cache meanwhile. The KV panel keeps its figures: the resumed
        cache's size (0, or loaded from disk) follows as CacheChanged."""
        app = self.app
        self._resuming = False
        for panel in (TokenStream, TopKPanel, PhasePanel):
            app.part(panel).clear()
        app.part(KVCachePanel).set_resumed()
        app.instruments.last_stats = None  # F6 measures this conversation's turns, not the last one's
        if focus is None:
            app.part(PromptInput).focus()
