"""Checks on text from outside (argv, config.json, a paste) before a tokenizer or the store sees it.

Python turns bytes in argv that are not UTF-8 into lone surrogates ("surrogate escapes"), and
a JSON file can spell them too; no tokenizer or database can take them.
"""

from __future__ import annotations


def utf8_problem(text: str, what: str) -> str | None:
    """Why `text` (called `what` in the message) is not valid UTF-8, or None if it is."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start : e.end]
        escapes = all(0xDC80 <= ord(c) <= 0xDCFF for c in bad)
        noun = ("byte" if escapes else "character") + ("s" if len(bad) > 1 else "")
        shown = " ".join(_shown(c) for c in bad)
        return (
            f"{what} is not valid UTF-8 ({noun} {shown} at character {e.start}); "
            "fix the text or the terminal's encoding"
        )
    return None


def _shown(char: str) -> str:
    """A surrogate escape as the byte it stands for (0xFF); any other lone surrogate as U+D800."""
    code = ord(char)
    return f"0x{code - 0xDC00:02X}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:04X}"
