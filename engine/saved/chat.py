"""A ChatSession that is saved as it goes and can be picked up again.

`SavedChat` wraps a session with the same calls (`send`, `regenerate`, `edit`) and commits
each finished message to a Store before the event that finishes it goes out, so the UI
never shows as finished what is not on disk. It keeps `message_ids` parallel to
`session.messages`: the store ids of the current branch. An edit or a regeneration starts
a sibling branch; the old one stays, and `step_version` moves between them.

Resuming restores the messages and, when the saved KV cache file was made by this very
model and precision, the cache too: the next turn then reuses the whole history instead
of prefilling it. Without a usable file the next turn prefills the history once.

If the store fails mid-conversation (disk full, a lock held too long) saving turns off
with a notice and the chat goes on.

Another llmchat may write to the same conversation. Each turn holds the conversation from
its question to its answer (`Store.turn`), and each save expects the conversation's leaf to
be `head`, the one this chat last read or wrote. A turn that finds the conversation held, or
changed since it was loaded here, is refused before anything is saved or answered: one
Failed event says so (resuming it again picks up the latest messages). An answer that finds
its conversation changed (someone switched its branch meanwhile) is kept as a side version.
"""

from __future__ import annotations

import dataclasses
from contextlib import ExitStack
from typing import Generator, Iterator

from engine.events import (
    ContextTrimmed,
    ConversationLoaded,
    Event,
    Failed,
    Forked,
    MessageSaved,
    ModelInfo,
    Notice,
    SavedMessage,
    TurnFinished,
    TurnStats,
)
from engine.sampling import SamplingSettings
from engine.saved.cache_file import CacheFileError, load_cache, save_cache
from engine.saved.store import (
    AnswerRecord,
    ConversationBusy,
    ConversationChanged,
    Store,
    StoredMessage,
    StoreError,
)
from engine.session import ChatSession, Message


def answer_record(info: ModelInfo, sampling: SamplingSettings, stats: TurnStats) -> AnswerRecord:
    """The reproducibility and speed record of one answer."""
    return AnswerRecord(
        model=info.spec,
        precision=info.precision,
        sampling=dataclasses.asdict(sampling),
        stop=stats.stop,
        prompt_tokens=stats.prompt_tokens,
        reused_tokens=stats.reused_tokens,
        tokens=stats.generated_tokens,
        ttft_s=stats.ttft_s,
        itl_p50_s=stats.itl_p50_s,
        itl_p90_s=stats.itl_p90_s,
        prefill_tok_s=stats.prefill_tok_s,
        decode_tok_s=stats.decode_tok_s,
    )


