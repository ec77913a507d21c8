"""The token panel: this turn's prompt tokens (reused ones marked) and each generated token as a chip.

Drawn by `render()` at a fixed height: it shows the newest chips that fit and counts the
rest, so an update repaints this panel only and a long answer stays cheap to draw.
"""

from __future__ import annotations

from textual.content import Content
from textual.widget import Widget

from engine.events import DraftRound, PromptTokens, TokenSampled
from tui.fmt import PROB_LEVELS, count, logprob_style, subscript, visible_piece

KEEP = 2000
"""Generated chips kept (far more than fit on screen)."""
REUSED = "$text-muted on $panel"
NEW = "bold $background on $warning"
"""Prefilled now: the PREFILL badge's look, unlike any probability colour (those are muted)."""
EMPTY = "the tokens of the next turn appear here"
ACCEPTED = " underline"
"""Added to the probability colour of a drafted token the model kept."""
REJECTED = "strike $text-muted"
"""A drafted token the model rejected (shown before the correction that replaced it)."""
THOUGHT = " italic"
"""Added to the probability colour of a token of thought (engine/thinking.py)."""


def chip(token_id: int | None, piece: str, style: str, click: str = "") -> Content:
    """`click`: an action a mouse click on the chip runs (e.g. open the token inspector at this step)."""
    click = f" @click={click}" if click else ""
    return Content.assemble(
        (visible_piece(piece), style + click), (subscript(token_id), "$text-muted" + click), " "
    )


def legend() -> Content:
    parts: list = []
    for floor, level in PROB_LEVELS:
        parts += [(f"≥{floor:g}", f"$text-{level} on ${level}-muted"), " "]
    return Content.assemble("p ", *parts)


def pack_tail(chips: list[Content], width: int, lines: int) -> tuple[list[list[Content]], int]:
    """The newest chips that fill `lines` rows of `width` cells, and how many older ones did not fit."""
    rows: list[list[Content]] = []
    i = len(chips)
    while i > 0 and len(rows) < lines:
        row: list[Content] = []
        used = 0
        while i > 0 and (not row or used + chips[i - 1].cell_length <= width):
            row.insert(0, chips[i - 1])
            used += chips[i - 1].cell_length
            i -= 1
        rows.insert(0, row)
    if i and rows:  # make room for the "…N earlier" note on the first row
        note = len(f"…{i + len(rows[0])} earlier ")
        while len(rows[0]) > 1 and sum(c.cell_length for c in rows[0]) + note > width:
            rows[0].pop(0)
            i += 1
    return rows, i


def pack_head(chips: list[Content], width: int) -> list[list[Content]]:
    """All chips, filling rows from the first (how one reads)."""
    rows: list[list[Content]] = [[]]
    used = 0
    for chip_ in chips:
        if rows[-1] and used + chip_.cell_length > width:
            rows.append([])
            used = 0
        rows[-1].append(chip_)
        used += chip_.cell_length
    return rows


def block(chips: list[Content], width: int, lines: int) -> list[Content]:
    """Rows of chips: all of them when they fit, else the newest with a count of the rest."""
    rows, hidden = pack_tail(chips, width, lines)
    if not hidden:
        rows = pack_head(chips, width)
    out = [Content.assemble(*row) for row in rows]
    if hidden:
        out[0] = Content.assemble((f"…{hidden} earlier ", "$text-muted"), out[0])
    return out or [Content("")]


