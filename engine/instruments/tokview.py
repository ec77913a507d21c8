"""Tokenizer view: text split into the pieces the model sees, with what each costs.

Everything here is plain tokenizer work (no forward pass), cheap enough for the UI thread.
A piece's `source` says where its K/V came from this turn: the cache ("cached"), this
turn's prefill ("prefilled"), or the answer ("generated"). `spans` cut the templated
conversation at message boundaries, found as the longest common prefix between the ids and
the template of the conversation up to each message (robust to BPE merges at a boundary).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Callable, Literal, Protocol, Sequence

from engine.detok import PieceNamer
from engine.kvcache import common_prefix

if TYPE_CHECKING:
    from engine.instruments.view import SessionView

Source = Literal["cached", "prefilled", "generated", "text"]
TemplateIds = Callable[[list[dict]], list[int]]
"""A conversation (OpenAI-style messages) -> the ids of its rendered chat template, no generation prompt."""


class Namer(Protocol):
    """Ids to readable pieces and bytes: `PieceNamer` here, or one a server's tokenizer taught."""

    def piece(self, token_id: int) -> str: ...

    def token_bytes(self, token_id: int) -> bytes | None: ...


@dataclass(frozen=True)
class Piece:
    index: int
    id: int
    text: str
    """Readable piece: real characters where its bytes form them, `<0xEC>` for a stray byte."""
    bytes: bytes | None
    """None for a special token (`<|im_start|>`); these are part of the template, not the text."""
    source: Source

    @property
    def special(self) -> bool:
        return self.bytes is None


@dataclass(frozen=True)
class TextCost:
    """What a piece of text costs in tokens."""

    text: str
    characters: int
    utf8_bytes: int
    pieces: tuple[Piece, ...]

    @property
    def tokens(self) -> int:
        return len(self.pieces)

    @property
    def chars_per_token(self) -> float:
        return self.characters / self.tokens if self.tokens else 0.0


@dataclass(frozen=True)
class Span:
    """A stretch of the templated conversation that belongs to one message."""

    role: str
    start: int
    end: int
    message: int | None
    """Index in `session.messages`; None for the system prompt and the answer being written."""
    default: bool = False
    """The chat template's own system prompt, put in when the conversation has none (SmolLM2's
    "You are a helpful AI assistant named SmolLM...")."""

    @property
    def tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class TokenizerView:
    """A turn as the model sees it: the templated prompt, then the answer."""

    pieces: tuple[Piece, ...]
    reused: int
    """Prompt tokens whose K/V came from the cache; the prefill computed the rest."""
    prompt_tokens: int
    spans: tuple[Span, ...]
    template: str
    """The rendered chat template, special tokens included (the whole turn, answer too)."""
    template_cached: str
    """The part of `template` that came from the cache (decoded from the cached ids)."""

    @property
    def prefilled(self) -> int:
        return self.prompt_tokens - self.reused

    @property
    def generated(self) -> int:
        return len(self.pieces) - self.prompt_tokens

    def span_cost(self, span: Span) -> TextCost:
        """The cost of one message's text: its non-special pieces and their characters."""
        inner = tuple(p for p in self.pieces[span.start : span.end] if not p.special)
        text = b"".join(p.bytes or b"" for p in inner).decode("utf-8", errors="replace")
        return TextCost(text, len(text), len(text.encode("utf-8")), inner)


def _pieces(namer: Namer, ids: Sequence[int], sources: Sequence[Source], start: int = 0) -> tuple[Piece, ...]:
    return tuple(
        Piece(start + i, token, namer.piece(token), namer.token_bytes(token), source)
        for i, (token, source) in enumerate(zip(ids, sources))
    )


def text_cost(tokenizer, text: str, namer: PieceNamer | None = None) -> TextCost:
    """Tokenize bare text (no template, no special tokens) and count what it costs.

    In SmolLM2, "How does inference work?" is 5 tokens; "추론은 어떻게 작동하나요?" is 32.
    """
    namer = namer or PieceNamer(tokenizer)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return TextCost(text, len(text), len(text.encode("utf-8")), _pieces(namer, ids, ["text"] * len(ids)))


