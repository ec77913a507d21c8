"""Tokenizer view: a turn as the model sees it, and what a text costs in tokens.

Plain tokenizer work (no forward pass), done on the UI thread: the pieces of the templated
prompt and the answer with their IDs and where their K/V came from (cache, prefill,
generated), characters per token per message, the rendered chat template with its special
tokens and the cached/new boundary, and two inputs whose token counts sit side by side.

With --server the tokenizer is the server's (engine/remote/tokenizer.py): each reading is an
HTTP request, made in a thread worker whose result comes back as a message.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.message import Message
from textual.widgets import Input, Static

from engine.events import Event, Forked, TurnFinished
from engine.instruments.tokview import Piece, Span, TextCost, TokenizerView, text_cost, tokenizer_view
from tui.fmt import count, subscript, visible_controls, visible_piece
from tui.instruments import AnswerRef, Instruments, answers
from tui.screens.instrument import InstrumentScreen

SOURCE_STYLES = {
    "cached": ("$text-muted on $panel", "$text 70% on $panel-lighten-1"),
    "prefilled": ("$text-warning on $warning-muted", "$text-warning on $warning-muted 60%"),
    "generated": ("$text-success on $success-muted", "$text-success on $success-muted 60%"),
    "text": ("$text-primary on $primary-muted", "$text-primary on $primary-muted 60%"),
}
"""Two shades per source, alternating, so neighbouring pieces stay apart."""
SPECIAL = "bold $text-accent"
BOUNDARY = ("▌cache│new▐", "bold $background on $accent")
EXAMPLES = ("How does inference work?", "추론은 어떻게 작동하나요?")


def piece_chips(pieces: tuple[Piece, ...], boundary: int | None = None) -> Content:
    """Pieces as `text₁₂₃` chips, coloured by source; the boundary marker before piece `boundary`."""
    parts: list = []
    for n, p in enumerate(pieces):
        if n == boundary:
            parts += [BOUNDARY, " "]
        shade = SOURCE_STYLES[p.source][n % 2]
        parts += [
            (visible_piece(p.text), SPECIAL if p.special else shade),
            (subscript(p.id), "$text-muted"),
            " ",
        ]
    return Content.assemble(*parts)


def legend() -> Content:
    return Content.assemble(
        (" cached ", SOURCE_STYLES["cached"][0]),
        " K/V from the cache  ",
        (" prefilled ", SOURCE_STYLES["prefilled"][0]),
        " computed this turn  ",
        (" generated ", SOURCE_STYLES["generated"][0]),
        " the answer  ",
        ("<|special|>", SPECIAL),
        " template tokens  ",
        BOUNDARY,
        " where the cache ends",
    )


def template_content(view: TokenizerView, specials: list[str]) -> Content:
    """The rendered template, special tokens highlighted, the cached part dimmed, the boundary marked."""
    cached = view.template_cached if view.template.startswith(view.template_cached) else ""
    pattern = (
        re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)))
        if specials
        else None
    )
    parts = _specials_marked(cached, "$text-muted", pattern)
    if view.reused:
        parts.append(BOUNDARY)
    parts += _specials_marked(view.template[len(cached) :], "", pattern)
    return Content.assemble(*parts)


def _specials_marked(text: str, base: str, pattern: re.Pattern | None) -> list:
    """`text` in the `base` style with each special token (a match of `pattern`) highlighted."""
    text = visible_controls(text)  # a server's template, the conversation's words: shown, never obeyed
    if pattern is None:
        return [(text, base)]
    out, at = [], 0
    for m in pattern.finditer(text):
        out += [(text[at : m.start()], base), (m.group(), SPECIAL)]
        at = m.end()
    return [*out, (text[at:], base)]


def token_sources(view: TokenizerView, label: str) -> Content:
    """The turn's tokens by where they came from: cached, prefilled, generated."""
    return Content.assemble(
        ("prompt ", "bold"),
        f"{count(view.prompt_tokens, 'token')}: ",
        (f"{view.reused} cached", SOURCE_STYLES["cached"][0]),
        " + ",
        (f"{view.prefilled} prefilled", SOURCE_STYLES["prefilled"][0]),
        " · ",
        ("answer ", "bold"),
        (f"{view.generated} generated", SOURCE_STYLES["generated"][0]),
        f" · {len(view.pieces)} tokens in all ({label})",
    )


