"""Streaming detokenization is UTF-8 correct, and token pieces are readable."""

import random

import pytest

from engine.detok import REPLACEMENT, PieceNamer, StreamingDetokenizer, readable_bytes

TEXTS = [
    "추론은 어떻게 작동하나요?",
    "김치는 한국의 전통 음식입니다.",
    "日本語のテキストと中文文本",
    "robots 🤖🦀 and a family 👨‍👩‍👧 with flags 🇫🇷",
    "x² + y² = z², ∑ᵢ aᵢ ≤ ∫ f(x) dx, ∀ε>0 ∃δ",
    "café naïve Ωmega — “quotes” … ok",
    "mixed: The capital of France is Paris. 파리는 프랑스의 수도입니다 🇫🇷!",
]


def decode(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def stream(tokenizer, ids) -> list[str]:
    detok = StreamingDetokenizer(tokenizer)
    segments = [detok.add(i) for i in ids]
    segments.append(detok.flush())
    return segments


def split_characters(namer: PieceNamer, ids) -> int:
    """How many tokens carry a byte that is not a whole character on its own."""
    return sum("<0x" in namer.piece(i) for i in ids)


def check_stream(tokenizer, text: str) -> None:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    segments = stream(tokenizer, ids)
    assert "".join(segments) == decode(tokenizer, ids) == text
    for segment in segments:
        assert REPLACEMENT not in segment, (text, segments)


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_loaded):
    return tiny_loaded.tokenizer


@pytest.fixture(scope="module")
def smol_tokenizer(smollm2):
    return smollm2.tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_tiny_stream_joins_to_decode_without_replacement_chars(tiny_tokenizer, text):
    check_stream(tiny_tokenizer, text)


@pytest.mark.real_model
@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_stream_joins_to_decode_without_replacement_chars(smol_tokenizer, text):
    check_stream(smol_tokenizer, text)


@pytest.mark.real_model
def test_smollm2_splits_korean_over_byte_tokens(smol_tokenizer):
    """The streams above are a real test: SmolLM2 spreads Korean and emoji over several tokens."""
    namer = PieceNamer(smol_tokenizer)
    for text in (TEXTS[0], TEXTS[3]):
        ids = smol_tokenizer(text, add_special_tokens=False)["input_ids"]
        assert split_characters(namer, ids) >= 3


def test_tiny_splits_characters_over_byte_tokens(tiny_tokenizer):
    namer = PieceNamer(tiny_tokenizer)
    ids = tiny_tokenizer(TEXTS[2], add_special_tokens=False)["input_ids"]  # CJK outside its corpus
    assert split_characters(namer, ids) >= 3


def test_held_back_text_appears_once_the_character_completes(tiny_tokenizer):
    ids = tiny_tokenizer("日", add_special_tokens=False)["input_ids"]
    assert len(ids) == 3  # three single-byte tokens
    detok = StreamingDetokenizer(tiny_tokenizer)
    assert [detok.add(i) for i in ids] == ["", "", "日"]
    assert detok.flush() == ""


def test_flush_returns_an_incomplete_tail_as_decode_does(tiny_tokenizer):
    ids = tiny_tokenizer("a日", add_special_tokens=False)["input_ids"][:-1]  # cut inside 日
    segments = stream(tiny_tokenizer, ids)
    assert "".join(segments) == decode(tiny_tokenizer, ids)
    assert segments[-1].endswith(REPLACEMENT)


def test_random_ids_join_to_decode(tiny_tokenizer):
    """Any id sequence, invalid UTF-8 and special tokens included, streams to exactly decode()."""
    rng = random.Random(0)
    vocab = len(tiny_tokenizer)
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        assert "".join(stream(tiny_tokenizer, ids)) == decode(tiny_tokenizer, ids), ids


@pytest.mark.real_model
def test_smollm2_random_ids_join_to_decode(smol_tokenizer):
    rng = random.Random(1)
    vocab = len(smol_tokenizer)
    byte_tokens = [i for i in range(300) if "<0x" in PieceNamer(smol_tokenizer).piece(i)]
    for _ in range(100):
        ids = [rng.choice(byte_tokens) if rng.random() < 0.5 else rng.randrange(vocab) for _ in range(20)]
        assert "".join(stream(smol_tokenizer, ids)) == decode(smol_tokenizer, ids), ids


@pytest.mark.parametrize(
    "data, shown",
    [
        (b"\xec", "<0xEC>"),
        (b"\xec\x9a", "<0xEC><0x9A>"),
        ("가".encode(), "가"),
        ("가".encode() + b"\xec", "가<0xEC>"),
        (b"\x80" + "é".encode(), "<0x80>é"),
        (b" \xf0\x9f", " <0xF0><0x9F>"),
        ("🤖".encode(), "🤖"),
        (b"plain", "plain"),
        (b"", ""),
    ],
)
def test_readable_bytes(data, shown):
    assert readable_bytes(data) == shown


def test_piece_names_on_the_tiny_tokenizer(tiny_tokenizer):
    namer = PieceNamer(tiny_tokenizer)
    ids = tiny_tokenizer("日", add_special_tokens=False)["input_ids"]
    assert namer.pieces(ids) == ("<0xE6>", "<0x97>", "<0xA5>")
    space_the = tiny_tokenizer(" capital", add_special_tokens=False)["input_ids"]
    assert "".join(namer.pieces(space_the)) == " capital"  # not the stand-in 'Ġcapital'
    assert namer.piece(tiny_tokenizer.eos_token_id) == "<|im_end|>"
    assert namer.token_bytes(tiny_tokenizer.eos_token_id) is None


@pytest.mark.real_model
def test_piece_names_on_smollm2(smol_tokenizer):
    namer = PieceNamer(smol_tokenizer)
    ids = smol_tokenizer("김치", add_special_tokens=False)["input_ids"]
    pieces = namer.pieces(ids)
    assert pieces[0] == "<0xEA>"  # raw byte shown readably, not as mojibake like 'ê'
    assert b"".join(namer.token_bytes(i) for i in ids) == "김치".encode()
    assert set("".join(pieces)) <= set("<0x>0123456789ABCDEF김치")  # no stand-ins such as 'ê' or 'Ġ'
    hello = smol_tokenizer(" Paris", add_special_tokens=False)["input_ids"]
    assert namer.pieces(hello) == (" Paris",)
