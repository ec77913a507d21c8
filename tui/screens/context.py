"""Context length is not free: TTFT and ITL measured at 16 ... 2,048 tokens, plotted as they come.

Each size is one `engine.call` (engine/instruments/context_sweep.py) into a cache of the
sweep's own, so the chat's cache and turn are never touched and a chat message sent meanwhile
simply waits for the point in progress. Esc stops the sweep at its next chunk or step (Esc
again closes); r runs it again.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Callable

from textual.app import ComposeResult
from textual.binding import Binding
from textual.content import Content
from textual.widgets import Static

from engine.instruments.context_sweep import (
    DECODE_STEPS,
    LLAMA_2_7B,
    LLAMA_2_70B,
    CacheShape,
    ContextPoint,
    ContextSweep,
    shape_of,
    sizes,
)
from tui.fmt import human_bytes, ms
from tui.screens.instrument import InstrumentScreen
from tui.widgets.bar_chart import bar_chart

if TYPE_CHECKING:
    from tui.instruments import AnswerRef, Instruments

CHART_HEIGHT = 6
COLUMN = 8
AXIS = 7
"""Cells per size and for the axis labels in every chart, so the three line up (8 sizes fit 80 columns)."""


def short_time(seconds: float) -> str:
    """At most 7 characters: '20.0 ms', '1504 ms', '12.3 s'."""
    return ms(seconds) if seconds < 10 else f"{seconds:.1f} s"


def short_bytes(n: float) -> str:
    """At most 7 characters: '720 KiB', '94 MiB', '5.6 MiB'."""
    text = human_bytes(n)
    number, unit = text.split()
    return f"{float(number):.0f} {unit}" if float(number) >= 10 else text


def beside(left: list[Content], right: list[Content], width: int, gap: int = 4) -> list[Content]:
    """Two charts side by side when `width` holds both, else one above the other."""
    left_width = max(line.cell_length for line in left)
    if left_width + gap + max(line.cell_length for line in right) > width:
        return [*left, Content(""), *right]
    rows = max(len(left), len(right))
    left = left + [Content("")] * (rows - len(left))
    right = right + [Content("")] * (rows - len(right))
    return [a + " " * (left_width - a.cell_length + gap) + b for a, b in zip(left, right)]


def chart(
    title: str,
    labels: list[str],
    values: list[float | None],
    fmt: Callable[[float], str],
    style: str,
    top: float | None = None,
) -> list[Content]:
    """A titled bar chart with the sizes and axis of every chart here, so they line up."""
    lines = bar_chart(labels, values, fmt, CHART_HEIGHT, style, top=top, column=COLUMN, axis=AXIS)
    return [Content.styled(title, "bold $text-primary"), *lines]


SHORT_PATH = {"compiled step": "compiled", "eager fast path": "eager", "HF forward": "HF"}


COLUMNS = {
    "context": 8,
    "TTFT": 9,
    "per token": 10,
    "ITL": 9,
    "decode": 10,
    "KV/step": 11,
    "of W": 7,
    "cores": 10,
}
"""The measured table's columns and their widths (74 cells: it fits 80 columns)."""


def _table_row(values, style: str = "") -> Content:
    return Content.assemble(*((str(v).rjust(w), style) for v, w in zip(values, COLUMNS.values())))


def _point_values(p: ContextPoint, shape: CacheShape) -> tuple[str, ...]:
    """One size's figures, in the order of COLUMNS."""
    kv = shape.kv_bytes(p.context)
    return (
        f"{p.context:,}",
        ms(p.ttft_s),
        f"{p.ttft_s / p.context * 1e3:.2f} ms",
        ms(p.itl_s),
        SHORT_PATH.get(p.decode_path, p.decode_path),
        human_bytes(kv),
        f"{kv / shape.weight_bytes:.1%}",
        f"{p.cpu_share:.1f} of {p.threads}",
    )


def point_rows(points: list[ContextPoint], shape: CacheShape) -> list[Content]:
    """The measured table: one row per size (74 cells: it fits 80 columns)."""
    lines = [_table_row(COLUMNS, "bold"), *(_table_row(_point_values(p, shape)) for p in points)]
    if len({p.decode_path for p in points}) > 1:
        lines.append(
            Content.styled(
                "The decode step changed during the sweep (the compiled step became ready): "
                "compare ITL only between rows with the same decode step.",
                "$text-warning",
            )
        )
    lines.append(
        Content.styled(
            "per token: TTFT ÷ prompt tokens · KV/step: the cache bytes a decode step reads "
            "(kv · context) · of W: as a share of the weights' bytes · cores: CPU seconds per second",
            "$text-muted",
        )
    )
    return lines


