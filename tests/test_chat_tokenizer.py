"""ChatTokenizer gives what transformers' AutoTokenizer gives, or None where it cannot be sure to."""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers
from transformers import AutoTokenizer

from engine.chat_tokenizer import PLAIN_MODEL_TYPES, ChatTokenizer
from engine.detok import PieceNamer, StreamingDetokenizer
from engine.models import CHATML

ROOT = Path(__file__).resolve().parent.parent

TEXTS = [
    "",
    "Hello, world!",
    "café naïve Ωmega — “quotes” … ok",
    "robots 🤖🦀 and a family 👨‍👩‍👧 with flags 🇫🇷",
    "추론은 어떻게 작동하나요? 日本語",
    "lines\n\nand   runs \t of\u00a0spaces  \n",
    " leading space, trailing space ",
    "a literal <|im_end|> and <|im_start|>user\nin text",
    "<|im_end|><|im_end|>",
    "<|endoftext|>",
    "x² + y² = z², ∑ᵢ aᵢ ≤ ∫ f(x) dx",
    "don't , isn't . we 're here ?",
]

CHATS = [
    [{"role": "user", "content": "Hello, world!"}],
    [
        {"role": "system", "content": "Answer in one line."},
        {"role": "user", "content": "café naïve 🤖 — what is x²?"},
        {"role": "assistant", "content": "It is\n\n  x times x. "},
        {"role": "user", "content": "and <|im_end|> in the middle?"},
    ],
    [
        {"role": "system", "content": ""},
        {"role": "user", "content": ""},
        {"role": "assistant", "content": "  ", "tool_calls": None},  # None values are dropped
        {"role": "user", "content": "lines\n\nand   runs"},
    ],
]

WORDS = [
    "hello",
    "world",
    ",",
    "!",
    ".",
    "?",
    "user",
    "assistant",
    "system",
    "don",
    "'",
    "t",
    "isn",
    "we",
    "re",
]


def backend_state(tokenizer) -> dict:
    return json.loads(tokenizer.backend_tokenizer.to_str())


def assert_same(ours: ChatTokenizer, theirs) -> None:
    """Everything the engine reads, compared call by call."""
    assert ours is not None
    assert backend_state(ours) == backend_state(theirs)  # same vocabulary, added tokens and pipeline
    for name in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"):
        assert getattr(ours, name) == getattr(theirs, name), name
        assert getattr(ours, name + "_id") == getattr(theirs, name + "_id"), name
    assert ours.all_special_tokens == theirs.all_special_tokens
    assert ours.all_special_ids == theirs.all_special_ids
    assert ours.special_tokens_map == theirs.special_tokens_map
    assert ours.chat_template == theirs.chat_template
    if theirs.chat_template is None:  # a base model: neither renders a chat
        for tokenizer in (ours, theirs):
            with pytest.raises(ValueError):
                tokenizer.apply_chat_template(CHATS[0], tokenize=False)
    assert len(ours) == len(theirs) and ours.vocab_size == theirs.vocab_size
    for text in TEXTS:
        for add in (False, True):
            assert ours(text, add_special_tokens=add) == dict(theirs(text, add_special_tokens=add)), text
            assert ours.encode(text, add_special_tokens=add) == theirs.encode(text, add_special_tokens=add)
        assert_same_decoding(ours, theirs, theirs(text, add_special_tokens=False)["input_ids"])
    for chat in CHATS if theirs.chat_template is not None else []:
        for prompt in (False, True):
            text = ours.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=False)
            assert text == theirs.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=False)
            ids = ours.apply_chat_template(chat, add_generation_prompt=prompt, return_dict=False)
            assert ids == theirs.apply_chat_template(chat, add_generation_prompt=prompt, return_dict=False)
            encoded = ours.apply_chat_template(chat, add_generation_prompt=prompt)
            assert encoded == dict(theirs.apply_chat_template(chat, add_generation_prompt=prompt))
            assert_same_decoding(ours, theirs, ids)
    pieces = [*ours.all_special_tokens, "<|im_end|>", "hello", "not-in-the-vocabulary", "Ġthe", "Ċ"]
    assert ours.convert_tokens_to_ids(pieces) == theirs.convert_tokens_to_ids(pieces)
    for piece in pieces:
        assert ours.convert_tokens_to_ids(piece) == theirs.convert_tokens_to_ids(piece)


