"""The conversation: user messages, streamed Markdown answers, and notes.

An answer that thinks first (`<think>…</think>`, engine/thinking.py) shows its thought apart,
above it, in a block that stays open while the thought streams and collapses when the answer
starts ("thought for 212 tokens, 3.4 s"); a saved answer shows it collapsed.

User messages and answers are `ChatMessage`s: once the engine has saved one it knows the
message's index in the conversation and how many versions (branches) the store holds, and
shows "‹ 2/3 ›" when there is more than one. A message can be selected (focused): ↑/↓ move
between messages, ←/→ step between versions, and on a user message `e` asks to edit it.
The widgets only post what was asked for; the app talks to the engine.
"""

from __future__ import annotations

from collections import deque
from itertools import groupby
from typing import Iterable, Sequence

from markdown_it import MarkdownIt
from markdown_it.rules_core import StateCore
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.content import Content
from textual.css.query import NoMatches
from textual.message import Message
from textual.widgets import Collapsible, Markdown, Static

from engine.events import SavedMessage, TokenSampled
from engine.thinking import shown, split_saved
from tui.fmt import count, visible_controls


def _hard_breaks(state: StateCore) -> None:
    """Every line break inside a paragraph is a real one: a model's poem or list keeps its lines
    (Markdown would join single line breaks into one paragraph)."""
    for token in state.tokens:
        for child in token.children or ():
            if child.type == "softbreak":
                child.type = "hardbreak"


def answer_parser() -> MarkdownIt:
    """The Markdown parser of answers: Textual's own ("gfm-like"), keeping the model's line breaks."""
    parser = MarkdownIt("gfm-like")
    parser.core.ruler.push("hard_breaks", _hard_breaks)
    return parser


def version_label(version: int, versions: int) -> Content:
    """'‹ 2/3 ›', an arrow dimmed where there is no version further that way."""
    back = "$text-accent" if version > 1 else "$text-disabled"
    forward = "$text-accent" if version < versions else "$text-disabled"
    return Content.assemble(("‹ ", back), (f"{version}/{versions}", "bold"), (" ›", forward))


