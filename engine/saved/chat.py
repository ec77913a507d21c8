"""A ChatSession that is saved as it goes and can be picked up again.

`SavedChat` wraps a session with the same calls (`send`, `regenerate`, `edit`) and commits
each finished message to a Store before the event that finishes it goes out, so the UI
never shows as finished what is not on disk. Each of `session.messages` carries its store id
(`Message.saved_id`), so the ids stay in step with the messages whatever the session drops.
An edit or a regeneration starts a sibling branch; the old one stays, and `step_version`
moves between them.

The session is either kind: a local `ChatSession` or a `RemoteSession` (engine/remote/),
whose record names the server URL and model and which has no KV cache file
(`capabilities.saves_cache`).

Resuming restores the messages and, when the saved KV cache file was made by this very
model and precision and is intact, the cache too, as far as it matches the conversation:
the next turn then reuses that much of the history instead of prefilling it, and the notice
says how much. Without a usable file the next turn prefills the history once.

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
from typing import TYPE_CHECKING, Generator, Iterator

from engine.events import (
    ContextTrimmed,
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
from engine.kvcache import cache_precision_of, common_prefix
from engine.sampling import SamplingSettings
from engine.saved.cache_file import CacheFileError, held_ids, load_cache, save_cache
from engine.saved.store import (
    AnswerRecord,
    Conversation,
    ConversationBusy,
    ConversationChanged,
    Store,
    StoredMessage,
    StoreError,
)
from engine.session import ChatSession, Message

if TYPE_CHECKING:
    from engine.remote.session import RemoteSession


STORABLE_INT = 2**63 - 1
"""SQLite's largest integer: a count beyond it (a server's nonsense) would fail the answer's save."""


def answer_record(
    info: ModelInfo,
    sampling: SamplingSettings,
    stats: TurnStats,
    token_ids: list[int] | None = None,
    fork_step: int | None = None,
) -> AnswerRecord:
    """The reproducibility and speed record of one answer: how it was decoded, the ids it was
    sampled as; a count no store can hold is not kept, so the answer is saved whatever figures
    came with it."""
    return AnswerRecord(
        model=info.spec,
        precision=info.precision,
        sampling=dataclasses.asdict(sampling),
        stop=stats.stop,
        prompt_tokens=_storable(stats.prompt_tokens),
        reused_tokens=_storable(stats.reused_tokens),
        tokens=min(stats.generated_tokens, STORABLE_INT),
        ttft_s=stats.ttft_s,
        itl_p50_s=stats.itl_p50_s,
        itl_p90_s=stats.itl_p90_s,
        prefill_tok_s=stats.prefill_tok_s,
        decode_tok_s=stats.decode_tok_s,
        token_ids=None if token_ids is None else tuple(token_ids),
        step_path=stats.step_path,
        speculative=stats.speculative,
        kv_cache=None
        if info.server is not None or not info.cache_dtype
        else cache_precision_of(info.cache_dtype),
        fork_step=fork_step,
    )


def made_otherwise(conversation: Conversation, info: ModelInfo) -> str | None:
    """What a resumed conversation was answered with that this session is not (its model, its
    precision), in one line; None where they are alike. A precision is not switched for it (a
    reload), it is said."""
    if info.server is not None or conversation.model is None:
        return None
    if conversation.model != info.spec:
        return (
            f"this conversation was answered by {conversation.model}; the next answers come from {info.spec}"
        )
    if conversation.precision and conversation.precision != info.precision:
        return (
            f"this conversation was answered at {conversation.precision}; the model runs at {info.precision} "
            f"now (Settings or --precision {conversation.precision} switches it)"
        )
    return None


def _storable(count: int | None) -> int | None:
    return count if count is None or abs(count) <= STORABLE_INT else None


def binary_size(n: float) -> str:
    """Bytes in the binary units the app's panels use (as tui.fmt.human_bytes), so figures compare."""
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


