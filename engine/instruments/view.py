"""What the UI thread may read of the running session: `SessionView`, which `ChatSession` satisfies.

The inference thread owns the session. Another thread reads only these attributes: data
that is finished (an answer's trace once it is in `messages`, the tokenizer, the model's
shape) or made to be shared (the step gate, the sampling settings swapped whole). Anything
that runs the model goes through the engine's `call` instead, on the inference thread.

A `RemoteSession` (engine/remote/) has the conversation's attributes (messages, system_prompt,
trace, info, namer, sampling) but no model, tokenizer or step gate: with --server the app
opens only the token inspector, which reads those, and the tokenizer view, which asks the
server's tokenizer (`server_tokenizer`) off the UI thread.

Importing this module loads no torch: the app types its link to the engine with it.
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from engine.capabilities import Capabilities
    from engine.conversation import Message
    from engine.detok import PieceNamer
    from engine.events import ModelInfo
    from engine.instruments.stepping import StepGate
    from engine.instruments.trace import AnswerTrace
    from engine.models import LoadedModel
    from engine.prompt_format import PromptFormat
    from engine.sampling import SamplingSettings


class SessionView(Protocol):
    """The read-only attributes of a `ChatSession` the instruments read on the UI thread."""

    @property
    def messages(self) -> Sequence[Message]:
        """The conversation; an answer's trace is final once the answer is here."""

    @property
    def system_prompt(self) -> str | None: ...

    @property
    def trace(self) -> AnswerTrace | None:
        """The answer in progress (read as far as it has got), or the last one."""

    @property
    def info(self) -> ModelInfo: ...

    @property
    def capabilities(self) -> Capabilities:
        """What the session can do (engine/capabilities.py): ask it before `step_gate` or `loaded`."""

    @property
    def loaded(self) -> LoadedModel:
        """For the model's shape (its config and embedding size), never to run it."""

    @property
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer (the engine does not type it more closely)."""

    @property
    def prompt_format(self) -> PromptFormat:
        """How the conversation becomes ids (engine/prompt_format.py)."""

    @property
    def namer(self) -> PieceNamer: ...

    @property
    def stop_ids(self) -> Set[int]: ...

    def sampled_ids(self, message: Message) -> list[int] | None:
        """The ids an answer was sampled as (the prompt holds them as they are), or None."""

    @property
    def sampling(self) -> SamplingSettings:
        """Swapped whole, never mutated: a read sees one consistent set of settings."""

    @property
    def step_gate(self) -> StepGate:
        """Step mode's gate: its caller's side is safe from any thread."""
