"""What every kind of session shares: the messages, and the calls that change them before an answer.

A local `ChatSession` and a `RemoteSession` differ only in how they answer (`answer()`); sending,
regenerating and editing are the same message bookkeeping for both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

from engine.events import Event, Failed
from engine.text import utf8_problem

if TYPE_CHECKING:
    from engine.instruments.trace import AnswerTrace


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    trace: AnswerTrace | None = field(default=None, compare=False, repr=False)
    """For an answer generated in this session: its steps, for the token inspector."""
    saved_id: int | None = field(default=None, compare=False)
    """Its id in the conversation store, once saved: trimming, forks and refusals drop it with
    the message, so the ids of a conversation never fall out of step with its messages."""


class Conversation:
    """Messages and a system prompt; a subclass answers the last user message (`answer`)."""

    messages: list[Message]
    system_prompt: str | None

    def answer(self) -> Iterator[Event]:
        raise NotImplementedError

    def send(self, text: str) -> Iterator[Event]:
        """Add a user message and answer it; text no tokenizer can take is refused (Failed)."""
        system = self.system_prompt or ""
        problem = utf8_problem(text, "the message") or utf8_problem(system, "the system prompt")
        if problem:
            yield Failed(problem)
            return
        self.messages.append(Message("user", text))
        yield from self.answer()

    def regenerate(self) -> Iterator[Event]:
        """Drop the last answer and answer the last user message again."""
        while self.messages and self.messages[-1].role == "assistant":
            self.messages.pop()
        if not self.messages:
            yield Failed("nothing to regenerate yet")
            return
        yield from self.answer()

    def edit(self, index: int, text: str) -> Iterator[Event]:
        """Replace user message `index`, forget what followed it, and answer again."""
        if not self.is_user_message(index):
            yield Failed(f"message {index} is not a user message")
            return
        del self.messages[index:]
        yield from self.send(text)

    def reset(self, system_prompt: str | None = None) -> None:
        self.messages.clear()
        self.system_prompt = system_prompt

    def is_user_message(self, index: int) -> bool:
        return 0 <= index < len(self.messages) and self.messages[index].role == "user"

    def last_answer_index(self) -> int:
        """The index of the newest answer in `messages`, -1 if there is none."""
        return max((i for i, m in enumerate(self.messages) if m.role == "assistant"), default=-1)