def crossover_lines(this: CacheShape, window: int) -> list[Content]:
    """c* = W / kv for this model and, by the formula, a 7B and a 70B."""
    lines = [
        Content.assemble(
            ("bytes one decode step reads ", "bold"),
            "= W (every weight, once) + kv · c (every cached position's K and V);  ",
            ("c* = W / kv", "bold"),
            ("   kv = 2 · layers · KV heads · head dim · bytes per element", "$text-muted"),
        )
    ]
    beyond = f" (beyond its {window:,}-token window: here the weights dominate every step)"
    lines.append(_crossover(this, beyond if this.crossover is None or this.crossover > window else ""))
    return lines + [_crossover(shape) for shape in (LLAMA_2_7B, LLAMA_2_70B)]


def _crossover(shape: CacheShape, beyond: str = "") -> Content:
    """One model's W, kv and the context c* where its cache outweighs its weights."""
    row = f"{shape.head_dim}·{shape.element_bytes}"
    row = f"({row}+{shape.scale_bytes})" if shape.scale_bytes else row  # an int8 cache's scales
    crossover = "never" if shape.crossover is None else f"{shape.crossover:,} tokens"
    windows = sorted({w for w in shape.windows if w})
    windowed = (
        f" ({shape.windowed_layers} of {shape.layers} layers keep only their last "
        f"{'/'.join(f'{w:,}' for w in windows)}: c* counts what they hold)"
        if windows
        else ""
    )
    return Content.assemble(
        (shape.name + ":", "bold"),
        f" W {human_bytes(shape.weight_bytes)}, kv 2·{shape.layers}·{shape.kv_heads}·"
        f"{row} = {shape.kv_bytes_per_token:,} B/token{windowed} → ",
        (f"c* = {crossover}", "bold $text-accent"),
        beyond,
        (f"  ({shape.source})", "$text-muted"),
    )


def summary(points: list[ContextPoint], shape: CacheShape) -> Content:
    first, last = points[0], points[-1]
    growth = last.context / first.context
    text = (
        f"From {first.context:,} to {last.context:,} tokens ({growth:,.0f}×): TTFT grew "
        f"{last.ttft_s / first.ttft_s:,.1f}× (prefill does work for every prompt token, and attention "
        f"for every pair), ITL {last.itl_s / first.itl_s:,.2f}× (a step reads all weights plus a cache "
        f"that reached {shape.kv_bytes(last.context) / shape.weight_bytes:.0%} of them)."
    )
    return Content(text)


def contention(points: list[ContextPoint]) -> Content | None:
    """A warning when the process got well under its cores: the machine was busy."""
    if not points:
        return None
    share = sum(p.cpu_share for p in points) / len(points)
    threads = points[-1].threads
    if share >= 0.75 * threads:
        return None
    return Content.styled(
        f"⚠ the machine was busy: this process got {share:.1f} of its {threads} cores on average, so "
        "these times are slower than an idle machine's (compare sizes within one run, not runs).",
        "$text-warning",
    )