def assert_same_decoding(ours: ChatTokenizer, theirs, ids: list[int]) -> None:
    for skip in (False, True):
        for clean in (False, True, None):
            expected = theirs.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=clean)
            assert ours.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=clean) == expected
        assert ours.convert_ids_to_tokens(ids, skip_special_tokens=skip) == theirs.convert_ids_to_tokens(
            ids, skip_special_tokens=skip
        )
    assert [ours.convert_ids_to_tokens(i) for i in ids] == [theirs.convert_ids_to_tokens(i) for i in ids]
    assert ours.decode([ids, ids[:1]]) == theirs.decode([ids, ids[:1]])


def assert_same_pieces_and_stream(ours: ChatTokenizer, theirs, ids: list[int]) -> None:
    """What engine/detok.py makes of each: readable pieces and the streamed text."""
    assert PieceNamer(ours).pieces(ids) == PieceNamer(theirs).pieces(ids)
    streams = []
    for tokenizer in (ours, theirs):
        detok = StreamingDetokenizer(tokenizer)
        streams.append([detok.add(i) for i in ids] + [detok.flush()])
    assert streams[0] == streams[1]


def write_model_dir(
    directory: Path, tokenizer: Tokenizer, config: dict, template_file: str | None = None
) -> Path:
    """An HF directory as tokenizers and a hand-written config leave it (config.json says llama)."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    (directory / "config.json").write_text(json.dumps({"model_type": "llama"}), encoding="utf-8")
    if template_file is not None:
        (directory / "chat_template.jinja").write_text(template_file, encoding="utf-8")
    return directory


def word_tokenizer() -> Tokenizer:
    """engine/models.py `_write_random`'s synthetic tokenizer: whole words, specials only in the vocab."""
    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    vocab = {token: i for i, token in enumerate([*specials, *WORDS])}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return words


def compare_dir(directory: Path) -> ChatTokenizer:
    ours = ChatTokenizer.from_dir(directory)
    assert_same(ours, AutoTokenizer.from_pretrained(str(directory)))
    return ours


# -- the built-in model ----------------------------------------------------------
@pytest.mark.real_model
def test_smollm2_matches_transformers(smollm2):
    directory = Path(smollm2.model.name_or_path)
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= {
        p.name for p in directory.iterdir()
    }
    ours = ChatTokenizer.from_dir(directory)
    theirs = AutoTokenizer.from_pretrained(str(directory))
    assert_same(ours, theirs)
    # Its template adds a default system prompt only when the chat has none: both kinds are in CHATS
    assert "SmolLM" in ours.apply_chat_template(CHATS[0], tokenize=False)
    assert "SmolLM" not in ours.apply_chat_template(CHATS[1], tokenize=False)
    # A literal special token in text is the special token, as transformers splits it
    assert ours("x <|im_end|> y", add_special_tokens=False)["input_ids"][2] == ours.eos_token_id == 2
    rng = random.Random(0)
    ids = rng.sample(range(len(ours)), 2000) + list(range(20))
    assert_same_pieces_and_stream(ours, theirs, ids)
    text_ids = ours("".join(TEXTS), add_special_tokens=False)["input_ids"]
    assert_same_pieces_and_stream(ours, theirs, text_ids)
    assert sum("<0x" in piece for piece in PieceNamer(ours).pieces(text_ids)) >= 3  # byte-level pieces


# -- tiny tokenizers built here ---------------------------------------------------
def test_tiny_byte_level_model_matches_transformers(tiny_model_dir):
    ours = compare_dir(tiny_model_dir)
    theirs = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    ids = ours("".join(TEXTS), add_special_tokens=False)["input_ids"]
    assert_same_pieces_and_stream(ours, theirs, ids + list(range(len(ours))))


