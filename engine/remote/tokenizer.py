"""The tokenizer view (F5) for a model on a server: the server's own tokenizer, asked over HTTP.

llama.cpp: POST /tokenize {"content", "with_pieces": true} answers {"tokens": [{"id", "piece"}]}
(a piece as text, or as its byte values where it is not valid UTF-8); POST /detokenize
{"tokens"} answers {"content"}; POST /apply-template renders the chat template. A template
token (`<|im_start|>`) is told apart from text by tokenizing its text again with
"parse_special": false: as plain text it splits into other ids.
vLLM: POST /tokenize {"model", "prompt" or "messages", "return_token_strs": true} answers
{"tokens", "token_strs"}; POST /detokenize {"model", "tokens"} answers {"prompt"}
(vllm/entrypoints/serve/tokenize/protocol.py). Its token strings cannot tell a template token
from text, so none is marked.
Other servers (SGLang, Ollama, a plain OpenAI API) have no tokenizer endpoint: `missing` says so.

Every call here goes over the network: the app makes them off the UI thread.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from engine.detok import _byte_decoder, readable_bytes
from engine.instruments.tokview import Piece, TextCost, TokenizerView, tokenizer_view
from engine.remote.chunks import whole
from engine.remote.client import RemoteClient, RemoteError
from engine.remote.dialects import Dialect
from engine.remote.prompt import piece_bytes
from engine.remote.token_bytes import SeenTokens

if TYPE_CHECKING:
    from engine.instruments.trace import AnswerTrace
    from engine.instruments.view import SessionView

MAYBE_SPECIAL = re.compile(r"^<.+>$|^\[.+\]$")
"""Pieces worth asking about: template tokens look like `<|im_end|>`, `</s>` or `[INST]`."""
PROBE = {"role": "user", "content": "x"}
"""A message rendered after a conversation only to close its last message."""


@dataclass
class ServerNamer:
    """Ids to bytes as the server's tokenizer told them, then as its stream showed them."""

    seen: SeenTokens
    told: dict[int, bytes] = field(default_factory=dict)
    special: set[int] = field(default_factory=set)

    def token_bytes(self, token_id: int) -> bytes | None:
        """None for a template token (as `PieceNamer` does) and for an id never told."""
        if token_id in self.special:
            return None
        data = self.told.get(token_id)
        return data if data is not None else self.seen.token_bytes(token_id)

    def piece(self, token_id: int) -> str:
        data = self.told.get(token_id)
        if data is None:
            data = self.seen.token_bytes(token_id)
        return readable_bytes(data) if data is not None else f"<{token_id}>"


@dataclass(frozen=True)
class ServerTurnView:
    view: TokenizerView
    specials: tuple[str, ...]
    """The template tokens' texts, for highlighting them in the rendered template."""
    notes: tuple[str, ...]
    """What this server's tokenizer could not tell."""