def decode(tokenizer, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def tokenizer_view(
    session: SessionView,
    prompt_ids: Sequence[int],
    reused: int,
    answer_ids: Sequence[int] = (),
    namer: Namer | None = None,
    detokenize: Callable[[Sequence[int]], str] | None = None,
    template_ids: TemplateIds | None = None,
) -> TokenizerView:
    """The view of one turn, from its `PromptTokens` event (ids, reused) and the answer's ids.

    The local tokenizer by default; a model on a server passes its own namer, detokenizer
    and template (engine/remote/tokenizer.py asks the server for each)."""
    ids = [*prompt_ids, *answer_ids]
    sources: list[Source] = ["cached"] * reused + ["prefilled"] * (len(prompt_ids) - reused)
    sources += ["generated"] * len(answer_ids)
    detokenize = detokenize or partial(decode, session.tokenizer)
    return TokenizerView(
        pieces=_pieces(namer or session.namer, ids, sources),
        reused=reused,
        prompt_tokens=len(prompt_ids),
        spans=message_spans(session, ids, template_ids),
        template=detokenize(ids),
        template_cached=detokenize(list(prompt_ids[:reused])) if reused else "",
    )


def _template_ids(
    session: SessionView, chat: list[dict], kept: dict[int, list[int]] | None = None
) -> list[int]:
    """`chat` as the session templates it: each answer in `kept` (chat index -> its sampled ids) as
    it was sampled, as the prompt holds it (engine/prompt_format.py `joined`)."""
    kept = {i: ids for i, ids in (kept or {}).items() if i < len(chat)}
    return session.prompt_format.joined(session.tokenizer, chat, generation_prompt=False, kept=kept).ids


def default_system_tokens(session: SessionView, first: dict, template_ids: TemplateIds | None = None) -> int:
    """How many tokens the chat template puts before `first` on its own (a default system prompt); 0 if none.

    The first message's own tokens are found as what follows a system message in the template
    of [system, first]; whatever the template of [first] alone has before them, it added itself.
    """
    template_ids = template_ids or partial(_template_ids, session)
    probe = {"role": "system", "content": "x"}
    try:
        alone = template_ids([first])
        system = template_ids([probe])
        both = template_ids([probe, first])
    except Exception:  # a template without a system role: nothing to find
        return 0
    return _added_before(alone, system, both)


def _added_before(alone: list[int], system: list[int], both: list[int]) -> int:
    """How many tokens the template of [first] (`alone`) has before the first message's own: what
    the template of [system, first] (`both`) has after that of [system]; 0 where that is unclear."""
    if both[: len(system)] != system:
        return 0
    own = both[len(system) :]
    if not own or len(alone) <= len(own) or alone[-len(own) :] != own:
        return 0
    return len(alone) - len(own)


def message_spans(
    session: SessionView, ids: Sequence[int], template_ids: TemplateIds | None = None
) -> tuple[Span, ...]:
    """Cut `ids` (a templated conversation, maybe with an answer) into one span per message.

    The boundary after each message is the common prefix of `ids` with the template of the
    conversation up to that message; what is left after the last boundary is the answer
    being written (the generation prompt and its tokens), role "assistant", message None.
    """
    ids = list(ids)
    chat: list[tuple[str, int | None, dict]] = []
    if session.system_prompt:
        chat.append(("system", None, {"role": "system", "content": session.system_prompt}))
    for i, m in enumerate(session.messages):
        chat.append((m.role, i, {"role": m.role, "content": m.content}))
    plain = template_ids or partial(_template_ids, session)
    if template_ids is None:  # each answer as it was sampled, as the prompt holds it
        first = len(chat) - len(session.messages)
        sampled = ((first + i, session.sampled_ids(m)) for i, m in enumerate(session.messages))
        template_ids = partial(_template_ids, session, kept={i: ids for i, ids in sampled if ids})
    spans: list[Span] = []
    start = 0
    first_is_system = chat and chat[0][0] == "system"
    default = default_system_tokens(session, chat[0][2], plain) if chat and not first_is_system else 0
    if default and len(ids) > default:
        spans.append(Span("system", 0, default, None, default=True))
        start = default
    for k, (role, message, _) in enumerate(chat):
        end = common_prefix(template_ids([c for _, _, c in chat[: k + 1]]), ids)
        if end <= start:
            break  # the ids stop before this message (they are from an earlier turn)
        spans.append(Span(role, start, end, message))
        start = end
    if start < len(ids):
        spans.append(Span("assistant", start, len(ids), None))
    return tuple(spans)