class SavedChat:
    """A session whose finished messages are committed to a store as they happen."""

    def __init__(self, session: ChatSession | RemoteSession, store: Store | None):
        self.session = session
        self.store = store
        """None when saving is off (no store, or it failed)."""
        self.conversation_id: int | None = None
        """Created with the first message."""
        self.head: int | None = None
        """The conversation's leaf as this chat last read or wrote it; every save expects it still."""
        self.refused: str | None = None
        """Why the last turn was refused before it began (another turn held the conversation, or it
        changed since it was loaded here); None when it went ahead."""

    @property
    def message_ids(self) -> list[int | None]:
        """Store ids of `session.messages`, index for index (None where not saved)."""
        return [m.saved_id for m in self.session.messages]

    # -- the conversation calls (same as ChatSession's) ------------------------------
    def send(self, text: str) -> Iterator[Event]:
        """Save the user message once the session takes it, answer it, save the answer."""
        yield from self._held(self._answered(self.session.send(text), asking=True, parent=self._leaf()))

    def regenerate(self) -> Iterator[Event]:
        """Answer the last user message again; the old answer stays as another version."""
        yield from self._held(self._answered(self.session.regenerate()))

    def edit(self, index: int, text: str) -> Iterator[Event]:
        """Replace user message `index` with a new version and answer it; the old branch stays."""
        asking = self.session.is_user_message(index)
        parent = self.session.messages[index - 1].saved_id if asking and index > 0 else None
        yield from self._held(self._answered(self.session.edit(index, text), asking, parent))

    def fork(self, step: int, token_id: int, answer: int | None = None) -> Iterator[Event]:
        """ChatSession.fork, saved: the forked answer becomes a new version of that answer."""
        yield from self._held(self._answered(self.session.fork(step, token_id, answer)))

    def new(self, system_prompt: str | None = None) -> None:
        """Start a fresh conversation (created in the store with its first message)."""
        self.session.reset(system_prompt)
        self.conversation_id = None
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
        unlike = made_otherwise(conversation, self.session.info)
        if unlike:
            yield Notice(unlike)
        if use_cache and self.session.capabilities.saves_cache:
            path = self.store.cache_path(conversation.id)
            held = held_ids(path, self.session.info.vocab_size)
            if held:  # the answers as the cache holds them, so its history is the cache's own
                self.session.messages[:] = self.session.with_sampled_ids(self.session.messages, held)
            history, needed = self._history()
            cache, notice = load_cache(path, self.session.loaded, history, needed, self.session.info)
            if cache is not None:
                self.session.cache = cache
            yield Notice(notice)
        yield self.session.cache_event()

    def _history(self) -> tuple[list[int], int]:
        """The conversation templated, and how many of its tokens a cache must hold so that the next
        turn prefills nothing of the history: all up to the end of the last message, less the last
        token of an answer (sampled and shown, but never fed to the model)."""
        messages = self.session.messages
        ids = self.session.template(messages)
        if not messages:
            return ids, 0
        last = messages[-1]
        answer = self.session.sampled_ids(last)
        if answer is not None:  # read back from the cache: it ends one token short of it
            return ids, len(self.session.template(messages[:-1])) + len(answer) - 1
        # Where the last message's text ends: the first token that differs once it is extended.
        extended = self.session.template([*messages[:-1], Message(last.role, last.content + "\x00")])
        end = common_prefix(ids, extended)
        return ids, end - 1 if last.role == "assistant" else end

    def step_version(self, index: int, step: int) -> Iterator[Event]:
        """Show the previous (-1) or next (+1) version of message `index` and the branch below it."""
        messages = self.session.messages
        shown = messages[index].saved_id if 0 <= index < len(messages) else None
        if self.store is None or shown is None:
            yield Failed(f"message {index} has no saved versions")
            return
        try:
            switched = self._switch_version(shown, step)
        except StoreError as e:
            yield Failed(str(e))
            return
        if switched is not None:
            path, loaded = switched
            self._show(path)
            yield loaded

    def _switch_version(self, shown: int, step: int) -> tuple[list[StoredMessage], ConversationLoaded] | None:
        """Switch the stored branch to the version `step` away from saved message `shown`: the new
        path and the event that shows it, or None where there is no such version."""
        versions = self.store.siblings(shown)
        position = [m.id for m in versions].index(shown) + step
        if not 0 <= position < len(versions):
            return None
        path = self.store.switch_branch(versions[position].id)
        title = self.store.conversation(self.conversation_id).title
        return path, self._loaded_event(self.conversation_id, title, path)

    def _show(self, path: list[StoredMessage]) -> None:
        """Make `path` the session's messages; the cache stays (the next turn reuses the common prefix)."""
        self.session.messages[:] = [
            Message(m.role, m.content, sampled_ids=m.record and m.record.token_ids, saved_id=m.id)
            for m in path
        ]
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
        if self.store is None or self.conversation_id is None or not self.session.capabilities.saves_cache:
            return None
        if len(self.session.cache) == 0:
            return None
        path = self.store.cache_path(self.conversation_id)
        try:
            size = save_cache(self.session.cache, self.session.loaded, path, self.session.info)
        except CacheFileError as e:  # the turns are in the store; only the fast resume is lost
            return Notice(f"{e}; the conversation itself is saved")
        return Notice(f"KV cache saved: {len(self.session.cache)} tokens, {binary_size(size)}")

    # -- saving ---------------------------------------------------------------------------
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

    def _saving_off(self, error: StoreError) -> Iterator[Event]:
        self.store = None
        yield Notice(f"saving is off for the rest of this conversation: {error}")

    def _leaf(self) -> int | None:
        messages = self.session.messages
        return messages[-1].saved_id if messages else None

    def _answered(
        self, events: Iterator[Event], asking: bool = False, parent: int | None = None
    ) -> Iterator[Event]:
        """Pass the session's events through, saving the answer before its TurnFinished goes out.

        `asking`: the turn's user message (the session's last) is saved, under `parent`, once the
        session has taken it: a prompt it cannot take (too long, not UTF-8) leaves no message,
        conversation or title behind.
        """
        for event in events:
            if asking and not isinstance(event, (Failed, ContextTrimmed)):
                asking = False
                if not (yield from self._save_prompt(parent)):  # the conversation changed: no turn
                    self.session.messages.pop()
                    return
            if isinstance(event, TurnFinished):
                yield from self._save_answer(event)
            yield event

    def _save_prompt(self, parent: int | None) -> Generator[Event, None, bool]:
        """Save the user message the session just took, and give it its id; False when the
        conversation changed since this chat read it (the turn must not go on)."""
        messages = self.session.messages
        try:
            saved_id = yield from self._save("user", messages[-1].content, parent, index=len(messages) - 1)
        except ConversationChanged:
            yield from self._refuse(
                f"conversation {self.conversation_id} changed since it was loaded here (another llmchat "
                "wrote to it); this message was not saved or answered: load the conversation again "
                "to continue from its latest message"
            )
            return False
        messages[-1] = dataclasses.replace(messages[-1], saved_id=saved_id)
        return True

    def _save_answer(self, finished: TurnFinished) -> Iterator[Event]:
        """Save the answer the session just appended, and give it its id."""
        messages = self.session.messages
        answer = messages[-1]
        fork_step = answer.trace.fork_step if answer.trace is not None else None
        record = answer_record(
            self.session.info,
            self.session.sampling,
            finished.stats,
            self.session.sampled_ids(answer),
            fork_step,
        )
        parent = messages[-2].saved_id if len(messages) > 1 else None
        index = len(messages) - 1
        try:
            saved_id = yield from self._save("assistant", finished.text, parent, record, index)
        except ConversationChanged:  # someone moved the branch meanwhile: keep the answer aside
            saved_id = yield from self._save("assistant", finished.text, parent, record, index, side=True)
            yield Notice(
                f"conversation {self.conversation_id} changed while this answer was generated (another "
                "llmchat moved its branch); the answer is saved as another version of its turn"
            )
        messages[-1] = dataclasses.replace(messages[-1], saved_id=saved_id)

    def _save(
        self,
        role: str,
        content: str,
        parent: int | None,
        record: AnswerRecord | None = None,
        index: int = 0,
        side: bool = False,
    ) -> Generator[Event, None, int | None]:
        """Save one message as message `index` of the conversation, after `head` (ConversationChanged
        if the leaf moved since); its id (None if not saved). `side`: a version that leaves the
        current branch as it is."""
        if self.store is None:
            return None
        try:
            if self.conversation_id is None:  # created with its first message, or not at all
                info = self.session.info
                stored = self.store.start_conversation(
                    role, content, info.spec, info.precision, self.session.system_prompt, record
                )
                self.conversation_id = stored.conversation_id
            elif side:
                stored = self.store.add_message(
                    self.conversation_id, role, content, parent, record, make_leaf=False
                )
            else:
                stored = self.store.add_message(
                    self.conversation_id, role, content, parent, record, expected_leaf=self.head
                )
            saved = self._saved(stored)
        except ConversationChanged:
            raise
        except StoreError as e:
            yield from self._saving_off(e)
            return None
        if not side:
            self.head = stored.id
        yield MessageSaved(self.conversation_id, index, saved)
        return saved.id
