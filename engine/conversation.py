"""The conversation both kinds of session hold: its messages, and the turns over them (send,
regenerate, edit) that each session answers its own way (engine/session.py on local weights,
engine/remote/session.py on a server)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from engine.events import Event, Failed
from engine.instruments.trace import AnswerTrace
from engine.utf8 import utf8_problem


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    trace: AnswerTrace | None = field(default=None, compare=False, repr=False)
    """For an answer generated in this session: its steps, for the token inspector."""
    sampled_ids: tuple[int, ...] | None = field(default=None, compare=False, repr=False)
    """For an answer resumed with its saved KV cache: the ids it was sampled as, read back from
    the cache (an answer of this session has them in its trace)."""
    saved_id: int | None = field(default=None, compare=False)
    """Its id in the conversation store, once saved: trimming, forks and refusals drop it with
    the message, so the ids of a conversation never fall out of step with its messages."""


class Turns:
    """Send, regenerate and edit over `messages`: the same for the local and the remote session
    (engine/remote/session.py); each brings `messages`, `system_prompt` and `answer()`."""

    messages: list[Message]
    system_prompt: str | None

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

    def is_user_message(self, index: int) -> bool:
        return 0 <= index < len(self.messages) and self.messages[index].role == "user"

    def last_answer_index(self) -> int:
        """The index of the newest answer in `messages`, -1 if there is none."""
        return max((i for i, m in enumerate(self.messages) if m.role == "assistant"), default=-1)
