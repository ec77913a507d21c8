"""A column chart in text: one bar per x value, drawn with eighth blocks (▁▂▃▄▅▆▇█).

Rich and Textual draw no charts, and a few bars need no plotting library. The y axis starts at
0 (a bar's height is proportional to its value); the x values are labels, so a doubling
series (16, 32, 64, ...) is evenly spaced, a log axis. A value still to come is a dot on the
baseline, so the chart can grow one point at a time.
"""

from __future__ import annotations

from typing import Callable, Sequence

from textual.content import Content

EIGHTHS = " ▁▂▃▄▅▆▇█"


def bar_levels(value: float, top: float, height: int) -> list[int]:
    """Eighths filled in each row, top row first, for a bar of `value` on a `height`-row axis to `top`."""
    filled = round(max(0.0, value) / top * height * 8) if top > 0 else 0
    filled = max(filled, 1) if value > 0 else filled  # a value above zero never vanishes
    return [max(0, min(8, filled - 8 * (height - 1 - row))) for row in range(height)]


def bar_chart(
    labels: Sequence[str],
    values: Sequence[float | None],
    fmt: Callable[[float], str],
    height: int = 8,
    style: str = "$text-primary",
    top: float | None = None,
    column: int = 0,
    axis: int = 1,
) -> list[Content]:
    """Lines of a column chart: the values above the bars, the labels under them.

    `values[i]` None: not measured yet (a dot). `top`: the axis' end, by default the largest value.
    `column` and `axis`: the least width of a column and of the axis' labels (charts stacked
    with the same ones line up).
    """
    shown = [v for v in values if v is not None]
    top = top if top is not None else max(shown, default=0.0)
    texts = [fmt(v) if v is not None else "" for v in values]
    width = max([len(t) for t in labels] + [len(t) for t in texts] + [3, column - 1]) + 1
    axis = max(len(fmt(top)) if top > 0 else 1, axis)
    lines = [
        Content.assemble(" " * axis, " ", *((t.center(width), "$text-muted" if t else "") for t in texts))
    ]
    levels = [bar_levels(v, top, height) if v is not None else None for v in values]
    for row in range(height):
        tick = fmt(top) if row == 0 and top > 0 else ""
        lines.append(_bar_row(levels, row, height, tick, axis, width, style))
    lines.append(Content.styled("0".rjust(axis) + "└" + "─" * (width * len(values)), "$text-muted"))
    lines.append(Content.assemble(" " * axis, " ", *(label.center(width) for label in labels)))
    return lines


def _bar_row(
    levels: list[list[int] | None], row: int, height: int, tick: str, axis: int, width: int, style: str
) -> Content:
    """One row of the chart: the axis (with its tick on the top row), then each column's slice of its bar."""
    bar = max(1, width - 2)
    parts: list = [(tick.rjust(axis) + "┤" if tick else " " * axis + "│", "$text-muted")]
    for level in levels:
        if level is None:
            cell = ("·" if row == height - 1 else " ").center(width)
            parts.append((cell, "$text-muted"))
        else:
            parts.append((" " + EIGHTHS[level[row]] * bar + " " * (width - bar - 1), style))
    return Content.assemble(*parts)
