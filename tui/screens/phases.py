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
    ticks, labels = _axis(width, balance)
    lines = [Content.assemble(("FLOP/byte ", "bold"), (ticks, "$text-muted"))]
    lines += [_phase_point(m, peaks, width, balance) for m in measures]
    lines.append(Content.assemble(" " * 10, (labels, "$text-muted")))
    lines.append(
        Content.assemble(
            " " * 10,
            ("┃", "bold"),
            f" balance point {peaks.balance:,.1f} FLOP/byte: left of it a phase waits on memory, "
            "right of it on arithmetic",
        )
    )
    return lines


def _axis(width: int, balance: int) -> tuple[str, str]:
    """The axis's ticks, one a decade with the balance point marked, and the labels under them."""
    ticks = [" "] * width
    labels = [" "] * (width + 8)
    for value in (0.1, 1, 10, 100, 1000, 10_000):
        col = axis_column(value, width)
        ticks[col] = "┼"
        for i, ch in enumerate(f"{value:g}"):
            if col + i < len(labels):
                labels[col + i] = ch
    ticks[balance] = "┃"
    return "".join(ticks), "".join(labels).rstrip()


def _phase_point(m: PhaseMeasure, peaks: Calibration, width: int, balance: int) -> Content:
    """A phase's row: its point on the axis, joined to the balance point by a line."""
    col = axis_column(m.intensity, width)
    row = [" "] * width
    for i in range(min(col, balance) + 1, max(col, balance)):
        row[i] = "─"
    row[balance] = "┃"
    style = "$text-success" if m.bound(peaks) == "compute" else "$text-warning"
    return Content.assemble(
        (f"{m.phase:<10}", "bold"),
        ("".join(row[:col]), "$text-muted"),
        ("●", f"bold {style}"),
        ("".join(row[col + 1 :]), "$text-muted"),
        (f" {m.intensity:,.1f}", style),
    )


def column_name(m: PhaseMeasure) -> str:
    """A decode column's figures are for one step (its median), a prefill's for the whole pass."""
    return "decode, per step" if m.phase == "decode" else m.phase


def per(m: PhaseMeasure) -> str:
    return " /step" if m.phase == "decode" else ""


COLUMN = 22
"""The width of a phase's column in the table."""


def _table_row(name: str, values: list[str]) -> Content:
    return Content.assemble((name.ljust(24), "bold"), *(v.rjust(COLUMN) for v in values))