class TokenStream(Widget):
    DEFAULT_CSS = """
    TokenStream { height: 8; border: round $primary 50%; border-title-color: $text; padding: 0 1; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.border_title = "Tokens"
        # Chips may carry @click; Textual's link styling would paint over their probability colours.
        self.auto_links = False
        self.prompt: PromptTokens | None = None
        self.prompt_chips: list[Content] = []
        self.chips: list[Content] = []
        self.generated = 0
        self.thought = 0
        """Of the generated tokens, those that were thought."""
        self.prompted = False
        """PromptTokens came for the turn about to start."""
        self.empty = EMPTY
        """What the panel says while it has no turn to show."""
        self.marks: dict[int, tuple[int, ...]] = {}
        """Speculation: answer index -> (): a kept draft; (ids...): drafts rejected in its place."""
        self.drafted = self.kept = 0
        """Drafts proposed, and those kept as the panel shows them (underlined)."""

    def set_prompt(self, prompt: PromptTokens) -> None:
        self.prompt, self.chips, self.generated, self.thought = prompt, [], 0, 0
        self.marks, self.drafted, self.kept = {}, 0, 0
        reused = prompt.reused or 0  # not reported by a server: no chip is marked as reused
        self.prompt_chips = [
            chip(i, piece, REUSED if n < reused else NEW)
            for n, (i, piece) in enumerate(zip(prompt.ids, prompt.pieces))
        ]
        self.prompted = True
        self.refresh()

    def begin_turn(self) -> None:
        """Prefill started: a turn whose prompt tokens nobody sent (a server that cannot
        tokenize) starts from an empty panel too."""
        if not self.prompted:
            self.prompt, self.prompt_chips, self.chips, self.generated, self.thought = None, [], [], 0, 0
            self.refresh()
        self.prompted = False

    def add_round(self, event: DraftRound) -> None:
        """A speculative round: its kept drafts and its rejections mark the chips that follow."""
        for i in range(event.accepted):
            self.marks[event.index + i] = ()
        rejected = list(zip(event.drafted[event.accepted :], event.pieces[event.accepted :]))
        if rejected:
            self.marks[event.index + event.accepted] = tuple(rejected)
        self.drafted += len(event.drafted)

    def add(self, tokens: list[TokenSampled], repaint: bool = True) -> None:
        for t in tokens:
            mark = self.marks.pop(t.index, None)
            # Kept as the chips show it: a draft kept past an end-of-turn token never shows.
            self.kept += mark == ()
            style = logprob_style(t.logprob) + (ACCEPTED if mark == () else "")
            style += THOUGHT if t.thinking else ""
            for token_id, piece in mark or ():
                self.chips.append(chip(token_id, piece, REJECTED))
            self.chips.append(chip(t.id, t.piece, style, f"app.instrument('inspector',{t.index})"))
        del self.chips[:-KEEP]
        self.generated += len(tokens)
        self.thought += sum(t.thinking for t in tokens)
        if repaint:
            self.refresh()

    def clear(self, why: str = EMPTY) -> None:
        """Show no turn; `why` says what the panel waits for."""
        self.prompt, self.prompt_chips, self.chips, self.generated, self.thought = None, [], [], 0, 0
        self.prompted = False
        self.empty = why
        self.refresh()

    def render(self) -> Content:
        if self.prompt is None and not self.chips:
            return Content.styled(self.empty, "$text-muted")
        width, height = self.content_size.width, self.content_size.height
        drafts = f"drafts kept {self.kept}/{self.drafted}  " if self.drafted else ""
        thought = f"({self.thought:,} thought, in italics)  " if self.thought else ""
        answer = Content.assemble(
            ("answer ", "bold"), f"{count(self.generated, 'token')}  ", thought, drafts, legend()
        )
        if self.prompt is None:  # a server that does not tokenize: the answer's tokens only
            note = Content.styled("prompt: the server does not tokenize it for us", "$text-muted")
            return Content("\n").join([note, answer, *block(self.chips, width, max(1, height - 2))])
        prompt = self._prompt_line()
        if prompt.cell_length + answer.cell_length + 3 <= width:
            summary = [Content.assemble(prompt, "   ", answer)]
        else:
            summary = [prompt, answer]
        room = max(2, height - len(summary))
        # The answer gets the rows it needs (up to all but one); the prompt gets the rest.
        answer_rows = min(room - 1, max(1, len(pack_tail(self.chips, width, room - 1)[0])))
        lines = [*summary, *block(self.prompt_chips, width, room - answer_rows)]
        lines += block(self.chips, width, answer_rows)
        return Content("\n").join(lines)

    def _prompt_line(self) -> Content:
        """The prompt's tokens: how many the cache reused and how many were prefilled now."""
        p = self.prompt
        if p.reused is None:
            split = [("cache reuse not reported by the server", "$text-muted")]
        else:
            split = [(f"{p.reused} reused", REUSED), " · ", (f"{len(p.ids) - p.reused} prefilled now", NEW)]
        return Content.assemble(("prompt ", "bold"), f"{count(len(p.ids), 'token')}: ", *split)