class SavedChat:
    """A session whose finished messages are committed to a store as they happen."""

    def __init__(self, session: ChatSession, store: Store | None):
        self.session = session
        self.store = store
        """None when saving is off (no store, or it failed)."""
        self.conversation_id: int | None = None
        """Created with the first message."""
        self.message_ids: list[int] = []
        """Store ids of `session.messages`, index for index."""
        self.head: int | None = None
        """The conversation's leaf as this chat last read or wrote it; every save expects it still."""
        self.refused: str | None = None
        """Why the last turn was refused before it began (another turn held the conversation, or it
        changed since it was loaded here); None when it went ahead."""

    # -- the conversation calls (same as ChatSession's) ------------------------------
    def send(self, text: str) -> Iterator[Event]:
        """Save the user message, answer it, save the answer."""
        if self.store is not None and self.conversation_id is None:
            yield from self._create()

        def turn() -> Iterator[Event]:
            if (yield from self._save("user", text, self._leaf())):
                yield from self._answered(self.session.send(text))

        yield from self._held(turn())

    def regenerate(self) -> Iterator[Event]:
        """Answer the last user message again; the old answer stays as another version."""

        def turn() -> Iterator[Event]:
            kept = len(self.session.messages)
            while kept and self.session.messages[kept - 1].role == "assistant":
                kept -= 1
            del self.message_ids[kept:]
            yield from self._answered(self.session.regenerate())

        yield from self._held(turn())

    def edit(self, index: int, text: str) -> Iterator[Event]:
        """Replace user message `index` with a new version and answer it; the old branch stays."""

        def turn() -> Iterator[Event]:
            messages = self.session.messages
            if 0 <= index < len(messages) and messages[index].role == "user":
                parent = self.message_ids[index - 1] if index > 0 and self.store is not None else None
                dropped = self.message_ids[index:]
                del self.message_ids[index:]
                if not (yield from self._save("user", text, parent)):
                    self.message_ids.extend(dropped)
                    return
            yield from self._answered(self.session.edit(index, text))

        yield from self._held(turn())

    def fork(self, step: int, token_id: int, answer: int | None = None) -> Iterator[Event]:
        """ChatSession.fork, saved: the forked answer becomes a new version of that answer."""
        if answer is None:
            answer = max(
                (i for i, m in enumerate(self.session.messages) if m.role == "assistant"), default=-1
            )

        def forked() -> Iterator[Event]:
            for event in self.session.fork(step, token_id, answer):
                if isinstance(event, Forked):  # the session dropped the answer and what followed
                    del self.message_ids[answer:]
                yield event

        yield from self._held(self._answered(forked()))

    def new(self, system_prompt: str | None = None) -> None:
        """Start a fresh conversation (created in the store with its first message)."""
        self.session.reset(system_prompt)
        self.conversation_id = None
        self.message_ids = []
        self.head = None

    # -- resume and branches ------------------------------------------------------------
    def resume(self, ref: int | str, use_cache: bool = True) -> Iterator[Event]:
        """Make saved conversation `ref` (an id or 'last') current, with its KV cache if it matches."""
        if self.store is None:
            yield Failed("conversations are not being saved, so none can be resumed")
            return
        left = self.save_cache()  # the conversation being left resumes fast later too
        if left is not None:
            yield left
        try:
            conversation = self.store.conversation(self.store.resolve(ref))
            path = self.store.path(conversation.id)
            loaded = self._loaded_event(conversation.id, conversation.title, path)
        except StoreError as e:
            yield Failed(str(e))
            return
        self.session.reset(conversation.system_prompt)
        self.conversation_id = conversation.id
        self._show(path)
        yield loaded
        if use_cache:
            cache, notice = load_cache(self.store.cache_path(conversation.id), self.session.loaded)
            if cache is not None:
                self.session.cache = cache
            yield Notice(notice)
        yield self.session.cache_event()

    def step_version(self, index: int, step: int) -> Iterator[Event]:
        """Show the previous (-1) or next (+1) version of message `index` and the branch below it."""
        if self.store is None or not 0 <= index < len(self.message_ids):
            yield Failed(f"message {index} has no saved versions")
            return
        try:
            versions = self.store.siblings(self.message_ids[index])
            position = [m.id for m in versions].index(self.message_ids[index]) + step
            if not 0 <= position < len(versions):
                return
            path = self.store.switch_branch(versions[position].id)
            title = self.store.conversation(self.conversation_id).title
            loaded = self._loaded_event(self.conversation_id, title, path)
        except StoreError as e:
            yield Failed(str(e))
            return
        self._show(path)
        yield loaded

    def _show(self, path: list[StoredMessage]) -> None:
        """Make `path` the session's messages; the cache stays (the next turn reuses the common prefix)."""
        self.session.messages[:] = [Message(m.role, m.content) for m in path]
        self.message_ids = [m.id for m in path]
        self.head = path[-1].id if path else None

    def _loaded_event(
        self, conversation_id: int, title: str, path: list[StoredMessage]
    ) -> ConversationLoaded:
        return ConversationLoaded(conversation_id, title, tuple(self._saved(m) for m in path))

    def _saved(self, message: StoredMessage) -> SavedMessage:
        versions = [m.id for m in self.store.siblings(message.id)]
        return SavedMessage(
            message.id, message.role, message.content, versions.index(message.id) + 1, len(versions)
        )

    # -- the KV cache file ------------------------------------------------------------
    def save_cache(self) -> Notice | None:
        """Write the session's KV cache next to the store, for a resume without prefill."""
        if self.store is None or self.conversation_id is None or len(self.session.cache) == 0:
            return None
        path = self.store.cache_path(self.conversation_id)
        try:
            size = save_cache(self.session.cache, self.session.loaded, path)
        except CacheFileError as e:
            return Notice(str(e))
        return Notice(f"KV cache saved: {len(self.session.cache)} tokens, {size / 1e6:.1f} MB")

    # -- saving ---------------------------------------------------------------------------
    def _leaf(self) -> int | None:
        return self.message_ids[-1] if self.message_ids else None

    def _held(self, turn: Iterator[Event]) -> Iterator[Event]:
        """Run one turn holding the conversation against other turns, other processes' included."""
        self.refused = None
        with ExitStack() as held:
            if self.store is not None and self.conversation_id is not None:
                try:
                    held.enter_context(self.store.turn(self.conversation_id))
                except ConversationBusy as e:
                    yield from self._refuse(str(e))
                    return
                except StoreError as e:  # the lock file cannot be made
                    yield from self._saving_off(e)
            yield from turn

    def _refuse(self, reason: str) -> Iterator[Event]:
        self.refused = reason
        yield Failed(reason)

    def _create(self) -> Iterator[Event]:
        """Create the conversation in the store; its first message follows."""
        info = self.session.info
        try:
            created = self.store.create_conversation(info.spec, info.precision, self.session.system_prompt)
        except StoreError as e:
            yield from self._saving_off(e)
            return
        self.conversation_id, self.head = created.id, None

    def _saving_off(self, error: StoreError) -> Iterator[Event]:
        self.store = None
        yield Notice(f"saving is off for the rest of this conversation: {error}")

    def _answered(self, events: Iterator[Event]) -> Iterator[Event]:
        """Pass the session's events through, saving the answer before its TurnFinished goes out."""
        for event in events:
            if isinstance(event, ContextTrimmed):
                del self.message_ids[: event.dropped_messages]
            elif isinstance(event, Failed):
                self._take_back_refused()
            elif isinstance(event, TurnFinished):
                record = answer_record(self.session.info, self.session.sampling, event.stats)
                yield from self._save("assistant", event.text, self._leaf(), record)
            yield event

    def _take_back_refused(self) -> None:
        """The session dropped a prompt it could not fit: drop it from the store too."""
        if self.store is None or len(self.message_ids) <= len(self.session.messages):
            return
        refused = self.message_ids.pop()
        try:
            parent = self.store.message(refused).parent_id
            self.store.delete_message(refused)  # its parent becomes the leaf again
        except StoreError:
            pass  # a stray unanswered message is harmless; the next save reports a broken store
        else:
            self.head = parent if self.head == refused else self.head
        # The session may also have trimmed old turns while trying: keep the ids of those it kept.
        del self.message_ids[: len(self.message_ids) - len(self.session.messages)]

    def _save(
        self, role: str, content: str, parent: int | None, record: AnswerRecord | None = None
    ) -> Generator[Event, None, bool]:
        """Commit a message after `head`; False when the turn must not go on (the conversation changed)."""
        if self.store is not None and self.conversation_id is None:
            yield from self._create()
        if self.store is None:
            return True
        try:
            stored = self.store.add_message(
                self.conversation_id, role, content, parent, record, expected_leaf=self.head
            )
            saved = self._saved(stored)
        except ConversationChanged:
            return (yield from self._changed(role, content, parent, record))
        except StoreError as e:
            yield from self._saving_off(e)
            return True
        self.head = stored.id
        self.message_ids.append(saved.id)
        yield MessageSaved(self.conversation_id, len(self.message_ids) - 1, saved)
        return True

    def _changed(
        self, role: str, content: str, parent: int | None, record: AnswerRecord | None
    ) -> Generator[Event, None, bool]:
        """Another writer moved the conversation's leaf: refuse a question; keep an answer aside."""
        if role == "user":
            yield from self._refuse(
                f"conversation {self.conversation_id} changed since it was loaded here (another llmchat "
                "wrote to it); this message was not saved or answered: load the conversation again "
                "to continue from its latest message"
            )
            return False
        try:
            stored = self.store.add_message(
                self.conversation_id, role, content, parent, record, make_leaf=False
            )
            saved = self._saved(stored)
        except StoreError as e:
            yield from self._saving_off(e)
            return True
        self.message_ids.append(saved.id)
        yield MessageSaved(self.conversation_id, len(self.message_ids) - 1, saved)
        yield Notice(
            f"conversation {self.conversation_id} changed while this answer was generated (another "
            "llmchat moved its branch); the answer is saved as another version of its turn"
        )
        return True
