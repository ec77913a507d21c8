"""A strip of token chips with a cursor: the rows around the cursor, each chip clickable.

Used by the token inspector (an answer's steps) and anywhere else a student picks a token.
A click runs `action` with the chip's index (e.g. `screen.select(4)`).
"""

from __future__ import annotations

from dataclasses import dataclass

from textual.content import Content
from textual.geometry import Size
from textual.widget import Widget

from tui.fmt import subscript, visible_piece

CURSOR = "bold $background on $accent"


@dataclass(frozen=True)
class StripToken:
    id: int | None
    piece: str
    style: str


def pack(widths: list[int], width: int) -> list[list[int]]:
    """Indices of items of the given widths laid out in rows of `width` cells, reading order."""
    rows: list[list[int]] = [[]]
    used = 0
    for i, w in enumerate(widths):
        if rows[-1] and used + w > width:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += w
    return rows


class TokenStrip(Widget):
    DEFAULT_CSS = """
    TokenStrip { height: auto; max-height: 8; text-wrap: nowrap; text-overflow: ellipsis; }
    """

    def __init__(self, action: str, max_rows: int = 6, **kwargs) -> None:
        super().__init__(**kwargs)
        self.action = action
        """An action with one `{}` for the chip's index, e.g. `screen.select({})`."""
        self.auto_links = False  # the rows carry @click; link styling would paint over their colours
        self.max_rows = max_rows
        self.tokens: list[StripToken] = []
        self.cursor = 0

    def set_tokens(self, tokens: list[StripToken], cursor: int = 0) -> None:
        self.tokens = tokens
        self.cursor = cursor
        self.refresh(layout=True)

    def move_to(self, cursor: int) -> None:
        self.cursor = cursor
        self.refresh()

    def _chips(self) -> list[Content]:
        chips = []
        for i, t in enumerate(self.tokens):
            style = CURSOR if i == self.cursor else t.style
            click = f" @click={self.action.format(i)}"
            chips.append(
                Content.assemble(
                    (visible_piece(t.piece), style + click), (subscript(t.id), "$text-muted" + click), " "
                )
            )
        return chips

    def _rows(self, width: int) -> tuple[list[Content], list[list[int]]]:
        chips = self._chips()
        return chips, pack([c.cell_length for c in chips], max(1, width))

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        if not self.tokens:
            return 1
        return min(self.max_rows, len(self._rows(width)[1]))

    def render(self) -> Content:
        if not self.tokens:
            return Content.styled("no tokens", "$text-muted")
        chips, rows = self._rows(self.content_size.width)
        at = next((r for r, row in enumerate(rows) if self.cursor in row), 0)
        first = max(0, min(at - self.max_rows // 2, len(rows) - self.max_rows))
        shown = rows[first : first + self.max_rows]
        lines = [Content.assemble(*(chips[i] for i in row)) for row in shown]
        if first > 0:
            lines[0] = Content.assemble((f"…{rows[first][0]} before ", "$text-muted"), lines[0])
        return Content("\n").join(lines)