class ContextScreen(InstrumentScreen):
    INSTRUMENT = "context"
    DEFAULT_CSS = """
    ContextScreen .charts { margin-top: 1; }
    """
    BINDINGS = [
        Binding("escape", "close", "Stop / close"),
        Binding("r", "run", "Run again"),
    ]

    def __init__(self, link: Instruments, step: int | None = None, answer: AnswerRef | None = None) -> None:
        super().__init__(link, step, answer)
        self.shape = shape_of(link.session)
        self.window = link.session.info.window
        self.sizes: list[int] = []
        self.points: list[ContextPoint] = []
        self.running = False
        self.cancel = threading.Event()
        """Set by Esc or closing: the point in progress stops at its next chunk or step."""

    def compose_body(self) -> ComposeResult:
        yield Static(id="intro")
        yield Static(id="status")
        yield Static(id="contention")
        yield Static(id="charts", classes="charts")
        yield Static(id="kv", classes="charts")
        yield Static("Measured", classes="section")
        yield Static(id="table")
        yield Static(id="summary")
        yield Static("When the cache outweighs the weights", classes="section")
        yield Static(Content("\n").join(crossover_lines(self.shape, self.window)), id="crossover")

    def on_mount(self) -> None:
        info = self.link.session.info
        self.set_title_line(f"{info.name} · {info.precision} · {info.device}")
        self.query_one("#intro", Static).update(
            Content.assemble(
                "Prefills 16 … 2,048 tokens (up to the window) into a cache of its own, so the chat's "
                f"cache and turn stay as they are, then decodes {DECODE_STEPS} steps at each size, with "
                "the chat's own forward. ",
                ("r runs again · Esc stops (Esc again closes)", "$text-muted"),
            )
        )
        self.action_run()

    def on_unmount(self) -> None:
        self.cancel.set()

    def action_close(self) -> None:
        if self.running:
            self.cancel.set()
            self._status("stopping at the next chunk or step…")
            return
        self.dismiss()

    def action_run(self) -> None:
        if self.running:
            return
        self.cancel = threading.Event()
        self.points = []
        for old in ("#table", "#summary", "#contention"):  # the last run's; the charts restart empty
            self.query_one(old, Static).update("")
        self.running = True
        self.run_worker(self._sweep(self.cancel), exclusive=True)

    def _status(self, text: str, style: str = "") -> None:
        self.query_one("#status", Static).update(Content.styled(text, style))

    async def _sweep(self, cancel: threading.Event) -> None:
        sweep = ContextSweep()
        started = time.perf_counter()
        try:
            await self._measure_each(sweep, cancel)
        except Exception as e:  # a model switched away, a window too small
            self._status(f"✖ {e}", "$text-error")
            return
        finally:
            self.running = False
            self.link.engine.call(lambda s: sweep.close())  # frees its cache on the inference thread
        self._say_done(time.perf_counter() - started)

    async def _measure_each(self, sweep: ContextSweep, cancel: threading.Event) -> None:
        """Ask the engine for the sizes, then measure them one `engine.call` each, drawing as they come."""
        busy = getattr(self.app, "turns", None) is not None and self.app.turns.busy
        self._status("starting" + (" after the answer in progress…" if busy else "…"), "$text-warning")
        self.sizes = await self.on_engine(self.link.engine.call(lambda s: sizes(s.context)))
        self.draw()
        for i, n in enumerate(self.sizes):
            if cancel.is_set():
                break
            self._status(f"measuring {n:,} tokens ({i + 1} of {len(self.sizes)})…", "$text-warning")
            point = await self.on_engine(self.link.engine.call(lambda s, n=n: sweep.measure(s, n, cancel)))
            if point is None:
                break
            self.points.append(point)
            self.draw()

    def _say_done(self, seconds: float) -> None:
        done = len(self.points)
        if not self.sizes:
            self._status("✖ no size from 16 tokens up fits this chat's context window", "$text-error")
            return
        took = f" in {seconds:.0f} s"
        if done < len(self.sizes):
            self._status(
                f"stopped after {done} of {len(self.sizes)} sizes{took} · r runs again", "$text-muted"
            )
        else:
            last = self.points[-1]
            self._status(
                f"done: {done} sizes{took}; prefill ran the {last.prefill_path}, decode the "
                f"{last.decode_path} · r runs again",
                "$text-success",
            )

    def on_resize(self) -> None:
        if self.sizes:
            self.draw()

    def draw(self) -> None:
        self._draw_charts()
        if self.points:
            self.query_one("#table", Static).update(Content("\n").join(point_rows(self.points, self.shape)))
        if len(self.points) > 1:
            self.query_one("#summary", Static).update(summary(self.points, self.shape))
        warning = contention(self.points)
        self.query_one("#contention", Static).update(warning or "")

    def _draw_charts(self) -> None:
        """TTFT and ITL side by side (where they fit), and the KV bytes a step reads under them."""
        labels = [f"{n:,}" for n in self.sizes]
        measured = {p.context: p for p in self.points}
        ttft = [measured[n].ttft_s if n in measured else None for n in self.sizes]
        itl = [measured[n].itl_s if n in measured else None for n in self.sizes]
        kv = [float(self.shape.kv_bytes(n)) if n in measured else None for n in self.sizes]
        left = chart("Time to first token against prompt length", labels, ttft, short_time, "$text-primary")
        itl_title = f"Inter-token latency against context (median of {DECODE_STEPS} steps)"
        right = chart(itl_title, labels, itl, short_time, "$text-success")
        self.query_one("#charts", Static).update(Content("\n").join(beside(left, right, self.size.width - 4)))
        kv_title = "KV cache bytes each decode step reads (top of the axis: the weights' W)"
        kv_chart = chart(
            kv_title, labels, kv, short_bytes, "$text-warning", top=float(self.shape.weight_bytes)
        )
        self.query_one("#kv", Static).update(Content("\n").join(kv_chart))
