"""A model directory's tokenizer and chat template, read without importing transformers.

`llmchat ask` needs a tokenizer before its first token, and importing transformers for one takes
~1.3 s. This reads the same files with the `tokenizers` library and renders the chat template with
jinja2 the way transformers 5 does, so ids, text and special tokens come out identical to
`AutoTokenizer.from_pretrained(directory)`.

It reproduces the plain `TokenizersBackend` built from `tokenizer.json`, and the classes that rebuild
that file's pipeline around its vocabulary (engine/tokenizer_classes.py: Gemma's, Qwen2's) by setting
the same pipeline on it. Where transformers would take another road (another class, remote code,
legacy files, several templates), `ChatTokenizer.from_dir` returns None and the caller loads with
transformers.
"""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer, processors

from engine import tokenizer_classes
from engine.tokenizer_classes import TokenizerClass

NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""The named special tokens in transformers' order, which `all_special_tokens` keeps."""
PLAIN_MODEL_TYPES = frozenset(
    {"llama", "smollm3", "qwen3", "gemma", "gemma2", "gemma3", "gemma3_text", "phi3"}
)
"""Model types whose directory, when it names `TokenizersBackend`, loads as exactly that in
transformers 5.25 (llama and smollm3 have no class of their own; for the rest AutoTokenizer trusts
the config's class). Others are re-routed to a model-specific class that rebuilds the tokenizer
(qwen2, which AutoTokenizer distrusts) or may be patched (mistral), so they are left to
transformers; a config that names a class of engine/tokenizer_classes.py is read as that class."""
PLAIN_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
INPUT_NAMES = ("input_ids", "token_type_ids", "attention_mask")
"""The encoding fields `__call__` can return, in transformers' order."""
UNSUPPORTED_TEMPLATE_ARGS = frozenset(
    {
        "tools",
        "documents",
        "continue_final_message",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
"""apply_chat_template arguments transformers acts on and this does not; refused rather than
handed to the template as variables."""


class Unsupported(Exception):
    """A directory transformers would not load as a plain TokenizersBackend."""


class ChatTokenizer:
    """The subset of a transformers 5 tokenizer the engine calls, with the same results."""

    def __init__(
        self,
        backend: Tokenizer,
        config: dict,
        template: str | None,
        directory: Path,
        rebuilt: TokenizerClass | None = None,
    ):
        self.backend_tokenizer = backend
        self.name_or_path = str(directory)
        self.split_special_tokens = bool(config.get("split_special_tokens", False))
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self._clean_up_bpe = bool(
            config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
        )
        self.model_input_names = list(config.get("model_input_names", ["input_ids", "attention_mask"]))
        if not set(self.model_input_names) <= set(INPUT_NAMES):
            raise Unsupported(f"model inputs {self.model_input_names}")
        added = _added_tokens(config, backend)
        named = _named_tokens(config)
        extras = _extra_tokens(config)
        _prepare_backend(backend, named, extras, added, self.split_special_tokens)
        self.special_tokens_map = {name: str(token) for name, token in named.items() if token is not None}
        """Named special tokens as strings, as transformers' `special_tokens_map` (the template sees them)."""
        self.all_special_tokens = list(dict.fromkeys([*self.special_tokens_map.values(), *map(str, extras)]))
        if rebuilt is not None and rebuilt.adds_named_again:
            backend.add_tokens([AddedToken(token, special=True) for token in self.all_special_tokens])
        self.all_special_ids = self.convert_tokens_to_ids(self.all_special_tokens)
        self.chat_template = template
        """The Jinja source `apply_chat_template` renders; None for a model that ships none (a base
        model); set to use another (`--chat-template`)."""

    @classmethod
    def from_dir(cls, directory: str | Path) -> ChatTokenizer | None:
        """The tokenizer of an HF model directory, or None where only transformers can be sure to load it."""
        directory = Path(directory)
        try:
            config = _read_json(directory / "tokenizer_config.json")
            rebuilt = _check_route(directory, config)
            template = _chat_template(directory, config)
            if template is not None:
                compiled_template(template)  # a template Jinja cannot read is left to transformers
            backend = Tokenizer.from_file(str(directory / "tokenizer.json"))
            if rebuilt is not None:
                config = {**rebuilt.named_defaults, **config}
                _rebuild(backend, rebuilt, config)
            return cls(backend, config, template, directory, rebuilt)
        except Exception:  # whatever this cannot read, transformers reads or reports in its own words
            return None

    # -- special tokens ---------------------------------------------------------
    def _token(self, name: str) -> str | None:
        return self.special_tokens_map.get(name)

    def _token_id(self, name: str) -> int | None:
        token = self.special_tokens_map.get(name)
        return None if token is None else self.convert_tokens_to_ids(token)

    bos_token = property(lambda self: self._token("bos_token"))
    eos_token = property(lambda self: self._token("eos_token"))
    unk_token = property(lambda self: self._token("unk_token"))
    sep_token = property(lambda self: self._token("sep_token"))
    pad_token = property(lambda self: self._token("pad_token"))
    cls_token = property(lambda self: self._token("cls_token"))
    mask_token = property(lambda self: self._token("mask_token"))
    bos_token_id = property(lambda self: self._token_id("bos_token"))
    eos_token_id = property(lambda self: self._token_id("eos_token"))
    unk_token_id = property(lambda self: self._token_id("unk_token"))
    sep_token_id = property(lambda self: self._token_id("sep_token"))
    pad_token_id = property(lambda self: self._token_id("pad_token"))
    cls_token_id = property(lambda self: self._token_id("cls_token"))
    mask_token_id = property(lambda self: self._token_id("mask_token"))

    # -- vocabulary -------------------------------------------------------------
    def __len__(self) -> int:
        """Vocabulary size with the added tokens."""
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """Vocabulary size without the added tokens."""
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        """A token's id, the unk token's id for one not in the vocabulary (None without an unk token)."""
        if isinstance(tokens, str):
            index = self.backend_tokenizer.token_to_id(tokens)
            return self.unk_token_id if index is None else index
        return [self.convert_tokens_to_ids(token) for token in tokens]

    def convert_ids_to_tokens(
        self, ids: int | list[int], skip_special_tokens: bool = False
    ) -> str | None | list[str | None]:
        """The vocabulary piece of an id (None out of range), or of each id in a list."""
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids if int(i) not in skip]

    # -- encode and decode ------------------------------------------------------
    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        """One text's encoding: its ids and the other `model_input_names` fields."""
        if not isinstance(text, str):
            raise TypeError(f"ChatTokenizer encodes one string, not {type(text).__name__}")
        encoding = self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens)
        fields = {
            "input_ids": encoding.ids,
            "token_type_ids": encoding.type_ids,
            "attention_mask": encoding.attention_mask,
        }
        return {name: fields[name] for name in INPUT_NAMES if name in self.model_input_names}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self(text, add_special_tokens=add_special_tokens)["input_ids"]

    def decode(
        self,
        token_ids: int | list[int] | list[list[int]],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
    ) -> str | list[str]:
        """Text of the ids (a list of texts for a list of id lists)."""
        if hasattr(token_ids, "tolist"):  # a tensor or an array
            token_ids = token_ids.tolist()
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        if token_ids and isinstance(token_ids[0], (list, tuple)):
            return [self.decode(ids, skip_special_tokens, clean_up_tokenization_spaces) for ids in token_ids]
        text = self.backend_tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        if clean_up_tokenization_spaces is None:
            clean_up_tokenization_spaces = self.clean_up_tokenization_spaces
        # transformers 5 skips the clean-up for BPE, which it would corrupt, unless told otherwise
        bpe = type(self.backend_tokenizer.model).__name__ == "BPE"
        if clean_up_tokenization_spaces and (not bpe or self._clean_up_bpe):
            text = clean_up_tokenization(text)
        return text

    # -- chat template ----------------------------------------------------------
    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        return_dict: bool = True,
        **kwargs: Any,
    ) -> str | list[int] | dict[str, list[int]]:
        """Render one conversation of plain messages as transformers does: the text with
        tokenize=False, else its encoding without added special tokens (a dict as `__call__` gives,
        or the ids with return_dict=False)."""
        unsupported = UNSUPPORTED_TEMPLATE_ARGS & kwargs.keys()
        if unsupported:
            raise NotImplementedError(f"ChatTokenizer does not take {', '.join(sorted(unsupported))}")
        source = kwargs.pop("chat_template", None) or self.chat_template
        if source is None:
            raise ValueError(f"{self.name_or_path} has no chat template (a base model): set chat_template")
        text = compiled_template(source).render(
            messages=_chat_messages(conversation),
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens_map,
            **kwargs,
        )
        if not tokenize:
            return text
        encoding = self(text, add_special_tokens=False)
        return encoding if return_dict else encoding["input_ids"]


