"""A text plot of a few points, for the terminal and the app alike (no Textual, no Rich).

x values sit evenly spaced (the sweep's B = 1, 2, 4, 8, 16: a log scale), y is linear from 0.
The measured points are ●, joined by ·; an optional reference line (○: what perfect scaling
would give) shows where the measured curve falls away from it.
"""

from __future__ import annotations


def text_plot(
    xs: list[int],
    ys: list[float],
    height: int = 10,
    column: int = 8,
    reference: list[float] | None = None,
    unit: str = "",
) -> list[str]:
    """Lines of a plot `column` characters per x value and `height` rows tall."""
    if not xs:
        return ["(no points)"]
    top = max(ys + (reference or [])) or 1.0
    rows = [[" "] * (column * len(xs)) for _ in range(height)]
    centres = [i * column + column // 2 for i in range(len(xs))]
    for (x0, y0), (x1, y1) in zip(zip(centres, ys), zip(centres[1:], ys[1:])):
        for x in range(x0 + 1, x1):
            _put(rows, x, y0 + (y1 - y0) * (x - x0) / (x1 - x0), top, "·")
    for x, y in zip(centres, reference or []):
        _put(rows, x, y, top, "○")
    for x, y in zip(centres, ys):
        _put(rows, x, y, top, "●")
    return _with_axes(rows, xs, top, column, unit)


def _put(rows: list[list[str]], x: int, y: float, top: float, mark: str) -> None:
    """Mark (x, y) on the grid: a point over a line or a reference, a reference over a line."""
    height = len(rows)
    r = height - 1 - min(height - 1, round(y / top * (height - 1)))
    if rows[r][x] in (" ", "·") or mark == "●":
        rows[r][x] = mark


def _with_axes(rows: list[list[str]], xs: list[int], top: float, column: int, unit: str) -> list[str]:
    """The grid's lines with the y axis labelled every third row and the x values under it."""
    height = len(rows)
    label_width = len(f"{top:,.0f}")
    lines = []
    for r, cells in enumerate(rows):
        value = top * (height - 1 - r) / (height - 1) if height > 1 else top
        label = f"{value:,.0f}".rjust(label_width) if r % 3 == 0 or r == height - 1 else " " * label_width
        lines.append(f"{label} ┤{''.join(cells)}".rstrip())
    lines.append(" " * label_width + " └" + "─" * (column * len(xs)))
    lines.append(
        " " * (label_width + 2) + "".join(f"B={x}".center(column) for x in xs) + (f"  {unit}" if unit else "")
    )
    return lines
