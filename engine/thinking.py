"""Thinking tokens: a model's thought (`<think>…</think>`) told apart from its answer.

Qwen3, the DeepSeek-R1 distills and SmolLM3 think in a block before they answer. The markers
are single tokens in their vocabularies (told apart by id); elsewhere, and in a server's text,
they are text (told apart as text, also when a marker is split over several tokens). The
generation prompt may open the block itself (DeepSeek-R1's ends with "<think>\\n") or close an
empty one (Qwen3 with enable_thinking=False), so a splitter starts from what it ends with.
The marker tokens count as thought.

An answer is kept with its thought, markers included (Qwen3's template strips old blocks from
the history it renders); `split_saved` parts a kept answer again for display.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from engine.events import TokenSampled

OPEN, CLOSE = "<think>", "</think>"
SWITCH = "enable_thinking"
"""The variable a chat template reads to turn its thinking on or off (Qwen3, SmolLM3)."""


def switch_problem(template: Any) -> str | None:
    """Why `--thinking` cannot act on this chat template (it does not read enable_thinking), or None."""
    if isinstance(template, str) and SWITCH in template:
        return None
    return f"the chat template has no thinking switch (it does not read {SWITCH})"


@dataclass(frozen=True)
class Markers:
    """The block's markers as token ids where the vocabulary has each as one token; None: as text."""

    open_id: int | None = None
    close_id: int | None = None


def markers_of(tokenizer: Any) -> Markers:
    """The markers' ids in this tokenizer (None for one it has no single token for)."""
    return Markers(_token_id(tokenizer, OPEN), _token_id(tokenizer, CLOSE))


def _token_id(tokenizer: Any, token: str) -> int | None:
    found = tokenizer.convert_tokens_to_ids(token)
    return found if isinstance(found, int) and found != tokenizer.unk_token_id else None


def opens_block(generation_prompt: str) -> bool:
    """The generation prompt leaves a thinking block open: the answer starts as thought."""
    return generation_prompt.rfind(OPEN) > generation_prompt.rfind(CLOSE)


class ThoughtSplitter:
    """Says of each token of an answer, in order, whether it is thought."""

    def __init__(self, markers: Markers = Markers(), thinking: bool = False, opens_as_text: bool = True):
        """`opens_as_text` False: only the open marker's id opens a block (a local model whose
        vocabulary has no such token does not think, and an answer that starts "<" is answer)."""
        self.markers = markers
        self.thinking = thinking
        self._start: str | None = "" if opens_as_text and not thinking else None
        """The answer's text so far while it may still open a block as text (only its start can)."""
        self._tail = ""
        """The thought's last characters, where a closing marker written as text may be forming."""

    def is_thought(self, token_id: int | None, text: str) -> bool:
        """Whether this token (its id, where known, and its text) is thought; moves the state on."""
        if self.thinking:
            self._think(token_id, text)
            return True
        return self._opens(token_id, text)

    def _think(self, token_id: int | None, text: str) -> None:
        """A token of thought: the block stays open unless it closes it."""
        if self.markers.close_id is not None:
            self.thinking = token_id != self.markers.close_id
            return
        self._tail += text
        self.thinking = CLOSE not in self._tail
        self._tail = self._tail[-(len(CLOSE) - 1) :] if self.thinking else ""

    def _opens(self, token_id: int | None, text: str) -> bool:
        """A token of the answer: does it open a block (or, as text, maybe begin its marker)?"""
        if self.markers.open_id is not None:
            self.thinking = token_id == self.markers.open_id
            return self.thinking
        if self._start is None:
            return False
        self._start += text
        head = self._start.lstrip()
        if head.startswith(OPEN):
            self._start, self.thinking = None, True
            self._think(None, head[len(OPEN) :])  # "<think>\n\n</think>" may come at once
            return True
        if OPEN.startswith(head):  # nothing yet, or the marker's beginning ("<th"): wait and see
            return bool(head)  # a piece of the marker is thought (a stray "<" is the cost)
        self._start = None  # the answer began without a block
        return False


class ThinkingFigures(NamedTuple):
    """An answer's thinking as TurnStats reports it."""

    tokens: int
    first_thought_s: float | None
    """From the start of the turn to the first thought token (None: no thought)."""
    first_answer_s: float | None
    """From the start of the turn to the first token that is not thought (None: none came)."""


def thinking_figures(steps: Sequence[TokenSampled]) -> ThinkingFigures:
    """Thought tokens, and when the first thought and the first answer token came (each step's
    latency is the time since the one before; the first's since the turn started)."""
    elapsed, first_thought, first_answer = 0.0, None, None
    for step in steps:
        elapsed += step.latency_s
        if step.thinking and first_thought is None:
            first_thought = elapsed
        if not step.thinking and first_answer is None:
            first_answer = elapsed
    return ThinkingFigures(sum(step.thinking for step in steps), first_thought, first_answer)


def split_saved(text: str) -> tuple[str, str]:
    """(thought, answer) of an answer kept whole: a block the answer opened, or one the prompt
    opened (no `<think>`, but a `</think>`); the thought keeps its markers, an unclosed one is all thought."""
    head = text.lstrip()
    end = text.find(CLOSE)
    if end >= 0 and (head.startswith(OPEN) or OPEN not in text[:end]):
        end += len(CLOSE)
        return text[:end], text[end:]
    if head.startswith(OPEN):
        return text, ""
    return "", text


def shown(thought: str) -> str:
    """Thought text for display: the markers left out."""
    return thought.replace(OPEN, "").replace(CLOSE, "")


def kept(pieces: Iterable[tuple[bool, str]]) -> str:
    """An answer's text to keep from its (thought?, text) pieces: thought a server sent apart
    (without markers) is wrapped in them, so `split_saved` finds it again."""
    out: list[str] = []
    run: list[str] = []
    for thought, text in pieces:
        if thought:
            run.append(text)
            continue
        if run:
            out.append(_marked("".join(run), closed=True))
            run = []
        out.append(text)
    if run:  # the answer ended while thinking
        out.append(_marked("".join(run), closed=False))
    return "".join(out)


def _marked(thought: str, closed: bool) -> str:
    if thought.lstrip().startswith(OPEN):  # its markers came with it (a server without a parser)
        return thought
    return OPEN + thought + (CLOSE if closed else "")