class ServerTokenizer:
    """The tokenizer of the model on this server, where the server lends it."""

    def __init__(self, client: RemoteClient, dialect: Dialect, model: str, seen: SeenTokens):
        self.client = client
        self.dialect = dialect
        self.model = model
        self.seen = seen
        self._probe: list[int] | None = None

    @property
    def available(self) -> bool:
        return self.dialect.tokenize in ("llama.cpp", "vllm")

    @property
    def missing(self) -> str:
        """Why the view is empty on this server (empty where it is not)."""
        if self.available:
            return ""
        return (
            f"This server ({self.dialect.kind}) has no tokenize endpoint, so its tokenizer cannot be asked: "
            "the tokenizer view needs llama.cpp's or vLLM's /tokenize. The token inspector (F2) shows "
            "the pieces the server streamed."
        )

    # -- bare text ----------------------------------------------------------------------------
    def pieces(self, text: str, parse_special: bool = True) -> list[tuple[int, bytes]]:
        """Bare text (no template, no BOS) as (id, bytes) pairs, as the server's tokenizer splits it."""
        if not text:
            return []
        if self.dialect.tokenize == "llama.cpp":
            body = {
                "content": text,
                "add_special": False,
                "parse_special": parse_special,
                "with_pieces": True,
            }
            return _llama_pieces(self.client.post_json("/tokenize", body))
        if self.dialect.tokenize == "vllm":
            body = {
                "model": self.model,
                "prompt": text,
                "add_special_tokens": False,
                "return_token_strs": True,
            }
            return _vllm_pieces(self.client.post_json("/tokenize", body))
        raise RemoteError(self.missing)

    def text_cost(self, text: str) -> TextCost:
        """What `text` costs in this model's tokens (the left and right boxes of F5)."""
        found = self.pieces(text)
        pieces = tuple(
            Piece(i, token, readable_bytes(data), data, "text") for i, (token, data) in enumerate(found)
        )
        return TextCost(text, len(text), len(text.encode("utf-8")), pieces)

    def detokenize(self, ids: Sequence[int]) -> str:
        """The ids as text, template tokens written out (the rendered template)."""
        if not ids:
            return ""
        if self.dialect.tokenize == "llama.cpp":
            answer = self.client.post_json("/detokenize", {"tokens": list(ids)})
            key = "content"
        else:
            answer = self.client.post_json("/detokenize", {"model": self.model, "tokens": list(ids)})
            key = "prompt"
        text = answer.get(key) if isinstance(answer, dict) else None
        if not isinstance(text, str):
            raise RemoteError(f"{self.client.shown}/detokenize answered without {key!r}")
        return text

    def template_ids(self, chat: list[dict]) -> list[int]:
        """The ids of `chat` in the server's chat template, without the generation prompt.

        llama.cpp leaves a final assistant message open (a prefill for the model to continue),
        where the conversation closed it: it is closed here by rendering one more message after
        it and taking that message's own tokens off again."""
        if not chat or chat[-1].get("role") != "assistant" or self.dialect.tokenize != "llama.cpp":
            return self._render_ids(chat)
        closed = self._render_ids([*chat, PROBE])
        own = self._probe_ids()
        if own and closed[-len(own) :] == own:
            return closed[: -len(own)]
        return self._render_ids(chat)

    def _probe_ids(self) -> list[int]:
        """PROBE's own tokens: what it adds after a system message (no default system prompt then)."""
        if self._probe is None:
            system = self._render_ids([{"role": "system", "content": "x"}])
            both = self._render_ids([{"role": "system", "content": "x"}, PROBE])
            self._probe = both[len(system) :] if both[: len(system)] == system else []
        return self._probe

    def _render_ids(self, chat: list[dict]) -> list[int]:
        if self.dialect.tokenize == "llama.cpp":
            body = {"messages": chat, "add_generation_prompt": False}
            rendered = self.client.post_json("/apply-template", body)
            text = rendered.get("prompt") if isinstance(rendered, dict) else None
            if not isinstance(text, str):
                raise RemoteError(f"{self.client.shown}/apply-template answered without a prompt")
            body = {"content": text, "add_special": True, "parse_special": True}
            return [_id(t) for t in _list(self.client.post_json("/tokenize", body), "tokens")]
        body = {"model": self.model, "messages": chat, "add_generation_prompt": False}
        return [_id(t) for t in _list(self.client.post_json("/tokenize", body), "tokens")]

    # -- one turn -----------------------------------------------------------------------------
    def turn_view(self, session: SessionView, trace: AnswerTrace) -> ServerTurnView:
        """The turn as the model saw it: the prompt's ids (asked of the server when it was sent),
        the answer's ids (as streamed), cut by message, with the rendered template."""
        answer_ids = [step.id for step in list(trace.steps)]
        if any(i is None for i in answer_ids) or not trace.prompt_ids:
            raise RemoteError(f"this server ({self.dialect.kind}) sent no token ids for this turn")
        ids = [*trace.prompt_ids, *answer_ids]
        namer = ServerNamer(self.seen)
        template = self.detokenize(ids)
        # The template's text, tokenized again, names the prompt's ids (the answer's came streamed).
        for token, data in self.pieces(template):
            namer.told.setdefault(token, data)
        notes: list[str] = []
        specials = self._specials(namer) if self.dialect.tokenize == "llama.cpp" else ()
        if self.dialect.tokenize == "vllm":
            notes.append(
                "template tokens are not marked: vLLM's /tokenize does not say which ids are special"
            )
        namer.special.update(token for token, _ in specials)
        view = tokenizer_view(
            session,
            trace.prompt_ids,
            trace.reused or 0,
            answer_ids,
            namer=namer,
            detokenize=lambda part: template if len(part) == len(ids) else self.detokenize(part),
            template_ids=self.template_ids,
        )
        return ServerTurnView(view, tuple(text for _, text in specials), tuple(notes))

    def _specials(self, namer: ServerNamer) -> list[tuple[int, str]]:
        """The template tokens among the told pieces: those whose text, read as plain text, is other ids."""
        found = []
        for token, data in list(namer.told.items()):
            text = data.decode("utf-8", errors="replace")
            if MAYBE_SPECIAL.match(text) and [t for t, _ in self.pieces(text, parse_special=False)] != [
                token
            ]:
                found.append((token, text))
        return found


def _list(answer: object, key: str) -> list:
    value = answer.get(key) if isinstance(answer, dict) else None
    if not isinstance(value, list):
        raise RemoteError(f"the server's /tokenize answered without {key!r}")
    return value


def _llama_pieces(answer: object) -> list[tuple[int, bytes]]:
    """llama.cpp's [{"id", "piece"}]: a piece is text, or its byte values where it is not UTF-8."""
    out = []
    for token in _list(answer, "tokens"):
        if not isinstance(token, dict) or "piece" not in token:
            raise RemoteError("the server's /tokenize sent no pieces (a llama.cpp too old for with_pieces?)")
        out.append((_id(token.get("id")), piece_bytes(token["piece"])))
    return out


def _id(value: object) -> int:
    """A token id as the server sent it; one line where it sent something else."""
    found = whole(value)
    if found is None:
        raise RemoteError(f"the server's /tokenize sent {str(value)[:40]!r} where a token id belongs")
    return found


def _vllm_pieces(answer: object) -> list[tuple[int, bytes]]:
    """vLLM's ids with token strings: byte-level ones ('Ġthe') back to bytes, others as UTF-8."""
    ids = _list(answer, "tokens")
    strs = answer.get("token_strs") if isinstance(answer, dict) else None
    if not isinstance(strs, list) or len(strs) != len(ids):
        raise RemoteError("the server's /tokenize sent no token strings (return_token_strs)")
    table = _byte_decoder()
    out = []
    for token, text in zip(ids, strs):
        text = str(text)
        byte_level = text and all(ch in table for ch in text)
        data = bytes(table[ch] for ch in text) if byte_level else text.encode("utf-8", "replace")
        out.append((_id(token), data))
    return out