def test_template_in_tokenizer_config_and_specials_only_in_the_vocab(tmp_path):
    """As `_write_random` leaves it, but with the template in tokenizer_config.json: transformers makes
    the named tokens added special tokens, and rebuilds the missing post-processor."""
    config = {
        "tokenizer_class": "TokenizersBackend",
        "chat_template": CHATML,
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "unk_token": "<unk>",
        "pad_token": "<unk>",
    }
    ours = compare_dir(write_model_dir(tmp_path / "words", word_tokenizer(), config))
    assert ours.chat_template == CHATML
    assert ours.backend_tokenizer.get_added_tokens_decoder()[2].special
    assert ours.decode(ours.encode("hello <|im_end|> world"), skip_special_tokens=True) == "hello world"


def test_added_tokens_in_the_config_and_tokens_not_in_the_vocab(tmp_path):
    """The config's added_tokens_decoder overrides tokenizer.json's; a bos token written as an AddedToken;
    named and additional tokens the vocabulary lacks; no unk token; clean-up on a non-BPE model."""
    words = word_tokenizer()
    words.add_special_tokens([AddedToken("<|im_end|>", rstrip=True, special=True)])
    words.add_tokens([AddedToken("<think>", normalized=False)])
    token = {"lstrip": False, "rstrip": False, "normalized": False, "single_word": False, "special": True}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {
            "2": {"content": "<|im_end|>", **token},
            "1": {"content": "<|im_start|>", **token},
        },
        "bos_token": {"__type": "AddedToken", "content": "<|im_start|>", **token},
        "eos_token": "<|im_end|>",
        "pad_token": "<pad>",
        "additional_special_tokens": ["<tool>", "<|im_end|>", "<think>"],
        "clean_up_tokenization_spaces": True,
    }
    ours = compare_dir(write_model_dir(tmp_path / "added", words, config, template_file=CHATML))
    assert ours.unk_token_id is None and ours.convert_tokens_to_ids("zebra") is None
    assert ours.pad_token_id == len(ours) - 2 and ours.convert_tokens_to_ids("<tool>") == len(ours) - 1
    assert ours.decode(ours.encode("don ' t , we ' re")) == "don't, we're"  # transformers' clean-up
    assert (
        ours.decode(ours.encode("don ' t , we ' re"), clean_up_tokenization_spaces=False)
        == "don ' t , we ' re"
    )


