"""A ChatSession that is saved as it goes and can be picked up again.

`SavedChat` wraps a session with the same calls (`send`, `regenerate`, `edit`) and commits
each finished message to a Store before the event that finishes it goes out, so the UI
never shows as finished what is not on disk. Each of `session.messages` carries its store id
(`Message.saved_id`), so the ids stay in step with the messages whatever the session drops.
An edit or a regeneration starts a sibling branch; the old one stays, and `step_version`
moves between them.

The session is either kind: a local `ChatSession` or a `RemoteSession` (engine/remote/),
whose record names the server URL and model and which has no KV cache file (`saves_cache`).

Resuming restores the messages and, when the saved KV cache file was made by this very
model and precision, the cache too: the next turn then reuses the whole history instead
of prefilling it. Without a usable file the next turn prefills the history once.

If the store fails mid-conversation (disk full, a lock held too long) saving turns off
with a notice and the chat goes on.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Generator, Iterator

from engine.events import (
    ConversationLoaded,
    Event,
    Failed,
    MessageSaved,
    ModelInfo,
    Notice,
    SavedMessage,
    TurnFinished,
    TurnStats,
)
from engine.sampling import SamplingSettings
from engine.saved.cache_file import CacheFileError, load_cache, save_cache
from engine.saved.store import AnswerRecord, Store, StoredMessage, StoreError
from engine.session import ChatSession, Message

if TYPE_CHECKING:
    from engine.remote.session import RemoteSession


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

    def __init__(self, session: ChatSession | RemoteSession, store: Store | None):
        self.session = session
        self.store = store
        """None when saving is off (no store, or it failed)."""
        self.conversation_id: int | None = None
        """Created with the first message."""

    @property
    def message_ids(self) -> list[int | None]:
        """Store ids of `session.messages`, index for index (None where not saved)."""
        return [m.saved_id for m in self.session.messages]

    # -- the conversation calls (same as ChatSession's) ------------------------------
    def send(self, text: str) -> Iterator[Event]:
        """Save the user message, answer it, save the answer."""
        messages = self.session.messages
        asked = yield from self._save("user", text, self._leaf(), index=len(messages))
        yield from self._answered(self.session.send(text, asked), asked)

    def regenerate(self) -> Iterator[Event]:
        """Answer the last user message again; the old answer stays as another version."""
        yield from self._answered(self.session.regenerate())

    def edit(self, index: int, text: str) -> Iterator[Event]:
        """Replace user message `index` with a new version and answer it; the old branch stays."""
        asked = None
        if self.session.is_user_message(index):
            parent = self.session.messages[index - 1].saved_id if index > 0 else None
            asked = yield from self._save("user", text, parent, index=index)
        yield from self._answered(self.session.edit(index, text, asked), asked)

    def fork(self, step: int, token_id: int, answer: int | None = None) -> Iterator[Event]:
        """ChatSession.fork, saved: the forked answer becomes a new version of that answer."""
        yield from self._answered(self.session.fork(step, token_id, answer))

    def new(self, system_prompt: str | None = None) -> None:
        """Start a fresh conversation (created in the store with its first message)."""
        self.session.reset(system_prompt)
        self.conversation_id = None

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
        if use_cache and self.session.saves_cache:
            cache, notice = load_cache(self.store.cache_path(conversation.id), self.session.loaded)
            if cache is not None:
                self.session.cache = cache
            yield Notice(notice)
        yield self.session.cache_event()

    def step_version(self, index: int, step: int) -> Iterator[Event]:
        """Show the previous (-1) or next (+1) version of message `index` and the branch below it."""
        messages = self.session.messages
        shown = messages[index].saved_id if 0 <= index < len(messages) else None
        if self.store is None or shown is None:
            yield Failed(f"message {index} has no saved versions")
            return
        try:
            versions = self.store.siblings(shown)
            position = [m.id for m in versions].index(shown) + step
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
        self.session.messages[:] = [Message(m.role, m.content, saved_id=m.id) for m in path]

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
        if self.store is None or self.conversation_id is None or not self.session.saves_cache:
            return None
        if len(self.session.cache) == 0:
            return None
        path = self.store.cache_path(self.conversation_id)
        try:
            size = save_cache(self.session.cache, self.session.loaded, path)
        except CacheFileError as e:
            return Notice(str(e))
        return Notice(f"KV cache saved: {len(self.session.cache)} tokens, {size / 1e6:.1f} MB")

    # -- saving ---------------------------------------------------------------------------
    def _leaf(self) -> int | None:
        messages = self.session.messages
        return messages[-1].saved_id if messages else None

    def _answered(self, events: Iterator[Event], asked: int | None = None) -> Iterator[Event]:
        """Pass the session's events through, saving the answer before its TurnFinished goes out.

        `asked` is the user message saved for this turn: if the session refuses it, it goes."""
        for event in events:
            if isinstance(event, Failed):
                self._take_back_refused(asked)
            elif isinstance(event, TurnFinished):
                yield from self._save_answer(event)
            yield event

    def _save_answer(self, finished: TurnFinished) -> Iterator[Event]:
        """Save the answer the session just appended, and give it its id."""
        messages = self.session.messages
        record = answer_record(self.session.info, self.session.sampling, finished.stats)
        parent = messages[-2].saved_id if len(messages) > 1 else None
        saved_id = yield from self._save("assistant", finished.text, parent, record, len(messages) - 1)
        messages[-1] = dataclasses.replace(messages[-1], saved_id=saved_id)

    def _take_back_refused(self, asked: int | None) -> None:
        """The session dropped a prompt it could not fit: drop it from the store too."""
        if self.store is None or asked is None or asked in self.message_ids:
            return
        try:
            self.store.delete_message(asked)
        except StoreError:
            pass  # a stray unanswered message is harmless; the next save reports a broken store

    def _save(
        self,
        role: str,
        content: str,
        parent: int | None,
        record: AnswerRecord | None = None,
        index: int = 0,
    ) -> Generator[Event, None, int | None]:
        """Save one message as message `index` of the conversation; its id (None if not saved)."""
        if self.store is None:
            return None
        try:
            if self.conversation_id is None:
                info = self.session.info
                self.conversation_id = self.store.create_conversation(
                    info.spec, info.precision, self.session.system_prompt
                ).id
            saved = self._saved(self.store.add_message(self.conversation_id, role, content, parent, record))
        except StoreError as e:
            self.store = None
            yield Notice(f"saving is off for the rest of this conversation: {e}")
            return None
        yield MessageSaved(self.conversation_id, index, saved)
        return saved.id