# -- loading, step by step as transformers 5.24 does -----------------------------
def _read_json(path: Path) -> dict:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def _check_route(directory: Path, config: dict) -> TokenizerClass | None:
    """Raise Unsupported unless AutoTokenizer would build a TokenizersBackend straight from
    tokenizer.json (None), or a class of engine/tokenizer_classes.py for its own model types (its record)."""
    model_type = _read_json(directory / "config.json").get("model_type")
    rebuilt = tokenizer_classes.named(config.get("tokenizer_class"))
    if rebuilt is None and model_type not in PLAIN_MODEL_TYPES:
        raise Unsupported(f"model type {model_type!r}")
    if rebuilt is not None and model_type not in rebuilt.model_types:
        raise Unsupported(f"{config['tokenizer_class']} for model type {model_type!r}")
    _check_config(config, plain=rebuilt is None)
    if not (directory / "tokenizer.json").is_file() or (directory / "additional_chat_templates").is_dir():
        raise Unsupported("no tokenizer.json, or several chat templates")
    # Without added_tokens_decoder in the config, transformers merges these legacy files in
    if "added_tokens_decoder" not in config:
        if (directory / "special_tokens_map.json").exists() or (directory / "added_tokens.json").exists():
            raise Unsupported("legacy special token files")
    for side in ("padding_side", "truncation_side"):
        if config.get(side, "right") not in ("right", "left"):
            raise Unsupported(side)
    return rebuilt