# -- a class that rebuilds the file's pipeline (Gemma's) ----------------------------
def gemma_dir(directory: Path, template_file: str | None = None) -> Path:
    """A directory as transformers' GemmaTokenizer writes it: SentencePiece-style BPE pieces, byte
    fallback, Gemma's named tokens (config.json says gemma3_text)."""
    from transformers import GemmaTokenizer

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    pieces = "▁ h e l o w r d he ll hell hello ▁hello ▁w or ▁wor".split()
    vocab = {token: i for i, token in enumerate([*specials, *(f"<0x{b:02X}>" for b in range(256)), *pieces])}
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("▁", "hello"), ("▁", "w"), ("o", "r")]
    merges.append(("▁w", "or"))
    tokenizer = GemmaTokenizer(vocab=vocab, merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tokenizer.save_pretrained(str(directory))
    (directory / "config.json").write_text(json.dumps({"model_type": "gemma3_text"}), encoding="utf-8")
    if template_file is not None:
        (directory / "chat_template.jinja").write_text(template_file, encoding="utf-8")
    return directory


@pytest.mark.parametrize("template", [None, CHATML])
def test_a_gemma_tokenizer_matches_transformers(tmp_path, template):
    """Gemma's class rebuilds tokenizer.json's pipeline around its vocabulary (our GGUF conversions
    write such a file); read without transformers, the same tokenizer."""
    ours = compare_dir(gemma_dir(tmp_path / "gemma", template))
    theirs = AutoTokenizer.from_pretrained(str(tmp_path / "gemma"))
    assert type(theirs).__name__ == "GemmaTokenizer"
    ids = ours("".join(TEXTS) + "<start_of_turn>user hello<end_of_turn>", add_special_tokens=False)[
        "input_ids"
    ]
    assert ours.convert_tokens_to_ids("<end_of_turn>") in ids
    assert_same_pieces_and_stream(ours, theirs, ids + list(range(len(ours))))


def test_a_gemma_file_with_another_pipeline_reads_as_the_class_rebuilds_it(tmp_path):
    """A tokenizer.json whose pre-tokenizer is not Gemma's: transformers' class replaces it with its
    own, and so does this (reading the file as it is would split text otherwise)."""
    directory = gemma_dir(tmp_path / "gemma")
    backend = Tokenizer.from_file(str(directory / "tokenizer.json"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(directory / "tokenizer.json"))
    assert (
        backend_state(compare_dir(directory))["pre_tokenizer"]
        != json.loads(backend.to_str())["pre_tokenizer"]
    )


def test_a_gemma_tokenizer_named_for_another_model_type_is_left_to_transformers(tmp_path):
    directory = gemma_dir(tmp_path / "gemma")
    (directory / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert ChatTokenizer.from_dir(directory) is None


# -- where only transformers can be sure ------------------------------------------
@pytest.fixture
def plain_dir(tmp_path) -> Path:
    config = {"tokenizer_class": "TokenizersBackend", "eos_token": "<|im_end|>", "unk_token": "<unk>"}
    return write_model_dir(tmp_path / "plain", word_tokenizer(), config, template_file=CHATML)


def edit_config(directory: Path, **changes) -> None:
    path = directory / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps({key: value for key, value in config.items() if value is not None}))


@pytest.mark.parametrize("model_type", sorted(PLAIN_MODEL_TYPES))
def test_the_plain_directory_loads(plain_dir, model_type):
    (plain_dir / "config.json").write_text(json.dumps({"model_type": model_type}))
    compare_dir(plain_dir)


def test_no_tokenizer_json(plain_dir):
    (plain_dir / "tokenizer.json").unlink()
    assert ChatTokenizer.from_dir(plain_dir) is None


def test_no_chat_template_is_a_base_model_and_another_can_be_set(plain_dir):
    """A model that ships no template (a base model, `--raw`) loads as transformers loads it, and
    `--chat-template` sets one on it."""
    (plain_dir / "chat_template.jinja").unlink()
    ours = compare_dir(plain_dir)
    ours.chat_template = CHATML
    theirs = AutoTokenizer.from_pretrained(str(plain_dir))
    theirs.chat_template = CHATML
    for prompt in (False, True):
        assert ours.apply_chat_template(CHATS[1], add_generation_prompt=prompt) == dict(
            theirs.apply_chat_template(CHATS[1], add_generation_prompt=prompt)
        )


def test_named_templates(plain_dir):
    (plain_dir / "chat_template.jinja").unlink()
    edit_config(
        plain_dir, chat_template=[{"name": "default", "template": CHATML}, {"name": "rag", "template": "x"}]
    )
    assert ChatTokenizer.from_dir(plain_dir) is None
    assert isinstance(AutoTokenizer.from_pretrained(str(plain_dir)).chat_template, dict)


def test_several_template_files(plain_dir):
    (plain_dir / "additional_chat_templates").mkdir()
    (plain_dir / "additional_chat_templates" / "tool_use.jinja").write_text(CHATML)
    assert ChatTokenizer.from_dir(plain_dir) is None


@pytest.mark.parametrize(
    "changes",
    [
        {"tokenizer_class": "GPT2Tokenizer"},
        {"tokenizer_class": "LlamaTokenizerFast"},
        {"tokenizer_class": None},
        {"auto_map": {"AutoTokenizer": ["x.Tok", None]}},
        {"image_token": "<image>"},  # a model-specific named token
        {"extra_special_tokens": {"image_token": "<image>"}},
        {"bos_token": {"content": "<|im_start|>"}},  # transformers 5 rejects a dict without __type
    ],
)
def test_configs_left_to_transformers(plain_dir, changes):
    edit_config(plain_dir, **changes)
    assert ChatTokenizer.from_dir(plain_dir) is None


@pytest.mark.parametrize("model_type", ["qwen2", "mistral"])
def test_model_types_with_their_own_tokenizer_class(plain_dir, model_type):
    """qwen2: AutoTokenizer loads Qwen2Tokenizer whatever the config names; mistral: it may take
    Mistral's own backend or patch the split."""
    (plain_dir / "config.json").write_text(json.dumps({"model_type": model_type}))
    assert ChatTokenizer.from_dir(plain_dir) is None


def test_padding_in_tokenizer_json(plain_dir):
    words = word_tokenizer()
    words.enable_padding(pad_id=0, pad_token="<unk>")
    words.save(str(plain_dir / "tokenizer.json"))
    assert ChatTokenizer.from_dir(plain_dir) is None


def test_unsupported_template_arguments_are_refused_not_passed_on(plain_dir):
    ours = ChatTokenizer.from_dir(plain_dir)
    with pytest.raises(NotImplementedError):
        ours.apply_chat_template(CHATS[0], continue_final_message=True)
    with pytest.raises(NotImplementedError):
        ours.apply_chat_template([CHATS[0], CHATS[1]])  # a batch
    with pytest.raises(ValueError):
        ours.apply_chat_template([])


def test_importing_it_does_not_import_transformers():
    script = "import sys, engine.chat_tokenizer; assert 'transformers' not in sys.modules"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-500:]


def qwen_dir(directory: Path, hub_like: bool = False) -> Path:
    """A directory as transformers' Qwen2Tokenizer writes it (byte-level BPE, NFC, Qwen's split);
    `hub_like`: tokenizer.json and its config as Qwen's published ones are written (other ByteLevel
    flags, no subword affixes, bos and unk null, every added token in the config), which the class
    replaces with its own pipeline."""
    from transformers import Qwen2Tokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    pieces = ["he", "ll", "hell", "hello", "Ġhello", "Ġw", "or", "Ġwor", "ld", "Ġworld"]
    vocab = {token: i for i, token in enumerate([*alphabet, *pieces, "<|endoftext|>"])}
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("Ġ", "hello"), ("Ġ", "w"), ("o", "r")]
    merges += [("Ġw", "or"), ("l", "d"), ("Ġwor", "ld")]
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.add_tokens([AddedToken("<think>", normalized=False), AddedToken("</think>", normalized=False)])
    tokenizer.save_pretrained(str(directory))
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen3"}), encoding="utf-8")
    (directory / "chat_template.jinja").write_text(CHATML, encoding="utf-8")
    if hub_like:
        state = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
        flags = {"add_prefix_space": False, "trim_offsets": False, "use_regex": False}
        state["decoder"] = {"type": "ByteLevel", **flags}
        state["pre_tokenizer"]["pretokenizers"][1] = {"type": "ByteLevel", **flags}
        state["model"].update(continuing_subword_prefix=None, end_of_word_suffix=None)
        (directory / "tokenizer.json").write_text(json.dumps(state), encoding="utf-8")
        added = {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in state["added_tokens"]}
        edit_config(
            directory,
            add_prefix_space=False,
            added_tokens_decoder=added,
            bos_token=None,
            unk_token=None,
            eos_token="<|im_end|>",
            pad_token="<|endoftext|>",
            errors="replace",
        )
    return directory


