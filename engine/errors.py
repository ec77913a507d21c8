"""Errors as one line: every failure the user sees is a single line that says what went wrong."""

from __future__ import annotations


def one_line(error: BaseException, limit: int = 300, named: bool = False) -> str:
    """The first line of `error`'s message (its type's name when it has none), at most `limit`
    characters; `named` puts the type's name in front, for errors nobody anticipated."""
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else ""
    if named or not text:
        text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return text[:limit]
