"""Line plots in text, drawn by plotext: the one plotting library of the commands and the app
(the serving sweep's throughput-latency curve, the lab's batching sweep in the terminal and in
F9). Without colour, so a plot reads the same in a terminal, a file, and every app theme.

(F6's context lesson keeps its own column chart, tui/widgets/bar_chart.py: its bars take the
theme's colours and grow one measurement at a time, which plotext's text cannot.)
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Sequence

_PLOTEXT = threading.Lock()
"""plotext draws on one module-wide figure: one plot at a time."""


@dataclass(frozen=True)
class Series:
    label: str
    ys: Sequence[float]
    marker: str = "●"
    joined: bool = True
    """Points joined by a dotted line; False: the points alone (a reference)."""


def text_plot(
    xs: Sequence[float],
    series: Sequence[Series],
    width: int = 76,
    height: int = 14,
    x_ticks: Sequence[str] | None = None,
    x_label: str = "",
    title: str = "",
) -> list[str]:
    """The plot's lines, y from 0; `x_ticks` label each x (evenly spaced x values: a log scale)."""
    import plotext as plt  # ~0.04 s: only when a plot is drawn

    if not xs:
        return ["(no points)"]
    top = max((y for s in series for y in s.ys), default=1.0) or 1.0
    with _PLOTEXT:
        plt.clear_figure()
        plt.theme("clear")
        plt.plotsize(width, height)
        for s in series:
            if s.joined:
                plt.plot(list(xs), list(s.ys), marker="dot")
        for s in reversed(series):  # the first series' points on top
            plt.scatter(list(xs), list(s.ys), marker=s.marker, label=s.label if len(series) > 1 else None)
        if x_ticks is not None:
            plt.xticks(list(xs), list(x_ticks))
        plt.ylim(0, top * 1.05)
        plt.title(title)
        plt.xlabel(x_label)
        drawn = plt.uncolorize(plt.build())
    return [line.rstrip() for line in drawn.splitlines()]


def batching_plot(
    batches: Sequence[int],
    measured: Sequence[float],
    ideal: Sequence[float],
    width: int = 76,
    height: int = 14,
) -> list[str]:
    """The lab's sweep: aggregate tok/s at each B (evenly spaced: a log scale) beside B x the B=1
    rate, the line it would follow if batching cost nothing."""
    return text_plot(
        list(range(len(batches))),
        [Series("measured", measured), Series("B × the B=1 rate", ideal, "○", joined=False)],
        width,
        height,
        x_ticks=[f"B={b}" for b in batches],
        title="aggregate tok/s against the batch size B",
    )