def span_label(span: Span) -> str:
    """The message a span belongs to; the tail no message matches is the answer as generated."""
    if span.message is not None:
        return f"{span.role} #{span.message + 1}"
    if span.default:
        return "system (template)"
    return "system" if span.role == "system" else "answer (as generated)"


SPAN_HEAD = Content.assemble(
    ("message".ljust(22), "bold"),
    ("tokens".rjust(8), "bold"),
    ("characters".rjust(12), "bold"),
    ("chars/token".rjust(13), "bold"),
)


def span_lines(view: TokenizerView) -> list[Content]:
    lines = [SPAN_HEAD]
    lines += [_span_line(view, span) for span in view.spans]
    if any(span.default for span in view.spans):
        lines.append(
            Content.styled(
                "system (template): no system prompt was set, so the chat template put in its own; "
                "it is prefilled and cached like any message",
                "$text-muted",
            )
        )
    return lines


def _span_line(view: TokenizerView, span: Span) -> Content:
    cost = view.span_cost(span)
    per = f"{cost.chars_per_token:.2f}" if cost.tokens else "–"
    return Content(f"{span_label(span):<22}{span.tokens:>8}{cost.characters:>12}{per:>13}")


def cost_lines(cost: TextCost) -> Content:
    per = f"{cost.chars_per_token:.2f}" if cost.tokens else "–"
    return Content.assemble(
        (count(cost.tokens, "token"), "bold"),
        f" · {cost.characters} characters · {cost.utf8_bytes} UTF-8 bytes · {per} chars/token\n",
        piece_chips(cost.pieces),
    )


def cost_verdict(left: TextCost, right: TextCost) -> Content:
    if not left.tokens or not right.tokens:
        return Content.styled("type a text on each side", "$text-muted")
    more, fewer = (left, right) if left.tokens >= right.tokens else (right, left)
    ratio = more.tokens / fewer.tokens
    return Content.assemble(
        ("the left costs " if more is left else "the right costs ", "bold"),
        (f"{ratio:.1f}×", "bold $text-warning"),
        f" the tokens of the other ({more.tokens} vs {fewer.tokens}): that much more work in the prefill "
        "(still one pass, over more tokens), that many more KV cache slots and, when generated, that many "
        "more decode steps.",
    )


@dataclass
class ServerCosts(Message):
    """The server's tokenizer counted both texts (or `error` says why not)."""

    costs: tuple[TextCost, TextCost] | None
    error: str = ""


@dataclass
class ServerTurn(Message):
    """The server's tokenizer read the turn (or `error` says why not)."""

    turn: object | None
    """A `ServerTurnView` (engine/remote/tokenizer.py)."""
    label: str
    error: str = ""


