"""What the serving lab screen draws, as pure functions of the lab's data (engine/lab/):
the request timelines, the block map, the step rows, the policy table and the sweep plot."""

from __future__ import annotations

from typing import Sequence

from textual.content import Content
from textual.widgets import Static

from engine.lab.run import bend
from engine.lab.scheduler import RequestView, StepRecord
from engine.lab.sweep import SweepPoint, dips
from engine.lab.verdict import Verdict
from tui.fmt import count, human_bytes, ms
from tui.plot import batching_plot

STATE_MARKS = {
    "queued": ("·", "$text-muted"),
    "prefill": ("▒", "$text-warning"),
    "decode": ("█", "$text-success"),
    "preempted": ("✕", "$text-error"),
    "done": (" ", ""),
}
OWNER_STYLES = (
    "$text-primary",
    "$text-success",
    "$text-warning",
    "$text-accent",
    "$text-error",
    "$text-secondary",
)
OWNER_MARKS = "0123456789abcdefghijklmnopqrstuvwxyz"


def state_at(view: RequestView, t: float) -> str | None:
    """The request's state at clock `t`; None before it arrived."""
    state = None
    for since, name in view.timeline:
        if since > t:
            break
        state = name
    return state


def timeline_lines(views: Sequence[RequestView], clock: float, width: int = 40) -> list[Content]:
    legend = Content.assemble(
        *[
            part
            for name, (mark, style) in STATE_MARKS.items()
            if mark.strip()
            for part in ((mark, style), f" {name}  ")
        ],
        (f"(bar: 0 to {ms(clock)} on the lab's clock)", "$text-muted"),
    )
    return [legend, *(_request_line(v, clock, width) for v in views)]


def _request_line(v: RequestView, clock: float, width: int) -> Content:
    """A request's states over the lab's clock as a bar, then its state now and its times."""
    states = [state_at(v, (i + 0.5) / width * clock) if clock > 0 else None for i in range(width)]
    cells = [STATE_MARKS.get(state, (" ", "")) if state else (" ", "") for state in states]
    ttft = ms(v.ttft_s) if v.ttft_s is not None else "–"
    itl = ms(v.itl_p50_s) if v.itl_p50_s is not None else "–"
    preempted = f"  preempted ×{v.preemptions}" if v.preemptions else ""
    return Content.assemble(
        (f"#{v.id:<2}{v.prompt_tokens:>4} tok ", "bold"),
        "▕",
        *cells,
        "▏ ",
        (f"{v.state:<9}", STATE_MARKS[v.state][1] or "$text-muted"),
        f"{v.generated:>3}/{v.max_new:<3}TTFT {ttft:>8} ITL {itl:>8}{preempted}",
    )


def block_map(
    views: Sequence[RequestView], num_blocks: int, per_row: int = 64, max_rows: int = 4
) -> list[Content]:
    """One cell per block: the owning request's mark (its id in base 36), or · when free. A pool
    larger than `max_rows` rows shows those and counts the rest."""
    owner = {block: v.id for v in views for block in v.blocks}
    shown = min(num_blocks, per_row * max_rows)
    rows = []
    for start in range(0, shown, per_row):
        cells = [_owner_mark(owner.get(block)) for block in range(start, min(num_blocks, start + per_row))]
        rows.append(Content.assemble((f"{start:>4} ", "$text-muted"), *cells))
    if shown < num_blocks:
        held = sum(1 for block in owner if block >= shown)
        more = f"     … {num_blocks - shown:,} more blocks, {held} of them held"
        rows.append(Content.styled(more, "$text-muted"))
    return rows


def _owner_mark(rid: int | None) -> tuple[str, str]:
    """A block's cell: its owner's id in base 36 in the owner's colour, or · when free."""
    if rid is None:
        return ("·", "$text-muted")
    return (OWNER_MARKS[rid % len(OWNER_MARKS)], f"bold {OWNER_STYLES[rid % len(OWNER_STYLES)]}")


def pool_lines(
    pool: dict, views: Sequence[RequestView], contiguous_tokens: int, token_bytes: int
) -> list[Content]:
    used = sum(len(v.blocks) for v in views)
    holders = [v for v in views if v.blocks]
    held_tokens = sum(v.prompt_tokens + v.generated for v in holders)
    reserved = len(holders) * contiguous_tokens * token_bytes
    paged = used * pool["block_bytes"]
    return [
        Content.assemble(
            ("pool ", "bold"),
            f"{pool['blocks']} blocks × {pool['block_size']} tokens = {human_bytes(pool['tensor_bytes'])} "
            f"counted from its tensors; formula {pool['formula']}, × {pool['blocks']} = "
            f"{human_bytes(pool['formula_bytes'])}",
        ),
        Content.assemble(
            ("now ", "bold"),
            f"{count(used, 'block')} held ({human_bytes(paged)}) by {count(len(holders), 'request')} "
            f"for about {count(held_tokens, 'token')}; {count(pool['blocks'] - used, 'block')} free.  ",
            ("contiguous ", "bold"),
            f"a reservation of {contiguous_tokens} tokens (longest prompt + max new) per request would hold "
            f"{human_bytes(reserved)}: {human_bytes(max(0, reserved - paged))} more than the blocks",
        ),
    ]


