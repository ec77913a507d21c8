"""How a conversation becomes the ids the model reads: through the tokenizer's chat template (a
chat model), or as raw text (`--raw`): the messages' texts end to end, which a base model simply
continues, and which shows a class what a chat template adds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PromptFormat:
    name: str
    raw: bool
    """The texts go as they are, with no template around them."""

    def ids(self, tokenizer: Any, chat: list[dict[str, str]], generation_prompt: bool = True) -> list[int]:
        """`chat` ([{"role", "content"}], a system message first if any) as the model's input ids;
        `generation_prompt` opens the assistant's turn (a template's own business)."""
        if self.raw:  # the tokenizer's start token where it adds one (Gemma's <bos>), then the text
            return tokenizer("".join(m["content"] for m in chat))["input_ids"]
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=generation_prompt, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]


CHAT_TEMPLATE = PromptFormat("the model's chat template", raw=False)
RAW = PromptFormat("raw text (no template)", raw=True)
