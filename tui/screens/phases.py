"""Two phases, measured: the last turn's prefill and decode against this machine's calibrated peaks.

The work (FLOPs, bytes) is counted from the model's shape (engine/instruments/phases.py),
the times come from the turn's `TurnStats`, and the peaks from a short calibration run once
on the inference thread and cached on disk (`c` measures again).
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from textual.app import ComposeResult
from textual.binding import Binding
from textual.content import Content
from textual.widgets import Static

from engine.events import Event, TurnFinished
from engine.instruments import phases
from engine.instruments.phases import (
    FAR_FROM_ROOF,
    Calibration,
    ModelShape,
    PhaseMeasure,
    Spread,
    TurnPhases,
    turn_phases,
)
from engine.instruments.verify_cost import measured_rounds
from tui.fmt import SLOWER_STEPS, human_bytes, ms, si
from tui.screens.instrument import InstrumentScreen
from tui.screens.phases_verify import verify_lines

if TYPE_CHECKING:
    from tui.instruments import AnswerRef, Instruments

SCALE = (0.1, 10_000.0)
"""FLOPs per byte at the two ends of the intensity axis (log scale)."""


def axis_column(intensity: float, width: int) -> int:
    low, high = (math.log10(v) for v in SCALE)
    x = (math.log10(max(intensity, SCALE[0])) - low) / (high - low)
    return max(0, min(width - 1, round(x * (width - 1))))


def roofline(measures: list[PhaseMeasure], peaks: Calibration, width: int) -> list[Content]:
    """Each phase's arithmetic intensity on a log axis, with the machine's balance point."""
    balance = axis_column(peaks.balance, width)
    ticks = [" "] * width
    labels = [" "] * (width + 8)
    for value in (0.1, 1, 10, 100, 1000, 10_000):
        col = axis_column(value, width)
        ticks[col] = "┼"
        for i, ch in enumerate(f"{value:g}"):
            if col + i < len(labels):
                labels[col + i] = ch
    ticks[balance] = "┃"
    lines = [Content.assemble(("FLOP/byte ", "bold"), ("".join(ticks), "$text-muted"))]
    for m in measures:
        col = axis_column(m.intensity, width)
        row = [" "] * width
        for i in range(min(col, balance) + 1, max(col, balance)):
            row[i] = "─"
        row[balance] = "┃"
        style = "$text-success" if m.bound(peaks) == "compute" else "$text-warning"
        lines.append(
            Content.assemble(
                (f"{m.phase:<10}", "bold"),
                ("".join(row[:col]), "$text-muted"),
                ("●", f"bold {style}"),
                ("".join(row[col + 1 :]), "$text-muted"),
                (f" {m.intensity:,.1f}", style),
            )
        )
    lines.append(Content.assemble(" " * 10, ("".join(labels).rstrip(), "$text-muted")))
    lines.append(
        Content.assemble(
            " " * 10,
            ("┃", "bold"),
            f" balance point {peaks.balance:,.1f} FLOP/byte: left of it a phase waits on memory, "
            "right of it on arithmetic",
        )
    )
    return lines


def column_name(m: PhaseMeasure) -> str:
    """A decode column's figures are for one step (its median), a prefill's for the whole pass."""
    return "decode, per step" if m.phase == "decode" else m.phase


def per(m: PhaseMeasure) -> str:
    return " /step" if m.phase == "decode" else ""


def measure_rows(turn: TurnPhases, peaks: Calibration | None) -> list[Content]:
    measures = [m for m in (turn.prefill, turn.decode) if m is not None]
    width = 22
    head = Content.assemble(("".ljust(24), ""), *((column_name(m).rjust(width), "bold") for m in measures))

    def row(name: str, values: list[str]) -> Content:
        return Content.assemble((name.ljust(24), "bold"), *(v.rjust(width) for v in values))

    lines = [
        head,
        row("tokens", [f"{m.tokens:,}" + (" new" if m.phase == "prefill" else " steps") for m in measures]),
        row(
            "time",
            [ms(m.seconds) + (" (whole pass)" if m.phase == "prefill" else " (median)") for m in measures],
        ),
        row("FLOPs", [si(m.flops, "FLOP") + per(m) for m in measures]),
        row("bytes moved", [human_bytes(m.bytes) + per(m) for m in measures]),
        row("arithmetic intensity", [f"{m.intensity:,.1f} FLOP/B" for m in measures]),
        row("achieved compute", [si(m.flop_s, "FLOP/s") for m in measures]),
        row("achieved bandwidth", [human_bytes(m.bytes_s) + "/s" for m in measures]),
    ]
    if peaks is not None:
        lines += [
            row("  of peak FLOP/s", [f"{m.compute_use(peaks):.1%}" for m in measures]),
            row("  of peak bandwidth", [f"{m.memory_use(peaks):.1%}" for m in measures]),
            row("roofline allows", [si(m.attainable_flop_s(peaks), "FLOP/s") for m in measures]),
        ]
        roofs = [ROOF_NAMES[m.bound(peaks)] for m in measures]
        lines.append(
            Content.assemble(
                ("under the roof of".ljust(24), "bold"),
                *((r.rjust(width), "bold " + ROOF_STYLES[m.bound(peaks)]) for r, m in zip(roofs, measures)),
            )
        )
        lines.append(
            Content.assemble(
                ("  reached of that roof".ljust(24), "bold"),
                *((f"{m.roof_use(peaks):.1%}".rjust(width), LIMIT_STYLES[m.limit(peaks)]) for m in measures),
            )
        )
    return lines


ROOF_NAMES = {"compute": "compute (FLOP/s)", "memory": "memory (bytes/s)"}
ROOF_STYLES = {"compute": "$text-success", "memory": "$text-warning"}
LIMIT_STYLES = {"roof": "bold $text-success", "below": "", "neither": "bold $text-error"}


def phase_verdict(m: PhaseMeasure, peaks: Calibration) -> Content:
    """Which roof the phase is under, how far from it, and what limits it."""
    name = "decode, per step" if m.phase == "decode" else "prefill, the whole pass"
    side = "≥" if m.bound(peaks) == "compute" else "<"
    if m.bound(peaks) == "compute":
        roof = (
            f"its roof is compute, {si(peaks.matmul_flop_s, 'FLOP/s')}; it reached {si(m.flop_s, 'FLOP/s')}"
        )
    else:
        roof = (
            f"its roof is memory, {human_bytes(peaks.bandwidth_bytes_s)}/s; "
            f"it moved {human_bytes(m.bytes_s)}/s"
        )
    how = {
        "roof": "near the roof: this roof is what limits it.",
        "below": "well under the roof: the roof is not what limits it yet.",
        "neither": "far from both roofs: neither arithmetic nor memory limits it.",
    }[m.limit(peaks)]
    if m.roof_use(peaks) > 1:  # w8's 129 MiB a step can come partly from a large last-level cache
        how = (
            "above the measured roof: part of what it read came from the chip's caches, which are "
            "faster than memory (or the calibration ran slow: c measures again)."
            if m.bound(peaks) == "memory"
            else f"above the measured roof: faster than the calibration's {peaks.dtype} matmul ran "
            "(another kernel or number type computes more a second; c measures again)."
        )
    return Content.assemble(
        (f"{name}: ", "bold"),
        f"{m.intensity:,.1f} FLOP/B {side} balance {peaks.balance:,.1f}, so {roof}, ",
        (f"{m.roof_use(peaks):.1%} of it", LIMIT_STYLES[m.limit(peaks)] or "bold"),
        f": {how}",
    )


def verdict(turn: TurnPhases, peaks: Calibration) -> list[Content]:
    measures = [m for m in (turn.prefill, turn.decode) if m is not None]
    out = [phase_verdict(m, peaks) for m in measures]
    far = [m for m in measures if m.limit(peaks) == "neither"]
    if far:
        which = "Both phases" if len(far) == len(measures) and len(far) > 1 else f"The {far[0].phase}"
        out.append(
            Content.styled(
                f"{which} stayed under {FAR_FROM_ROOF:.0%} of both roofs: the time goes to fixed costs per "
                "pass (Python, launching each small op, the sampler, threads waking up) or to other work "
                "on the machine, not to arithmetic or memory traffic. A bigger model or a longer prompt "
                "does more work per pass and moves a phase toward its roof.",
                "$text-muted",
            )
        )
    if turn.decode is not None and turn.step_path in SLOWER_STEPS:
        out.append(
            Content.styled(
                f"⚠ This answer was decoded on the {SLOWER_STEPS[turn.step_path]}, not the compiled "
                "step (still being built, turned off, or not for this model): decode's rates are "
                "that slower step's.",
                "bold $text-warning",
            )
        )
    contention = turn.contention
    if contention is not None and contention.busy:
        out.append(
            Content.styled(
                f"⚠ This turn ran on a busy machine ({contention.figures()}): "
                "its times include waiting for a core, so the rates above are lower than the model's own.",
                "bold $text-warning",
            )
        )
    if peaks.busy:
        out.append(
            Content.styled(
                "⚠ The calibration ran on a busy machine: the peaks are low, so the fractions are high. "
                "Press c when the machine is quieter.",
                "bold $text-warning",
            )
        )
    return out


def machine_line(peaks: Calibration) -> Content:
    """The peaks: each the median of several runs, with their range."""
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(peaks.measured_at))
    if peaks.matmul_runs:
        flops, reads = Spread.of(peaks.matmul_runs), Spread.of(peaks.bandwidth_runs)
        spread = (
            f"median of {flops.runs} runs · matmul {si(flops.low, 'FLOP/s')} to {si(flops.high, 'FLOP/s')}"
            f" · bandwidth {human_bytes(reads.low)}/s to {human_bytes(reads.high)}/s"
        )
        if peaks.cpu_share is not None:
            spread += f" · CPU share {peaks.cpu_share:.0%}"
    else:
        spread = "one run, saved before spreads were kept"
    return Content.assemble(
        ("machine ", "bold"),
        f"{peaks.device}, {peaks.dtype}, {peaks.threads} threads: peak matmul ",
        (si(peaks.matmul_flop_s, "FLOP/s"), "bold"),
        " · bandwidth ",
        (human_bytes(peaks.bandwidth_bytes_s) + "/s", "bold"),
        f" · balance {peaks.balance:,.1f} FLOP/B",
        "\n",
        (f"  {spread} (measured {when}; c measures again)", "$text-warning" if peaks.busy else "$text-muted"),
    )


class PhasesScreen(InstrumentScreen):
    INSTRUMENT = "phases"
    BINDINGS = [Binding("c", "calibrate", "Calibrate again"), Binding("x", "context", "Context sweep")]

    def __init__(self, link: Instruments, step: int | None = None, answer: AnswerRef | None = None) -> None:
        super().__init__(link, step, answer)
        self.peaks: Calibration | None = None
        self.shape = ModelShape.of(link.session.loaded)

    def compose_body(self) -> ComposeResult:
        yield Static(id="model")
        yield Static(id="machine")
        yield Static("The last turn", classes="section")
        yield Static(id="table")
        yield Static("Where each phase sits", classes="section")
        yield Static(id="roofline")
        yield Static(id="verdict")
        yield Static("Speculative decoding: why a verify pass costs about one step", classes="section")
        yield Static(id="verify")

    def on_mount(self) -> None:
        info = self.link.session.info
        s = self.shape
        self.set_title_line(f"{info.name} · {info.precision} · {info.device}")
        self.query_one("#model", Static).update(
            Content.assemble(
                ("model ", "bold"),
                f"P = {s.matmul_params:,} weights per token in {s.layers} layers ",
                ("(2·P FLOPs per token)", "$text-muted"),
                f" · LM head {s.head_params:,} · W = {human_bytes(s.streamed_weight_bytes)} "
                f"read per pass · KV {s.kv_bytes_per_token:,} B/token",
            )
        )
        self.peaks = phases.cached_calibration(info.device, phases.dtype_of(info.compute_dtype))
        if self.peaks is None:
            self.action_calibrate()
        self.draw()

    def action_context(self) -> None:
        """The context experiment: TTFT and ITL at 16 ... 2,048 tokens (tui/screens/context.py)."""
        self.link.open("context")

    def action_calibrate(self) -> None:
        info = self.link.session.info
        self.query_one("#machine", Static).update(
            Content.styled(
                f"measuring this machine's peak matmul FLOP/s and memory bandwidth, "
                f"{phases.CALIBRATION_RUNS} runs each (a few seconds, once; then cached)…",
                "$text-warning",
            )
        )
        self.run_worker(
            self._calibrate(info.device, info.compute_dtype, refresh=self.peaks is not None),
            exclusive=True,
        )

    async def _calibrate(self, device: str, dtype_name: str, refresh: bool) -> None:
        try:
            self.peaks = await self.on_engine(
                self.link.engine.call(
                    lambda s: phases.calibrate(device, phases.dtype_of(dtype_name), refresh=refresh)
                )
            )
        except Exception as e:
            self.query_one("#machine", Static).update(
                Content.styled(f"✖ calibration failed: {e}", "$text-error")
            )
            return
        self.draw()

    def draw_verify(self) -> None:
        """The verify pass against a decode step (tui/screens/phases_verify.py), kept apart from the
        measurements: counted always, timed from this session's rounds and plain answers."""
        link = self.link
        info = link.session.info
        stats = link.last_stats
        path = stats.step_path if stats is not None and stats.speculative else "fused"
        plain = link.plain.plain_for(info, path) or link.plain.newest(info)
        k = getattr(link.app, "speculation", (None, 4))[1]
        lines = verify_lines(self.shape, k, stats, measured_rounds(link.spec_rounds), plain)
        self.query_one("#verify", Static).update(Content("\n").join(lines))

    def draw(self) -> None:
        self.draw_verify()
        peaks = self.peaks
        if peaks is not None:
            self.query_one("#machine", Static).update(machine_line(peaks))
        stats = self.link.last_stats
        if stats is None:
            self.query_one("#table", Static).update(
                Content.styled(
                    "No finished turn yet: send a prompt; this view fills in when the answer ends.",
                    "$text-muted",
                )
            )
            return
        turn = turn_phases(self.shape, stats)
        if turn.prefill is None and turn.decode is None:
            self.query_one("#table", Static).update(
                Content.styled(
                    "The last turn had nothing to measure (no prefill, under two tokens).", "$text-muted"
                )
            )
            return
        self.query_one("#table", Static).update(Content("\n").join(measure_rows(turn, peaks)))
        if peaks is not None:
            width = max(30, min(80, self.size.width - 24))
            measures = [m for m in (turn.prefill, turn.decode) if m is not None]
            self.query_one("#roofline", Static).update(Content("\n").join(roofline(measures, peaks, width)))
            self.query_one("#verdict", Static).update(Content("\n").join(verdict(turn, peaks)))

    def engine_said(self, event: Event) -> None:
        if isinstance(event, TurnFinished):
            self.draw()