def step_lines(steps: Sequence[tuple[StepRecord, float]], balance: float | None) -> list[Content]:
    return [
        Content.assemble(
            (f"step {record.index:>4}", "bold"),
            f"  B {record.batch:>2}  tokens {record.tokens:>3} ({record.decode_tokens} decode"
            f" + {record.prefill_tokens} prefill)  {ms(record.seconds):>8}  {record.tok_s:7.1f} tok/s"
            f"  {intensity:6.2f} FLOP/byte  ",
            _bound(intensity, balance),
            (f"  preempted {record.preempted}", "$text-error") if record.preempted else "",
        )
        for record, intensity in steps
    ]


def _bound(intensity: float, balance: float | None) -> tuple[str, str]:
    """Which side of the machine's balance point a step's intensity falls."""
    if balance is None:
        return ("balance point not measured yet (F6 calibrates)", "$text-muted")
    if intensity >= balance:
        return (f"compute-bound (balance {balance:.1f})", "$text-warning")
    return (f"memory-bound (balance {balance:.1f})", "$text-success")


def policy_lines(policies: Sequence[dict]) -> list[Content]:
    header = (
        f"{'policy':<11}{'tok/s':>8}{'TTFT p50':>10}{'TTFT p90':>10}{'ITL p50':>9}{'ITL p90':>9}"
        f"{'blocks':>8}{'paged':>11}{'contiguous':>12}{'preempt':>9}"
    )
    lines = [Content.styled(header + "   (times in ms, peak bytes)", "bold")]
    for p in policies:
        lines.append(
            Content(
                f"{p['policy']:<11}{p['throughput_tok_s']:>8.1f}{p['ttft_ms_p50']:>10.0f}{p['ttft_ms_p90']:>10.0f}"
                f"{p['itl_ms_p50']:>9.1f}{p['itl_ms_p90']:>9.1f}{p['peak_blocks']:>8}"
                f"{human_bytes(p['peak_paged_bytes']):>11}{human_bytes(p['peak_contiguous_bytes']):>12}"
                f"{p['preemptions']:>9}" + ("  busy" if p.get("busy") else "")
            )
        )
    return lines


def pace_line(verdict: Verdict) -> Content:
    """Whether the arrivals or the engine set the pace; where the arrivals did, how to compare."""
    if verdict.arrival_bound:
        return Content.styled(verdict.summary() + "; to compare them: arrivals saturate", "$text-warning")
    return Content.styled(verdict.summary(), "$text-muted")


def sweep_lines(points: Sequence[SweepPoint], skipped: Sequence[int] = ()) -> list[Content]:
    if not points:
        return [Content.styled("(runs after the three policies)", "$text-muted")]
    first = points[0].aggregate_tok_s
    lines = [
        Content.styled(f"{'B':>3}{'aggregate tok/s':>17}{'× B=1':>8}{'ITL p50':>10}{'FLOP/byte':>11}", "bold")
    ]
    for p in points:
        lines.append(
            Content(
                f"{p.batch:>3}{p.aggregate_tok_s:>17.1f}{p.aggregate_tok_s / first:>8.2f}"
                f"{p.itl_ms_p50:>8.1f}ms{p.intensity:>11.2f}{'  busy' if p.busy else ''}"
            )
        )
    if len(points) > 1:
        lines.append(_bend_line(points))
        fell = dips(list(points), bend(list(points)))
        if fell:
            lines.append(
                Content.styled(
                    f"fell at B = {fell}, by the bend: the machine, not batching; run it again", "$warning"
                )
            )
    if skipped:
        lines.append(
            Content.styled(f"left out (the pool cannot hold them): B = {list(skipped)}", "$text-muted")
        )
    return lines


def _bend_line(points: Sequence[SweepPoint]) -> Content:
    at = bend(list(points))
    if at:
        return Content(f"the curve bends at B = {at}: from there a doubling gains less than 1.7×")
    return Content("no bend over these B: every doubling gained 1.7× or more")


class SweepPlot(Static):
    """The sweep's aggregate tok/s against B, as text: ● measured, ○ B × the B=1 rate."""

    PLOT_WIDTH = 60

    def show(self, points: Sequence[SweepPoint]) -> None:
        if not points:
            self.update("")
            return
        xs = [p.batch for p in points]
        ys = [p.aggregate_tok_s for p in points]
        lines = batching_plot(xs, ys, [ys[0] * x for x in xs], width=self.PLOT_WIDTH, height=12)
        self.update(Content("\n".join(lines)))