class ChatMessage(Vertical, can_focus=True):
    """A message the engine knows by its index once saved; the store may hold other versions of it."""

    DEFAULT_CSS = """
    ChatMessage { height: auto; }
    ChatMessage > .versions { color: $text-muted; display: none; }
    ChatMessage > .selected { display: none; color: $text-accent; text-style: bold; }
    ChatMessage:focus > .selected { display: block; }
    """
    BINDINGS = [
        Binding("left", "version(-1)", "‹ Version"),
        Binding("right", "version(1)", "Version ›"),
        Binding("up", "neighbour(-1)", "Previous message", show=False),
        Binding("down", "neighbour(1)", "Next message", show=False),
        Binding("escape", "leave", "Back to prompt"),
    ]

    class VersionStep(Message):
        """Show the previous (-1) or next (+1) version of message `index`."""

        def __init__(self, index: int, step: int) -> None:
            super().__init__()
            self.index = index
            self.step = step

    class Leave(Message):
        """Selection is done: back to the prompt."""

    def __init__(self, saved: SavedMessage | None = None, index: int | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.saved = saved
        """What the store holds for this message (None until saved, or when saving is off)."""
        self.index = index
        """Its position in the engine's conversation (None until saved)."""

    def selected_label(self) -> Static:
        """Shown only while the message is selected (focused): says so, and which keys act on it."""
        return Static("", classes="selected", markup=False)

    def on_focus(self) -> None:
        parts = ["▶ selected", "↑↓ other messages"]
        if self.saved is not None and self.saved.versions > 1:
            parts.append("←→ versions")
        if isinstance(self, UserMessage) and self.index is not None:
            parts.append("e edit")
        self.query_one(".selected", Static).update(" · ".join([*parts, "Esc back to the prompt"]))

    def versions_label(self) -> Static:
        label = Static("", classes="versions")
        self._paint_versions(label)
        return label

    def set_saved(self, index: int, saved: SavedMessage) -> None:
        self.index, self.saved = index, saved
        self._repaint()

    def forget(self) -> None:
        """The engine no longer has this message at a known place (a newer one took it, or it was trimmed)."""
        self.index, self.saved = None, None
        self._repaint()

    def _repaint(self) -> None:
        try:
            self._paint_versions(self.query_one(".versions", Static))
        except NoMatches:  # not composed yet: compose paints it
            pass
        self.refresh_bindings()

    def _paint_versions(self, label: Static) -> None:
        saved = self.saved
        label.display = saved is not None and saved.versions > 1
        if label.display:
            label.update(version_label(saved.version, saved.versions))

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "version":
            if self.saved is None or self.index is None or self.saved.versions < 2:
                return False
            return True if 1 <= self.saved.version + int(parameters[0]) <= self.saved.versions else None
        return True

    def action_version(self, step: int) -> None:
        if self.index is not None:
            self.post_message(self.VersionStep(self.index, step))

    def action_neighbour(self, step: int) -> None:
        messages = list(self.parent.query_children(ChatMessage)) if self.parent else [self]
        position = messages.index(self) + step
        if 0 <= position < len(messages):
            messages[position].focus()
        elif step > 0:
            self.post_message(self.Leave())

    def action_leave(self) -> None:
        self.post_message(self.Leave())


class UserMessage(ChatMessage):
    """What the user said; `e` or Enter on it asks to edit it (a new branch from here)."""

    BINDINGS = [Binding("e,enter", "edit", "Edit")]

    class EditRequested(Message):
        def __init__(self, index: int, text: str) -> None:
            super().__init__()
            self.index = index
            self.text = text

    def __init__(self, text: str, saved: SavedMessage | None = None, index: int | None = None) -> None:
        super().__init__(saved, index, classes="user")
        self.text = text

    def compose(self):
        yield self.selected_label()
        yield Static(visible_controls(self.text), markup=False)
        yield self.versions_label()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "edit":
            return True if self.index is not None else None
        return super().check_action(action, parameters)

    def action_edit(self) -> None:
        if self.index is not None:
            self.post_message(self.EditRequested(self.index, self.text))


async def append(markdown: Markdown, text: str) -> None:
    """Append model text to a streamed Markdown, rendered before this returns."""
    await markdown.append(visible_controls(text))
    if markdown.children:
        # A paragraph updated in place keeps the height measured for its old text when that
        # update met it before it had finished mounting (Textual's `Static.update` then skips
        # clearing it): a 601-token answer whose first write was one token showed one line.
        markdown.children[-1].refresh(layout=True)


class Thought(Collapsible):
    """An answer's thinking, apart from the answer: its Markdown streamed in as the thought comes."""

    DEFAULT_CSS = """
    Thought { margin: 0; padding: 0; border: none; background: transparent; }
    Thought > Contents { padding: 0 0 0 2; }
    Thought Markdown { margin: 0; padding: 0; background: transparent; color: $text-muted; }
    """

    def __init__(self, text: str = "", title: str = "thinking…", collapsed: bool = False) -> None:
        markdown = Markdown(visible_controls(shown(text)), parser_factory=answer_parser)
        super().__init__(markdown, title=title, collapsed=collapsed)

    async def write(self, text: str) -> None:
        await append(self.query_one(Markdown), shown(text))


class Answer(ChatMessage):
    """One answer: Markdown streamed as tokens arrive (or given whole, from history), then a line
    of stats; any thinking before it in a block of its own above it."""

    DEFAULT_CSS = """
    Answer { height: auto; margin: 0 1 1 0; padding: 0 1; border-left: thick $primary; background: $boost; }
    Answer > Markdown { margin: 0; padding: 0; background: transparent; }
    Answer > .meta { color: $text-muted; }
    """

    def __init__(
        self,
        note: str,
        text: str = "",
        prompt: UserMessage | None = None,
        saved: SavedMessage | None = None,
        index: int | None = None,
    ) -> None:
        super().__init__(saved, index)
        self._note = note
        self.text = text
        """All of it, thought (with its markers) and answer, as the engine keeps it."""
        self.prompt = prompt
        """The user message this answers, when it was asked here (an edit or a typed prompt)."""
        self.thought: Thought | None = None
        self.thinking = False
        """The thought is streaming (its block open, its title counting)."""
        self.thought_tokens = 0
        self.thought_s = 0.0
        """Time spent on the thought tokens after the first (whose latency is the prefill's too)."""

    def compose(self):
        thought, answer = split_saved(self.text)
        yield self.selected_label()
        if thought:
            self.thought = Thought(thought, "thought", collapsed=True)
            yield self.thought
        yield Markdown(visible_controls(answer), parser_factory=answer_parser, classes="body")
        yield self.versions_label()
        meta = Static(visible_controls(self._note), classes="meta", markup=False)
        meta.display = bool(self._note)
        yield meta

    def set_note(self, note: str) -> None:
        meta = self.query_one(".meta", Static)
        meta.update(visible_controls(note))  # it may end with a server's error message
        meta.display = bool(note)

    async def add_tokens(self, tokens: Iterable[TokenSampled]) -> None:
        """Tokens as they came: thought into the thinking block, the answer below it."""
        for thinking, group in groupby(tokens, key=lambda token: token.thinking):
            run = list(group)
            if thinking:
                self.thought_tokens += len(run)
                self.thought_s += sum(token.latency_s for token in run if token.index > 0)
            await self.write("".join(token.text for token in run), thinking)

    async def write(self, text: str, thinking: bool = False) -> None:
        """Append to the thought or to the answer, rendered before this returns. The app's inbox
        gathers what arrives meanwhile into the next write, so nothing renders in the background
        to be stopped at the end of the turn (as Textual's MarkdownStream had to be)."""
        if thinking:
            await self._think(text)
            return
        self.end_thought()
        if not text:
            return
        self.text += text
        await append(self.query_one(".body", Markdown), text)

    async def _think(self, text: str) -> None:
        """Thought: into its block (opened above the answer by the first), titled with its count so far."""
        if self.thought is None:
            self.thought = Thought()
            await self.mount(self.thought, before=self.query_one(".body", Markdown))
        self.thinking = True
        self.text += text
        self.thought.title = f"thinking… {count(self.thought_tokens, 'token')}"
        if text:
            await self.thought.write(text)

    def end_thought(self, collapse: bool = True) -> None:
        """The answer started (the thought collapses), or the turn ended: the thought is titled
        with what it took."""
        if not self.thinking:
            return
        self.thinking = False
        took = f"{count(self.thought_tokens, 'token')}, {self.thought_s:.1f} s"
        self.thought.title = f"thought for {took}" if self.thought_tokens else "thought"
        self.thought.collapsed = collapse


class ChatLog(VerticalScroll):
    """Follows the newest text (anchored) until the user scrolls up."""

    DEFAULT_CSS = """
    ChatLog { padding: 0 1; }
    ChatLog > .user { margin: 0 1 1 6; padding: 0 1; border-left: thick $secondary; background: $boost; }
    ChatLog > .note { margin: 0 1 1 0; color: $text-muted; }
    ChatLog > .error { margin: 0 1 1 0; padding: 0 1; color: $text-error; background: $error-muted; }
    ChatLog > ChatMessage:focus { border-left: outer $accent; background: $accent 20%; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._waiting: deque[Answer] = deque()
        self._unanswered: UserMessage | None = None
        """The user message added last, until the answer box expected for it is made."""
        self.current: Answer | None = None

    def on_mount(self) -> None:
        self.anchor()

    # Mounts are awaited, so an answer box is complete before the engine can write to it.
    async def add_user(self, text: str) -> UserMessage:
        message = UserMessage(text)
        await self.mount(message)
        self._unanswered = message
        self.anchor()
        return message

    def add_note(self, text: str, error: bool = False) -> None:
        self.mount(Static(visible_controls(text), classes="error" if error else "note", markup=False))

    async def expect_answer(self, note: str) -> Answer:
        """An answer box waiting for its turn (the engine answers prompts in order)."""
        answer = Answer(note, prompt=self._unanswered)
        self._unanswered = None
        await self.mount(answer)
        self._waiting.append(answer)
        return answer

    async def begin_answer(self, note: str) -> Answer:
        if not self._waiting:  # a turn nobody asked for here (e.g. after a new chat mid-answer)
            await self.expect_answer(note)
        answer = self._waiting.popleft()
        answer.set_note(note)
        self.current = answer
        return answer

    async def add_tokens(self, tokens: list[TokenSampled]) -> None:
        if self.current is not None:
            await self.current.add_tokens(tokens)

    def finish(self, note: str) -> None:
        """End the answer in progress, or, when the turn ended before it began, the next waiting one."""
        if self.current is not None:
            self.current.end_thought(collapse=False)  # a turn cut while it thought: the thought stays open
            self.current.set_note(note)
            self.current = None
        elif self._waiting:
            self._waiting.popleft().set_note(note)

    def take_waiting(self) -> list[Answer]:
        """The answer boxes still waiting for their turn (their prompts were withdrawn)."""
        waiting = list(self._waiting)
        self._waiting.clear()
        return waiting

    async def drop_last_answer(self) -> None:
        answers = self.query(Answer)
        if answers:
            await answers.last().remove()

    async def clear(self) -> None:
        self.current = None
        self._waiting.clear()
        self._unanswered = None
        await self.remove_children()

    # -- saved messages: indices, versions, history -------------------------------------
    def messages(self) -> list[ChatMessage]:
        return list(self.query_children(ChatMessage))

    def message_at(self, index: int) -> ChatMessage | None:
        return next((m for m in self.messages() if m.index == index), None)

    def attach_saved(self, index: int, saved: SavedMessage) -> None:
        """The engine saved message `index`: mark the widget showing it (and forget stale places)."""
        target = self._showing(saved.role)
        for message in self.messages():
            if message is not target and message.index is not None and message.index >= index:
                message.forget()  # e.g. a prompt the engine refused: its place was taken
        if target is not None:
            target.set_saved(index, saved)

    def _showing(self, role: str) -> ChatMessage | None:
        """The widget an engine save refers to: the answer in progress, or the prompt about to be answered."""
        if role == "assistant":
            answers = list(self.query_children(Answer))
            return self.current or (answers[-1] if answers else None)
        prompts = [answer.prompt for answer in self._waiting if answer.prompt is not None]
        if prompts:
            return prompts[0]
        return next((m for m in reversed(list(self.query_children(UserMessage))) if m.index is None), None)

    def forget_first(self, count: int) -> None:
        """The engine dropped its oldest `count` messages (the context window filled up)."""
        for message in self.messages():
            if message.index is None:
                continue
            if message.index < count:
                message.forget()
            else:
                message.index -= count

    async def truncate_from(self, index: int) -> bool:
        """Remove message `index` and everything shown after it; False if it is not shown."""
        start = self.message_at(index)
        if start is None:
            return False
        children = list(self.children)
        await self.remove_children(children[children.index(start) :])
        return True

    async def show_history(
        self, heading: str, messages: Sequence[SavedMessage], focus: int | None = None
    ) -> None:
        """Redraw the log as `messages`; prompts still waiting to be answered stay below them."""
        keep = self._still_waiting()
        self.current = None
        await self.remove_children([child for child in self.children if child not in keep])
        widgets = [Static(heading, classes="note", markup=False), *self._history_widgets(messages)]
        first_kept = self.children[0] if self.children else None
        await self.mount_all(widgets, before=first_kept)
        chosen = self.message_at(focus) if focus is not None else None
        if chosen is not None:
            chosen.focus()
        else:
            self.scroll_end(animate=False)
            self.anchor()

    def _still_waiting(self) -> set[ChatMessage]:
        """The prompts not answered yet and their placeholders: a redraw keeps them."""
        keep = {answer for answer in self._waiting} | {
            a.prompt for a in self._waiting if a.prompt is not None
        }
        if self._unanswered is not None:
            keep.add(self._unanswered)
        return keep

    @staticmethod
    def _history_widgets(messages: Iterable[SavedMessage]) -> list[ChatMessage]:
        widgets: list[ChatMessage] = []
        for index, message in enumerate(messages):
            if message.role == "user":
                widgets.append(UserMessage(message.content, message, index))
            else:
                widgets.append(Answer("", message.content, saved=message, index=index))
        return widgets