class TokenizerScreen(InstrumentScreen):
    INSTRUMENT = "tokenizer"
    DEFAULT_CSS = """
    TokenizerScreen #costs { height: auto; }
    TokenizerScreen #costs > Vertical { width: 1fr; height: auto; padding-right: 1; }
    TokenizerScreen .cost { height: auto; }
    TokenizerScreen #template { background: $boost; padding: 0 1; }
    """

    def __init__(self, link: Instruments, step: int | None = None, answer: AnswerRef | None = None) -> None:
        super().__init__(link, step, answer)
        self.answer = answer
        self.server = getattr(link.session, "server_tokenizer", None)
        """The server's tokenizer where the model is on a server; None for the local engine."""

    def compose_body(self) -> ComposeResult:
        yield Static(id="summary")
        yield Static("Compare cost: the same question in two languages", classes="section")
        with Horizontal(id="costs"):
            for side, example in zip(("left", "right"), EXAMPLES):
                with Vertical():
                    yield Input(example, id=f"{side}-text")
                    yield Static(id=f"{side}-cost", classes="cost")
        yield Static(id="verdict")
        yield Static("Pieces the model sees (prompt, then answer)", classes="section")
        yield Static(legend(), classes="muted")
        yield Static(id="pieces")
        yield Static("Characters per token, per message", classes="section")
        yield Static(id="spans")
        yield Static("The rendered chat template", classes="section")
        yield Static(id="template")

    def on_mount(self) -> None:
        blink = getattr(self.app, "options", None)
        for field in self.query(Input):
            field.cursor_blink = blink.cursor_blink if blink is not None else True
        self.query_one("#body").focus()
        self._costs()
        self._turn()

    # -- the turn ---------------------------------------------------------------------
    def _turn(self) -> None:
        session = self.link.session
        answer = self.answer
        if answer is None:
            refs = answers(session)
            answer = refs[-1] if refs else None
        if answer is None:
            no_turn = "No turn yet: send a prompt to see it as the model does. The cost comparison works now."
            self.query_one("#summary", Static).update(Content.styled(no_turn, "$text-muted"))
            return
        if self.server is not None:
            self._server_turn(answer)
            return
        trace = answer.trace
        view = tokenizer_view(session, trace.prompt_ids, trace.reused, [s.id for s in list(trace.steps)])
        self._show_turn(view, answer.label, list(session.tokenizer.all_special_tokens))

    def _show_turn(
        self, view: TokenizerView, label: str, specials: list[str], notes: tuple[str, ...] = ()
    ) -> None:
        self.set_title_line(label)
        self.query_one("#summary", Static).update(
            Content.assemble(
                token_sources(view, label),
                *self._source_line(),
                *((f"\n{note}", "$text-muted") for note in notes),
            )
        )
        self.query_one("#pieces", Static).update(
            piece_chips(view.pieces, view.reused if view.reused else None)
        )
        self.query_one("#spans", Static).update(Content("\n").join(span_lines(view)))
        self.query_one("#template", Static).update(template_content(view, specials))

    def _source_line(self) -> list[tuple[str, str]]:
        """Whose tokenizer this is, when it is not the local one."""
        if self.server is None:
            return []
        return [(f"\n{self.server.client.shown}'s own tokenizer (/tokenize, /detokenize)", "$text-muted")]

    # -- the turn, from a server's tokenizer ------------------------------------------------
    def _server_turn(self, answer: AnswerRef) -> None:
        if not self.server.available:
            self._say(self.server.missing)
            return
        self._say(f"asking {self.server.client.shown}/tokenize…")
        self.run_worker(lambda: self._read_turn(answer), thread=True, exclusive=True, group="turn")

    def _read_turn(self, answer: AnswerRef) -> None:
        """On a worker thread: the HTTP requests, then a message to the screen."""
        from engine.remote.client import RemoteError

        try:
            self.post_message(
                ServerTurn(self.server.turn_view(self.link.session, answer.trace), answer.label)
            )
        except RemoteError as e:
            self.post_message(ServerTurn(None, answer.label, str(e)))

    @on(ServerTurn)
    def _server_turn_read(self, message: ServerTurn) -> None:
        if message.turn is None:
            self._say(f"the server's tokenizer could not read the turn: {message.error}")
            return
        turn = message.turn
        self._show_turn(turn.view, message.label, list(turn.specials), turn.notes)

    def _say(self, text: str) -> None:
        self.query_one("#summary", Static).update(Content.styled(text, "$text-muted"))

    # -- compare cost -----------------------------------------------------------------
    @on(Input.Changed)
    def _costs(self) -> None:
        session = self.link.session
        if self.server is not None:
            texts = tuple(self.query_one(f"#{side}-text", Input).value for side in ("left", "right"))
            self.run_worker(lambda: self._count(*texts), thread=True, exclusive=True, group="costs")
            return
        costs = []
        for side in ("left", "right"):
            cost = text_cost(session.tokenizer, self.query_one(f"#{side}-text", Input).value, session.namer)
            self.query_one(f"#{side}-cost", Static).update(cost_lines(cost))
            costs.append(cost)
        self.query_one("#verdict", Static).update(cost_verdict(*costs))

    def _count(self, left: str, right: str) -> None:
        """On a worker thread: both texts through the server's tokenizer."""
        from engine.remote.client import RemoteError

        if not self.server.available:
            self.post_message(ServerCosts(None, self.server.missing))
            return
        try:
            self.post_message(ServerCosts((self.server.text_cost(left), self.server.text_cost(right))))
        except RemoteError as e:
            self.post_message(ServerCosts(None, str(e)))

    @on(ServerCosts)
    def _server_costs(self, message: ServerCosts) -> None:
        if message.costs is None:
            verdict = Content.styled(visible_controls(message.error), "$text-warning")
            self.query_one("#verdict", Static).update(verdict)
            return
        for side, cost in zip(("left", "right"), message.costs):
            self.query_one(f"#{side}-cost", Static).update(cost_lines(cost))
        self.query_one("#verdict", Static).update(cost_verdict(*message.costs))

    def engine_said(self, event: Event) -> None:
        if isinstance(event, (TurnFinished, Forked)) and self.answer is None:
            self._turn()
