"""The transformers 5.25 tokenizer classes engine/chat_tokenizer.py reproduces beside the plain
`TokenizersBackend`. Each rebuilds tokenizer.json's pipeline around the file's vocabulary and merges
in its `__init__`, and names special tokens of its own; one record per class says what it builds,
so adding a class is a record plus its test (tests/test_chat_tokenizer.py has transformers write
and read each class's directory and compares)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from tokenizers import Regex, decoders, normalizers, pre_tokenizers


class Pipeline(NamedTuple):
    """What a class sets around the vocabulary: the tokenizers pieces and its BPE model's settings."""

    normalizer: Any
    pre_tokenizer: Any
    decoder: Any
    bpe: dict[str, Any]


@dataclass(frozen=True)
class TokenizerClass:
    name: str
    model_types: frozenset[str]
    """Model types AutoTokenizer maps to this class: a config that names it for one is not re-routed."""
    named_defaults: dict[str, str | None]
    """The named special tokens its `__init__` gives where the config names none."""
    pipeline: Callable[[str | None, bool], Pipeline]
    """Its pipeline for the named unk token and the config's add_prefix_space."""
    adds_named_again: bool = False
    """Whether its `__init__` ends by adding its special tokens once more (as special AddedTokens)."""


def _gemma(unk_token: str | None, add_prefix_space: bool) -> Pipeline:
    return Pipeline(
        normalizers.Replace(" ", "▁"),
        pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False),
        decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]),
        {
            "dropout": None,
            "unk_token": str(unk_token),  # as the class writes it, "None" for none
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": True,
            "ignore_merges": False,
        },
    )


QWEN2_PRETOKENIZE = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
"""Qwen2's split before its byte-level BPE (transformers' `PRETOKENIZE_REGEX`)."""


def _qwen2(unk_token: str | None, add_prefix_space: bool) -> Pipeline:
    return Pipeline(
        normalizers.NFC(),
        pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False),
            ]
        ),
        decoders.ByteLevel(),
        {
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
        },
    )


GEMMA = TokenizerClass(
    "GemmaTokenizer",
    frozenset({"gemma", "gemma2", "gemma3", "gemma3_text"}),
    {
        "unk_token": "<unk>",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "mask_token": "<mask>",
    },
    _gemma,
)
QWEN2 = TokenizerClass(
    "Qwen2Tokenizer",
    frozenset({"qwen2", "qwen3"}),
    {
        "unk_token": "<|endoftext|>",
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
    },
    _qwen2,
    adds_named_again=True,
)
CLASSES = {cls.name: cls for cls in (GEMMA, QWEN2)}


def named(tokenizer_class: Any) -> TokenizerClass | None:
    """The record of the class a tokenizer config names (with or without "Fast"), None if none."""
    return CLASSES.get(str(tokenizer_class).removesuffix("Fast"))
