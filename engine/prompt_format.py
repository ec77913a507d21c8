"""How a conversation becomes the ids the model reads: through the tokenizer's chat template (a
chat model), or as raw text (`--raw`): the messages' texts end to end, which a base model simply
continues, and which shows a class what a chat template adds.

A follow-up is joined at the token level: each earlier answer enters the prompt as the ids the
model sampled for it, not as its text tokenized again (a sampled `Al le in` re-tokenizes as
`Al lein`), so the KV cache, which holds the sampled ids, is reused to its end. Only the text
the template puts around the messages is tokenized."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from engine.detok import StreamingDetokenizer
from engine.thinking import SWITCH


@dataclass(frozen=True)
class PromptFormat:
    name: str
    raw: bool
    """The texts go as they are, with no template around them."""
    thinking: bool | None = None
    """`--thinking on|off`: the template's `enable_thinking`; None leaves the template's default."""

    def ids(self, tokenizer: Any, chat: list[dict[str, str]], generation_prompt: bool = True) -> list[int]:
        """`chat` ([{"role", "content"}], a system message first if any) as the model's input ids;
        `generation_prompt` opens the assistant's turn (a template's own business)."""
        return self.joined(tokenizer, chat, generation_prompt).ids

    def joined(
        self,
        tokenizer: Any,
        chat: list[dict[str, str]],
        generation_prompt: bool = True,
        kept: Mapping[int, Sequence[int]] | None = None,
    ) -> Joined:
        """The input ids with the answers in `kept` (message index -> the ids sampled for it) as
        they were sampled. An answer the template does not render as it was (Qwen3 drops an old
        answer's thinking) is tokenized from its text, and so is everything after it: `Joined.broken`
        says which and why."""
        text = self._text(tokenizer, chat, generation_prompt)
        ids: list[int] = []
        at = 0  # the characters of `text` already in `ids`
        for index, answer_ids in sorted((kept or {}).items()):
            content = chat[index]["content"]
            before = self._text(tokenizer, chat[:index], True)  # the prompt that answer continued
            why = _not_kept(tokenizer, text, before, content, answer_ids, at)
            if why:
                return Joined(ids + self._tokens(tokenizer, text[at:], at == 0), _answer(chat, index, why))
            ids += self._tokens(tokenizer, text[at : len(before)], at == 0)
            ids += answer_ids
            at = len(before) + len(content)
        return Joined(ids + self._tokens(tokenizer, text[at:], at == 0))

    def _tokens(self, tokenizer: Any, text: str, first: bool) -> list[int]:
        """Raw text opens with the tokenizer's start token where it adds one (Gemma's <bos>); a
        template writes its own."""
        if self.raw and first:
            return tokenizer(text)["input_ids"]
        return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def _text(self, tokenizer: Any, chat: list[dict[str, str]], generation_prompt: bool) -> str:
        if self.raw:
            return "".join(m["content"] for m in chat)
        switch = {} if self.thinking is None else {SWITCH: self.thinking}
        return tokenizer.apply_chat_template(
            chat, add_generation_prompt=generation_prompt, tokenize=False, **switch
        )

    def generation_prompt(self, tokenizer: Any) -> str:
        """The text the template adds to open the assistant's turn (Qwen3's with thinking off
        closes an empty `<think>` block there); '' for raw text, or a template that will not say."""
        if self.raw:
            return ""
        chat = [{"role": "user", "content": "?"}]
        try:
            bare, opened = (self._text(tokenizer, chat, prompt) for prompt in (False, True))
        except Exception:  # a template may refuse a lone message its own way; the answer then starts plain
            return ""
        return opened[len(bare) :] if opened.startswith(bare) else ""

    def with_thinking(self, thinking: bool | None) -> PromptFormat:
        """This format with `--thinking` set (raw text has no template to switch)."""
        return self if self.raw else dataclasses.replace(self, thinking=thinking)


@dataclass(frozen=True)
class Joined:
    ids: list[int]
    broken: str | None = None
    """Which answer could not be kept as sampled, and why (reuse of the KV cache stops in it)."""


def _not_kept(
    tokenizer: Any, text: str, before: str, content: str, ids: Sequence[int], at: int
) -> str | None:
    """Why an answer cannot enter `text` as its sampled `ids`, or None: the template must write it
    as it was sampled, right after the prompt it continued, and the ids must spell it (as the
    streaming detokenizer does)."""
    if not text.startswith(before + content) or len(before) < at:
        return "the template writes it otherwise than it was sampled (e.g. without its thinking)"
    if _spelled(tokenizer, ids) != content:
        return "its sampled ids do not spell its text (a stop marker or a split character was cut)"
    return None


def answer_ids_in(tokenizer: Any, held: Sequence[int], start: int, content: str) -> list[int] | None:
    """The ids that spell the answer `content` from position `start` of `held` (a saved cache's
    ids), or None where they do not. A cache ends one token short of its last answer (the token
    decoding stopped on is never fed): the text the cache lacks is tokenized."""
    if not content:
        return []
    detok = StreamingDetokenizer(tokenizer)
    spelled = ""
    for end in range(start, len(held)):
        spelled += detok.add(held[end])
        if spelled == content:
            return list(held[start : end + 1])
        if not content.startswith(spelled):
            return None
    kept = list(held[start:])
    spelled = _spelled(tokenizer, kept)  # with a split character the cache ends in, which fails here
    if not content.startswith(spelled):
        return None
    return kept + tokenizer(content[len(spelled) :], add_special_tokens=False)["input_ids"]


def _spelled(tokenizer: Any, ids: Sequence[int]) -> str:
    """As the streaming detokenizer spells them (engine/detok.py)."""
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _answer(chat: list[dict[str, str]], index: int, why: str) -> str:
    number = sum(m["role"] == "assistant" for m in chat[: index + 1])
    return f"answer {number} is tokenized from its text: {why}"


CHAT_TEMPLATE = PromptFormat("the model's chat template", raw=False)
RAW = PromptFormat("raw text (no template)", raw=True)
