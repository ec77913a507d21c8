"""How a conversation becomes the ids the model reads: through the tokenizer's chat template (a
chat model), or as raw text (`--raw`): the messages' texts end to end, which a base model simply
continues, and which shows a class what a chat template adds."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

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
        if self.raw:  # the tokenizer's start token where it adds one (Gemma's <bos>), then the text
            return tokenizer("".join(m["content"] for m in chat))["input_ids"]
        text = self._text(tokenizer, chat, generation_prompt)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def _text(self, tokenizer: Any, chat: list[dict[str, str]], generation_prompt: bool) -> str:
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


CHAT_TEMPLATE = PromptFormat("the model's chat template", raw=False)
RAW = PromptFormat("raw text (no template)", raw=True)