def measure_rows(turn: TurnPhases, peaks: Calibration | None) -> list[Content]:
    measures = [m for m in (turn.prefill, turn.decode) if m is not None]
    row = _table_row
    lines = [
        Content.assemble(("".ljust(24), ""), *((column_name(m).rjust(COLUMN), "bold") for m in measures)),
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
    if turn.decode is None and turn.step_path == "step mode":
        lines.append(
            Content.styled(
                "decode not timed: a step-mode answer (each token went through the gate)", "$text-muted"
            )
        )
    return lines + (_peak_rows(measures, peaks) if peaks is not None else [])


def _peak_rows(measures: list[PhaseMeasure], peaks: Calibration) -> list[Content]:
    """The rows measured against the machine's peaks: the share of each, and which roof is over it."""
    row = _table_row
    return [
        row("  of peak FLOP/s", [_share(m.compute_use(peaks)) for m in measures]),
        row("  of peak bandwidth", [_share(m.memory_use(peaks)) for m in measures]),
        row("roofline allows", [si(m.attainable_flop_s(peaks), "FLOP/s") for m in measures]),
        Content.assemble(
            ("under the roof of".ljust(24), "bold"),
            *(
                (ROOF_NAMES[m.bound(peaks)].rjust(COLUMN), "bold " + ROOF_STYLES[m.bound(peaks)])
                for m in measures
            ),
        ),
        Content.assemble(
            ("  reached of that roof".ljust(24), "bold"),
            *((_share(m.roof_use(peaks)).rjust(COLUMN), LIMIT_STYLES[m.limit(peaks)]) for m in measures),
        ),
    ]


def _share(fraction: float) -> str:
    """A share of a measured peak; past it, a pointer to the verdict, which says why (a share over
    100% of a roof reads as a wrong roof)."""
    return f"{fraction:.1%}" if fraction <= 1 else "above it: see below"


ROOF_NAMES = {"compute": "compute (FLOP/s)", "memory": "memory (bytes/s)"}
ROOF_STYLES = {"compute": "$text-success", "memory": "$text-warning"}
LIMIT_STYLES = {"roof": "bold $text-success", "below": "", "neither": "bold $text-error"}
HOW = {
    "roof": "near the roof: this roof is what limits it.",
    "below": "well under the roof: the roof is not what limits it yet.",
    "neither": "far from both roofs: neither arithmetic nor memory limits it.",
}
"""What limits a phase, by how near it came to its roof (`PhaseMeasure.limit`)."""


def phase_verdict(m: PhaseMeasure, peaks: Calibration) -> Content:
    """Which roof the phase is under, how far from it, and what limits it."""
    name = "decode, per step" if m.phase == "decode" else "prefill, the whole pass"
    side = "≥" if m.bound(peaks) == "compute" else "<"
    return Content.assemble(
        (f"{name}: ", "bold"),
        f"{m.intensity:,.1f} FLOP/B {side} balance {peaks.balance:,.1f}, so {_roof(m, peaks)}, ",
        (_reached(m.roof_use(peaks)), LIMIT_STYLES[m.limit(peaks)] or "bold"),
        f": {_what_limits(m, peaks)}",
    )


def _reached(fraction: float) -> str:
    return f"{fraction:.1%} of it" if fraction <= 1 else f"{fraction - 1:.0%} above it"


def _roof(m: PhaseMeasure, peaks: Calibration) -> str:
    """The phase's roof and what it reached against it."""
    if m.bound(peaks) == "compute":
        return (
            f"its roof is compute, {si(peaks.matmul_flop_s, 'FLOP/s')}; it reached {si(m.flop_s, 'FLOP/s')}"
        )
    return (
        f"its roof is memory, {human_bytes(peaks.bandwidth_bytes_s)}/s; it moved {human_bytes(m.bytes_s)}/s"
    )


def _what_limits(m: PhaseMeasure, peaks: Calibration) -> str:
    if m.roof_use(peaks) <= 1:
        return HOW[m.limit(peaks)]
    # w8's 129 MiB a step can come partly from a large last-level cache
    if m.bound(peaks) == "memory":
        return (
            "above the measured roof: part of what it read came from the chip's caches, which are "
            "faster than memory (or the calibration ran slow: c measures again)."
        )
    return (
        f"above the measured roof: faster than the calibration's {peaks.dtype} matmul ran "
        "(another kernel or number type computes more a second; c measures again)."
    )


def verdict(turn: TurnPhases, peaks: Calibration) -> list[Content]:
    measures = [m for m in (turn.prefill, turn.decode) if m is not None]
    out = [phase_verdict(m, peaks) for m in measures]
    far = [m for m in measures if m.limit(peaks) == "neither"]
    if far:
        which = "Both phases" if len(far) == len(measures) and len(far) > 1 else f"The {far[0].phase}"
        out.append(Content.styled(_far_from_roofs(which), "$text-muted"))
    warnings = (_slower_step(turn), _busy_turn(turn), _busy_calibration(peaks))
    return out + [Content.styled(w, "bold $text-warning") for w in warnings if w]


def _far_from_roofs(which: str) -> str:
    return (
        f"{which} stayed under {FAR_FROM_ROOF:.0%} of both roofs: the time goes to fixed costs per "
        "pass (Python, launching each small op, the sampler, threads waking up) or to other work "
        "on the machine, not to arithmetic or memory traffic. A bigger model or a longer prompt "
        "does more work per pass and moves a phase toward its roof."
    )


def _slower_step(turn: TurnPhases) -> str | None:
    if turn.decode is None or turn.step_path not in SLOWER_STEPS:
        return None
    return (
        f"⚠ This answer was decoded on the {SLOWER_STEPS[turn.step_path]}, not the compiled "
        "step (still being built, turned off, or not for this model): decode's rates are "
        "that slower step's."
    )


def _busy_turn(turn: TurnPhases) -> str | None:
    contention = turn.contention
    if contention is None or not contention.busy:
        return None
    return (
        f"⚠ This turn ran on a busy machine ({contention.figures()}): "
        "its times include waiting for a core, so the rates above are lower than the model's own."
    )


def _busy_calibration(peaks: Calibration) -> str | None:
    if not peaks.busy:
        return None
    return (
        "⚠ The calibration ran on a busy machine: the peaks are low, so the fractions are high. "
        "Press c when the machine is quieter."
    )


def machine_line(peaks: Calibration) -> Content:
    """The peaks: each the median of several runs, with their range."""
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(peaks.measured_at))
    return Content.assemble(
        ("machine ", "bold"),
        f"{peaks.device}, {peaks.dtype}, {peaks.threads} threads: peak matmul ",
        (si(peaks.matmul_flop_s, "FLOP/s"), "bold"),
        " · bandwidth ",
        (human_bytes(peaks.bandwidth_bytes_s) + "/s", "bold"),
        f" · balance {peaks.balance:,.1f} FLOP/B",
        "\n",
        (
            f"  {_spread(peaks)} (measured {when}; c measures again)",
            "$text-warning" if peaks.busy else "$text-muted",
        ),
    )