def _check_config(config: dict, plain: bool) -> None:
    """Raise Unsupported for a tokenizer class or setting this does not read."""
    if plain and config.get("tokenizer_class") not in PLAIN_TOKENIZER_CLASSES:
        raise Unsupported(f"tokenizer class {config.get('tokenizer_class')!r}")
    for key in ("auto_map", "fast_tokenizer_files", "fix_mistral_regex", "model_specific_special_tokens"):
        if key in config:
            raise Unsupported(key)


def _rebuild(backend: Tokenizer, rebuilt: TokenizerClass, config: dict) -> None:
    """Set `rebuilt`'s pipeline on the file's backend, as its `__init__` sets it around the file's
    vocabulary and merges. Raise Unsupported where that would not end the same: a model other than
    BPE, added tokens matched after normalizing under another normalizer than the class's (found
    with the file's), or added tokens the config's added_tokens_decoder leaves out (transformers
    keeps only the config's)."""
    added = backend.get_added_tokens_decoder()
    if type(backend.model).__name__ != "BPE":
        raise Unsupported("a model other than BPE")
    if "added_tokens_decoder" in config and not {str(i) for i in added} <= set(
        config["added_tokens_decoder"]
    ):
        raise Unsupported("tokenizer.json adds tokens the config does not")
    unk = config.get("unk_token")
    pipeline = rebuilt.pipeline(
        None if unk is None else str(_added_token(unk)), bool(config.get("add_prefix_space"))
    )
    normalized = any(token.normalized for token in added.values())
    if normalized and _state(backend.normalizer) != _state(pipeline.normalizer):
        raise Unsupported("normalized added tokens under another normalizer")
    backend.normalizer = pipeline.normalizer
    backend.pre_tokenizer = pipeline.pre_tokenizer
    backend.decoder = pipeline.decoder
    for name, value in pipeline.bpe.items():
        setattr(backend.model, name, value)


def _state(piece: Any) -> Any:
    """A pipeline piece as tokenizers serializes it (None for none)."""
    return None if piece is None else json.loads(piece.__getstate__())


def _chat_template(directory: Path, config: dict) -> str | None:
    """chat_template.jinja (the transformers 5 layout), else the config's; one template, as a
    string; None where there is none (a base model)."""
    path = directory / "chat_template.jinja"
    template = path.read_text(encoding="utf-8") if path.is_file() else config.get("chat_template")
    if template is None:
        return None
    if not isinstance(template, str) or not template:
        raise Unsupported("no single chat template")
    return template


