"""A step's candidates as a list with a cursor: rank, piece, ID, probability bar, and marks.

The token inspector forks from the highlighted candidate; step mode takes it. A click on a
row runs `action` with the row's index.
"""

from __future__ import annotations

from textual.content import Content
from textual.geometry import Size
from textual.widget import Widget

from engine.events import Candidate
from tui.fmt import prob_color, subscript, visible_piece

PIECE_WIDTH = 12
ID_WIDTH = 7


class AlternativesList(Widget):
    DEFAULT_CSS = """
    AlternativesList { height: auto; text-wrap: nowrap; text-overflow: ellipsis; }
    """

    def __init__(self, action: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.action = action
        """An action with one `{}` for the row's index, e.g. `screen.choose({})`."""
        self.auto_links = False  # the rows carry @click; link styling would paint over their colours
        self.candidates: tuple[Candidate, ...] = ()
        self.marks: dict[int | str, str] = {}
        self.cursor = 0

    def set_candidates(
        self, candidates: tuple[Candidate, ...], marks: dict[int | str, str], cursor: int = 0
    ) -> None:
        """`marks` labels candidates by ID (e.g. 'taken', 'sampled', 'greedy'), or by piece where a
        server sent no ids."""
        self.candidates, self.marks = candidates, marks
        self.cursor = max(0, min(cursor, len(candidates) - 1))
        self.refresh(layout=True)

    def move(self, delta: int) -> None:
        if self.candidates:
            self.cursor = (self.cursor + delta) % len(self.candidates)
            self.refresh()

    @property
    def highlighted(self) -> Candidate | None:
        return self.candidates[self.cursor] if self.candidates else None

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return max(1, len(self.candidates))

    def render(self) -> Content:
        if not self.candidates:
            return Content.styled("no candidates", "$text-muted")
        top = max(c.prob for c in self.candidates) or 1.0
        mark_width = max((len(m) for m in self.marks.values()), default=0)
        bar_width = max(4, min(40, self.content_size.width - PIECE_WIDTH - ID_WIDTH - mark_width - 18))
        return Content("\n").join(self._row(row, c, top, bar_width) for row, c in enumerate(self.candidates))

    def _row(self, row: int, c: Candidate, top: float, bar_width: int) -> Content:
        """One candidate, clickable: cursor, rank, piece, id, probability, bar, and its mark."""
        here = row == self.cursor
        click = f" @click={self.action.format(row)}"
        filled = round(bar_width * c.prob / top)
        mark = self.marks.get(c.id if c.id is not None else c.piece, "")
        return Content.assemble(
            ("›" if here else " ", "bold $accent" + click),
            (f"{row + 1:>2} ", ("bold $accent" if here else "$text-muted") + click),
            (
                visible_piece(c.piece)[:PIECE_WIDTH].ljust(PIECE_WIDTH),
                ("reverse bold" if here else "") + click,
            ),
            " ",
            (subscript(c.id).ljust(ID_WIDTH), "$text-muted" + click),
            (f"{c.prob:7.2%} ", click),
            ("█" * filled, prob_color(c.prob) + click),
            " " * (bar_width - filled),
            (f" {mark}", "bold $text-accent"),
        )
