"""Drawing the attention view's two new parts: the prefill's causal matrix as a character heatmap
(with the window that fits the screen), the attention sink, and query heads grouped by K/V head.

Pure functions of the engine's plain data (engine/instruments/attention_matrix.py `PrefillMatrix`,
attention.py `AttentionView`), so the screen only chooses what to show.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from rich.cells import set_cell_size
from textual.content import Content

from engine.instruments.attention import AttentionView, kv_groups
from engine.instruments.attention_matrix import PrefillMatrix
from tui.fmt import visible_piece

SHADES = (
    (0.20, "█", "$text-error"),
    (0.05, "▓", "$text-warning"),
    (0.01, "▒", "$text-primary"),
    (0.0, "░", ""),
)
"""Weight floors, the cell's character and colour: the more attention, the denser and hotter."""
MASKED = ("·", "$text-muted 50%")
"""A key after the query: the causal mask sets its weight to exactly 0."""
LABEL_WIDTH = 16
"""'▶ 1234 piece….. ': the row's marker, position and piece."""


def shade(weight: float) -> tuple[str, str]:
    return next((char, style) for floor, char, style in SHADES if weight >= floor)


@dataclass(frozen=True)
class Window:
    """The part of the matrix on screen: query rows [top, top + rows), key columns [left, left + cols)."""

    top: int
    rows: int
    left: int
    cols: int

    @property
    def bottom(self) -> int:
        return self.top + self.rows

    @property
    def right(self) -> int:
        return self.left + self.cols


def window_for(size: int, query: int, top: int, rows: int, cols: int) -> Window:
    """Keep the query's row in view, moving the rows as little as possible from `top`; the keys end
    at the query's diagonal once it is wider than the screen (so position 0 scrolls off the left)."""
    rows, cols = min(rows, size), min(cols, size)
    top = min(max(top, query - rows + 1), query)
    top = max(0, min(top, size - rows))
    left = max(0, query - cols + 1)
    return Window(top, rows, left, cols)


def ruler(window: Window) -> Content:
    """Key positions every 10 columns, above the grid."""
    marks = [" "] * window.cols
    for key in range(window.left, window.right):
        at = key - window.left
        label = str(key)
        if (
            key % 10 == 0
            and at + len(label) <= window.cols
            and all(m == " " for m in marks[at : at + len(label)])
        ):
            marks[at : at + len(label)] = label
    return Content.assemble(
        ("key →".rjust(LABEL_WIDTH - 1) + " ", "$text-muted"), ("".join(marks), "$text-muted")
    )


def grid_lines(matrix: PrefillMatrix, window: Window, query: int, pieces: Sequence[str]) -> list[Content]:
    """One line per query row: marker, position, piece, then a cell per key."""
    lines = [ruler(window)]
    for q in range(window.top, window.bottom):
        chosen = q == query
        piece = set_cell_size(visible_piece(pieces[q]), 8)  # by cells: a CJK character takes two
        label = f"{'▶' if chosen else ' '} {q:>4} {piece} "
        cells: list[tuple[str, str]] = []
        for k in range(window.left, window.right):
            char, style = MASKED if k > q else shade(matrix.rows[q][k])
            cells.append((char, f"{style} on $boost" if chosen and k <= q else style))
        lines.append(Content.assemble((label, "bold $accent" if chosen else "$text-muted"), *cells))
    return lines


def window_line(matrix: PrefillMatrix, window: Window) -> str:
    whole = window.rows == matrix.size and window.cols == matrix.size
    shown = (
        f"all {matrix.size} positions shown"
        if whole
        else f"rows {window.top}–{window.bottom - 1}, keys {window.left}–{window.right - 1} of {matrix.size} "
        "shown: the window follows the query"
    )
    if matrix.context > matrix.size:
        shown += (
            f" · the matrix stops at position {matrix.size - 1} of {matrix.context}: a causal row "
            "does not depend on later positions, so these rows are exact"
        )
    return shown


def legend() -> Content:
    parts: list = []
    for (_, char, style), bound in zip(SHADES, ["≥20%", "5–20%", "1–5%", "<1%"]):
        parts += [(char * 2, style), f" {bound}  "]
    parts += [(MASKED[0] * 2, MASKED[1]), " masked: exactly 0"]
    return Content.assemble(*parts)


def sink_line(matrix: PrefillMatrix, window: Window) -> Content:
    """Name position 0 an attention sink only where its share says so; say what the share is either way."""
    share, even = matrix.sink_share, matrix.uniform_share
    where = "column 0" if window.left == 0 else "position 0 (left of the window)"
    numbers = (
        f"position 0 gets {share:.1%} of each row on average (rows 1–{matrix.size - 1}; "
        f"an even spread over each row would give it {even:.1%})"
    )
    if matrix.size < 2:
        return Content.styled("one position: nothing to compare position 0 with yet", "$text-muted")
    if matrix.is_sink:
        return Content.assemble(("◆ attention sink ", "bold $text-error"), f"at {where}: {numbers}")
    return Content.assemble(("no attention sink here ", "bold"), f"({where}): {numbers}")


def sink_groups(matrix: PrefillMatrix, heads: int, kv_heads: int) -> Content:
    """Position 0's share for every head of the layer, under the K/V head each reads."""
    parts: list = [("position 0's share by head, grouped by K/V head  ", "bold")]
    for kv, group in enumerate(kv_groups(heads, kv_heads)):
        parts.append((f"K/V {kv}: ", "$text-muted"))
        for head in group:
            style = "bold $accent" if head == matrix.head else ""
            parts += [(f"h{head} {matrix.sink_shares[head]:.0%}", style), " "]
        parts.append(("│ ", "$text-muted"))
    return Content.assemble(*parts[:-1])


def head_group_lines(
    view: AttentionView, pieces: Sequence[str], heads: int, kv_heads: int, selected: int | None, top: int = 3
) -> list[Content]:
    """Each query head's strongest positions, under the K/V head it shares: same K and V, other queries."""
    lines = []
    for kv, group in enumerate(kv_groups(heads, kv_heads)):
        shared = f"  one cached K and V read by query heads {', '.join(map(str, group))}"
        readers = shared if heads // kv_heads > 1 else "  its own K and V (one query head)"
        lines.append(Content.assemble((f"K/V head {kv}", "bold"), (readers, "$text-muted")))
        lines += [_head_line(view.head_weights[head], head, pieces, head == selected, top) for head in group]
    return lines


def _head_line(row: Sequence[float], head: int, pieces: Sequence[str], selected: bool, top: int) -> Content:
    """A query head's `top` strongest positions: piece, position, weight."""
    best = sorted(range(len(row)), key=lambda i: row[i], reverse=True)[:top]
    picks: list = []
    for i in best:
        picks += [visible_piece(pieces[i])[:12], (f"@{i}", "$text-muted"), f" {row[i]:.0%}   "]
    return Content.assemble(
        (f"  {'▶' if selected else ' '} head {head:<3}", "bold $accent" if selected else ""),
        "looks at  ",
        *picks,
    )