def _added_token(value: Any) -> str | AddedToken:
    """A token as the config writes it: a string or a serialized AddedToken."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and value.get("__type") == "AddedToken":
        return AddedToken(**{key: item for key, item in value.items() if key != "__type"})
    raise Unsupported(f"token {value!r}")  # transformers rejects it, or reads it some other way


def _added_tokens(config: dict, backend: Tokenizer) -> dict[int, AddedToken]:
    """The config's added_tokens_decoder, else tokenizer.json's added tokens (which the backend holds
    field for field: tokenizers refuses a file that leaves one out)."""
    if "added_tokens_decoder" not in config:
        return backend.get_added_tokens_decoder()
    return {int(index): AddedToken(**token) for index, token in config["added_tokens_decoder"].items()}


def _named_tokens(config: dict) -> dict[str, str | AddedToken | None]:
    """bos_token ... mask_token as the config names them (None where it does not)."""
    for key, value in config.items():
        # model-specific named tokens (image_token...) join all_special_tokens; left to transformers
        if key.endswith("_token") and key not in NAMED_TOKENS and isinstance(value, (str, dict)):
            raise Unsupported(key)
    named: dict[str, str | AddedToken | None] = dict.fromkeys(NAMED_TOKENS)
    for name in NAMED_TOKENS:
        if config.get(name) is not None:
            named[name] = _added_token(config[name])
    return named


def _extra_tokens(config: dict) -> list[str | AddedToken]:
    extras = config.get("extra_special_tokens")
    if not extras and "additional_special_tokens" in config:
        extras = config["additional_special_tokens"]
    if extras is None:
        return []
    if not isinstance(extras, (list, tuple)):
        raise Unsupported("extra special tokens as a dict")
    return [_added_token(token) for token in extras]


def _prepare_backend(
    backend: Tokenizer,
    named: dict[str, str | AddedToken | None],
    extras: list[str | AddedToken],
    added: dict[int, AddedToken],
    split_special_tokens: bool,
) -> None:
    """Make the same changes to the backend as TokenizersBackend.__init__, in the same order, so it ends
    in the same state (the tests compare the two backends' JSON)."""
    if backend.truncation is not None or backend.padding is not None:
        # transformers would take its defaults from them
        raise Unsupported("truncation or padding in tokenizer.json")
    backend.no_truncation()
    rebuild_post_processor = backend.post_processor is None
    backend.encode_special_tokens = split_special_tokens
    # Every token of added_tokens_decoder is added again (transformers' check for ones the backend already
    # holds compares ids with tokens, so never matches); tokenizers leaves identical ones as they are.
    to_add: list[str | AddedToken] = [token for _, token in sorted(added.items())]
    known = [token.content for token in backend.get_added_tokens_decoder().values()]
    known += [str(token) for token in to_add]
    for token in [*named.values(), *extras]:
        if token is not None and str(token) not in known and token not in to_add:
            to_add.append(token)
    named_strings = [str(token) for token in named.values() if token]
    tokens = []
    for token in to_add:
        if isinstance(token, str):
            token = AddedToken(token, special=True)
        elif not token.special and str(token) in named_strings:
            token.special = True
        tokens.append(token)
    if tokens:
        backend.add_tokens(tokens)
    if rebuild_post_processor:  # transformers writes one that adds no bos or eos
        backend.post_processor = processors.TemplateProcessing(
            single="$A:0", pair="$A:0 $B:1", special_tokens=[]
        )


def clean_up_tokenization(text: str) -> str:
    """transformers' clean-up of spaces before punctuation and contractions."""
    for spaced, joined in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(spaced, joined)
    return text


# -- the template environment, as transformers/utils/chat_template_utils.py builds it ------
class TemplateDict:
    """`dict(...)` in a template, without exposing the dict type itself."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


class TemplateNamespace(jinja2.utils.Namespace):
    """A namespace that refuses underscore names, which could reach CPython internals."""

    def __init__(*args, **kwargs):  # Jinja's signature trick, so that namespace(self=...) still works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got "
                f"{name!r}. Please rename the attribute."
            )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters, which a prompt must keep
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@functools.lru_cache(maxsize=8)
def compiled_template(source: str) -> jinja2.Template:
    """A chat template compiled in transformers' sandbox, with its globals and filters (once per
    template's text)."""
    if _version(jinja2.__version__) < (3, 1, 6):  # older ones have sandbox escapes; transformers refuses them
        raise ImportError(f"chat templates need jinja2>=3.1.6, not {jinja2.__version__}")
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(source)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def _chat_messages(conversation: Any) -> list[dict]:
    """The messages as the template sees them: copies, None values dropped (as transformers does:
    templates handle a missing key better than a literal "None")."""
    if isinstance(conversation, (list, tuple)) and len(conversation) == 0:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    if not isinstance(conversation, (list, tuple)) or isinstance(conversation[0], (list, tuple)):
        raise NotImplementedError("ChatTokenizer renders one conversation (a list of messages) at a time")
    for message in conversation:
        if not isinstance(message, dict):
            raise NotImplementedError(
                f"ChatTokenizer takes messages as plain dicts, not {type(message).__name__}"
            )
    return [{key: item for key, item in message.items() if item is not None} for message in conversation]
