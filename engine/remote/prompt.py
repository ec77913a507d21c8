"""The conversation as token ids, asked of the server itself, so the token panel shows the
prompt exactly as the model sees it (its own chat template, its own tokenizer).

llama.cpp: /apply-template renders the template, /tokenize returns ids with pieces.
vLLM: /tokenize takes the messages and returns ids with their token strings.
Other servers cannot say; the panel then shows the answer's tokens only.
"""

from __future__ import annotations

from typing import Any

from engine.detok import _byte_decoder, readable_bytes
from engine.remote.chunks import whole
from engine.remote.client import RemoteClient
from engine.remote.turn import Prompt

UNKNOWN = Prompt((), ())


def tokenize(client: RemoteClient, how: str | None, model: str, messages: list[dict[str, str]]) -> Prompt:
    """The prompt's ids and readable pieces, or UNKNOWN when the server cannot tell."""
    if how == "llama.cpp":
        return _llama_cpp(client, messages)
    if how == "vllm":
        return _vllm(client, model, messages)
    return UNKNOWN


def _llama_cpp(client: RemoteClient, messages: list[dict[str, str]]) -> Prompt:
    rendered = client.probe_json("/apply-template", "POST", {"messages": messages})
    text = rendered.get("prompt") if isinstance(rendered, dict) else None
    if not isinstance(text, str):
        return UNKNOWN
    body = {"content": text, "add_special": True, "parse_special": True, "with_pieces": True}
    tokens = (client.probe_json("/tokenize", "POST", body) or {}).get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, dict) for t in tokens):
        return UNKNOWN
    ids = tuple(whole(t.get("id")) for t in tokens)
    if None in ids:
        return UNKNOWN
    return Prompt(ids, tuple(_piece(t.get("piece")) for t in tokens))


def _vllm(client: RemoteClient, model: str, messages: list[dict[str, str]]) -> Prompt:
    body = {"model": model, "messages": messages, "add_generation_prompt": True, "return_token_strs": True}
    answer = client.probe_json("/tokenize", "POST", body) or {}
    ids, strs = answer.get("tokens"), answer.get("token_strs")
    ids = tuple(whole(i) for i in ids) if isinstance(ids, list) else (None,)
    if None in ids:
        return UNKNOWN
    if not isinstance(strs, list) or len(strs) != len(ids):
        strs = [""] * len(ids)
    return Prompt(ids, tuple(_byte_level(str(s)) for s in strs))


def _piece(raw: Any) -> str:
    return readable_bytes(piece_bytes(raw)) if isinstance(raw, list) else str(raw or "")


def piece_bytes(raw: Any) -> bytes:
    """llama.cpp sends a piece as text, or as a list of byte values when it is not valid UTF-8."""
    if isinstance(raw, list):
        return bytes(b for b in raw if isinstance(b, int) and 0 <= b < 256)
    return str(raw or "").encode("utf-8", "replace")


def _byte_level(token: str) -> str:
    """A GPT-2 style token string ('Ġthe') as readable text (' the'); others as they are."""
    table = _byte_decoder()
    if token and all(ch in table for ch in token):
        return readable_bytes(bytes(table[ch] for ch in token))
    return token