@pytest.mark.parametrize("hub_like", [False, True])
def test_a_qwen_tokenizer_matches_transformers(tmp_path, hub_like):
    """Qwen2's class (Qwen2 and Qwen3) rebuilds the file's pipeline and adds its special tokens once
    more: set on the file's backend here, it ends as transformers' does, whatever the file held."""
    ours = compare_dir(qwen_dir(tmp_path / "qwen", hub_like))
    theirs = AutoTokenizer.from_pretrained(str(tmp_path / "qwen"))
    assert type(theirs).__name__ == "Qwen2Tokenizer"
    ids = ours("".join(TEXTS) + "<|im_start|>user hello<think>x</think><|im_end|>", add_special_tokens=False)
    assert ours.convert_tokens_to_ids("<think>") in ids["input_ids"]
    assert_same_pieces_and_stream(ours, theirs, ids["input_ids"] + list(range(len(ours))))


def test_a_qwen_file_with_normalized_added_tokens_under_another_normalizer_is_left_to_transformers(tmp_path):
    """An added token matched after normalizing was found with the file's normalizer: where the
    class sets another, left to transformers rather than guessed; under the same one, read."""
    directory = qwen_dir(tmp_path / "qwen")
    backend = Tokenizer.from_file(str(directory / "tokenizer.json"))
    backend.add_tokens([AddedToken("hello world", normalized=True)])
    backend.save(str(directory / "tokenizer.json"))
    compare_dir(directory)
    backend.normalizer = normalizers.NFKC()
    backend.save(str(directory / "tokenizer.json"))
    assert ChatTokenizer.from_dir(directory) is None
