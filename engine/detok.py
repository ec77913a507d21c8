"""Streaming detokenization and readable token pieces.

Byte-level BPE splits one UTF-8 character over several tokens. The streamer holds text
back until the bytes complete a character, so the stream never shows U+FFFD for a split
character, and the joined segments equal `tokenizer.decode(all ids)`.
"""

from __future__ import annotations

from functools import lru_cache

REPLACEMENT = "\ufffd"


class StreamingDetokenizer:
    """Incremental decode with a sliding window (prefix_offset, read_offset), as vLLM does."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        """Feed one id; return the newly completed text (may be empty)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.ids[self.prefix_offset :])
        if len(text) > len(prefix) and not text.endswith(REPLACEMENT):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return text[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Whatever is held back at the end (an incomplete character decodes as U+FFFD)."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix) :]


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-to-unicode table, inverted: the printable stand-ins back to bytes."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class PieceNamer:
    """Readable text for a token id: real characters where the bytes form them, `<0xEC>` otherwise."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.special = set(tokenizer.all_special_ids)
        self.byte_level = _is_byte_level(tokenizer)
        self._cache: dict[int, str] = {}

    def piece(self, token_id: int) -> str:
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._name(token_id)
        return cached

    def pieces(self, ids) -> tuple[str, ...]:
        return tuple(self.piece(i) for i in ids)

    def token_bytes(self, token_id: int) -> bytes | None:
        """The raw bytes a token stands for, or None for special tokens."""
        if token_id in self.special:
            return None
        raw = self.tokenizer.convert_ids_to_tokens(token_id)
        if raw is None:
            return b""
        table = _byte_decoder()
        if self.byte_level and all(ch in table for ch in raw):
            return bytes(table[ch] for ch in raw)
        if raw.startswith("<0x") and raw.endswith(">") and len(raw) == 6:
            return bytes([int(raw[3:5], 16)])
        return raw.replace("\u2581", " ").encode("utf-8")

    def _name(self, token_id: int) -> str:
        raw = self.tokenizer.convert_ids_to_tokens(token_id)
        data = self.token_bytes(token_id)
        if data is None:
            return raw or f"<{token_id}>"
        return readable_bytes(data)


def _is_byte_level(tokenizer) -> bool:
    """True for GPT-2-style tokenizers whose pieces are bytes written as printable stand-ins."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and "ByteLevel" in repr(decoder)


def readable_bytes(data: bytes) -> str:
    """Decode what is valid UTF-8 and show each stray byte as `<0xNN>`."""
    out: list[str] = []
    i = 0
    while i < len(data):
        width = _char_width(data, i)
        if width:
            out.append(data[i : i + width].decode("utf-8"))
            i += width
        else:
            out.append(f"<0x{data[i]:02X}>")
            i += 1
    return "".join(out)


def _char_width(data: bytes, i: int) -> int:
    """The bytes of the one valid UTF-8 character that starts at `data[i]`; 0 if none does."""
    for width in (4, 3, 2, 1):
        try:
            text = data[i : i + width].decode("utf-8")
        except UnicodeDecodeError:
            continue
        if len(text) == 1:
            return width
    return 0