def _spread(peaks: Calibration) -> str:
    """The range of the calibration's runs."""
    if not peaks.matmul_runs:
        return "one run, saved before spreads were kept"
    flops, reads = Spread.of(peaks.matmul_runs), Spread.of(peaks.bandwidth_runs)
    spread = (
        f"median of {flops.runs} runs · matmul {si(flops.low, 'FLOP/s')} to {si(flops.high, 'FLOP/s')}"
        f" · bandwidth {human_bytes(reads.low)}/s to {human_bytes(reads.high)}/s"
    )
    if peaks.cpu_share is not None:
        spread += f" · CPU share {peaks.cpu_share:.0%}"
    return spread


def model_line(s: ModelShape) -> Content:
    """The work the model's shape sets per token: weights, bytes read per pass (and the LM head's
    share of them: with a large vocabulary, most), K/V per token."""
    return Content.assemble(
        ("model ", "bold"),
        f"P = {s.matmul_params:,} weights per token in {s.layers} layers ",
        ("(2·P FLOPs per token)", "$text-muted"),
        f" · LM head {s.head_params:,} · W = {human_bytes(s.streamed_weight_bytes)} "
        f"read per pass{_head_share(s)} · KV {s.kv_bytes_per_token:,} B/token",
    )


def _head_share(s: ModelShape) -> str:
    """', the LM head 671 MB of it (63%, 262,144 entries)': what a step's bytes go to."""
    if not s.head_bytes or not s.streamed_weight_bytes:
        return ""
    share = s.head_bytes / s.streamed_weight_bytes
    return f", the LM head {human_bytes(s.head_bytes)} of it ({share:.0%}, {s.vocab:,} entries)"


class PhasesScreen(InstrumentScreen):
    INSTRUMENT = "phases"
    BINDINGS = [Binding("c", "calibrate", "Calibrate again"), Binding("x", "context", "Context sweep")]

    def __init__(self, link: Instruments, step: int | None = None, answer: AnswerRef | None = None) -> None:
        super().__init__(link, step, answer)
        self.peaks: Calibration | None = None
        self.shape = ModelShape.of(link.session.loaded, link.session.info)

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
        self.set_title_line(f"{info.name} · {info.precision} · {info.device}")
        self.query_one("#model", Static).update(model_line(self.shape))
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
        plain = link.plain.plain_for(info, path) or link.plain.plain_for(info, "compiled")
        k = getattr(link.app, "speculation", (None, 4))[1]
        lines = verify_lines(self.shape, k, stats, measured_rounds(link.spec_rounds), plain)
        self.query_one("#verify", Static).update(Content("\n").join(lines))

    def draw(self) -> None:
        self.draw_verify()
        peaks = self.peaks
        if peaks is not None:
            self.query_one("#machine", Static).update(machine_line(peaks))
        turn = self._last_turn()
        if turn is None:
            return
        self.query_one("#table", Static).update(Content("\n").join(measure_rows(turn, peaks)))
        if peaks is not None:
            width = max(30, min(80, self.size.width - 24))
            measures = [m for m in (turn.prefill, turn.decode) if m is not None]
            self.query_one("#roofline", Static).update(Content("\n").join(roofline(measures, peaks, width)))
            self.query_one("#verdict", Static).update(Content("\n").join(verdict(turn, peaks)))

    def _last_turn(self) -> TurnPhases | None:
        """The last turn's phases, or None (and the table says why) when there is nothing to measure."""
        stats = self.link.last_stats
        if stats is None:
            why = "No finished turn yet: send a prompt; this view fills in when the answer ends."
        elif (turn := turn_phases(self.shape, stats)).prefill is None and turn.decode is None:
            why = "The last turn had nothing to measure (no prefill, under two tokens)."
        else:
            return turn
        self.query_one("#table", Static).update(Content.styled(why, "$text-muted"))
        return None

    def engine_said(self, event: Event) -> None:
        if isinstance(event, TurnFinished):
            self.draw()
