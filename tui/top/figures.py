"""What `llmchat top` shows of a reading, as text: the figure rows, the slots, the header line,
and `top --once --json`'s object. No Textual here: `--once` prints the rows the view shows.

A figure the server does not send says "not reported" (as the chat's panels do); one it sends
but that has nothing to show this poll (no prompt was looked up, the first poll has no rate)
says why, never 0.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from tui.fmt import SPARK, visible_controls

if TYPE_CHECKING:
    from engine.events import ServerInfo
    from engine.remote.server_stats import Reading, Slot, Snapshot

NOT_REPORTED = "not reported"
NO_ANSWER = "—"
"""A figure while the server does not answer (the status line says why)."""


@dataclass(frozen=True)
class Figure:
    """One row of the view: a gauge as the server reports it, or a rate between two polls."""

    key: str
    """Its name in --json and the widget's id."""
    label: str
    value: Callable[[Reading], float | None]
    reported: Callable[[Snapshot], bool]
    """Whether the server sends what this figure is read from."""
    shown: Callable[[float], str]
    idle: str = ""
    """What a reported figure says when this poll has no value (a ratio with nothing to divide)."""
    rate: bool = False
    """Computed between two polls: nothing on the first, nor after a restart."""
    top: float | None = None
    """The top of its history's scale: 1 for a fraction; None scales to the largest value shown."""


def _count(value: float) -> str:
    return f"{value:,.0f}"


def _percent(value: float) -> str:
    return f"{value:.1%}"


def _per_second(value: float) -> str:
    return f"{value:,.1f} tok/s"


def _rate(reading: Reading, name: str) -> float | None:
    return getattr(reading.rates, name) if reading.rates is not None else None


FIGURES = (
    Figure(
        "running", "requests running", lambda r: r.snapshot.running, lambda s: s.running is not None, _count
    ),
    Figure(
        "waiting", "requests waiting", lambda r: r.snapshot.waiting, lambda s: s.waiting is not None, _count
    ),
    Figure(
        "kv_cache",
        "KV cache used",
        lambda r: r.snapshot.kv_fill,
        lambda s: s.kv_fill is not None,
        _percent,
        top=1.0,
    ),
    Figure(
        "prompt_tps",
        "prompt tokens",
        lambda r: _rate(r, "prompt_tps"),
        lambda s: s.prompt_tokens is not None,
        _per_second,
        "a request was cut off",
        rate=True,
    ),
    Figure(
        "generation_tps",
        "generated tokens",
        lambda r: _rate(r, "generation_tps"),
        lambda s: s.generated_tokens is not None,
        _per_second,
        "a request was cut off",
        rate=True,
    ),
    Figure(
        "prefix_cache_hits",
        "prefix cache hits",
        lambda r: _rate(r, "cache_hit_rate"),
        lambda s: s.cache_hits is not None or s.cache_hit_rate is not None,
        _percent,
        "no prompt looked up",
        rate=True,
        top=1.0,
    ),
    Figure(
        "spec_acceptance",
        "drafts accepted",
        lambda r: _rate(r, "spec_acceptance"),
        lambda s: s.draft_tokens is not None and s.accepted_tokens is not None,
        _percent,
        "no drafts",
        rate=True,
        top=1.0,
    ),
    Figure(
        "spec_accept_length",
        "accepted per step",
        lambda r: r.snapshot.accept_length,
        lambda s: s.accept_length is not None,
        lambda v: f"{v:.2f} tokens",
    ),
)


def text(figure: Figure, reading: Reading) -> str:
    """The figure as the view shows it this poll."""
    snapshot = reading.snapshot
    if snapshot.error:
        return NO_ANSWER
    if not figure.reported(snapshot):
        return NOT_REPORTED
    if figure.rate and reading.rates is None:
        return "from the next poll"
    if figure.rate and reading.rates is not None and reading.rates.restarted:
        return "counters restarted"
    value = figure.value(reading)
    return figure.idle if value is None else figure.shown(value)


def history_line(values: Sequence[float | None], width: int, top: float | None = None) -> str:
    """The last `width` polls, one column each, newest on the right: a bar from ▁ (0) to █ (`top`,
    or the largest value shown), a blank where the poll had no value; blank columns lead."""
    shown = list(values)[-width:] if width > 0 else []
    known = [v for v in shown if v is not None]
    scale = top if top is not None else max(known, default=0.0)
    steps = len(SPARK) - 2  # SPARK[0] is the blank; SPARK[1] is 0

    def bar(value: float | None) -> str:
        if value is None:
            return SPARK[0]
        level = round(min(max(value / scale, 0.0), 1.0) * steps) if scale > 0 else 0
        return SPARK[1 + level]

    return "".join(bar(v) for v in shown).rjust(width)


def slot_line(slot: Slot, bar_width: int = 16) -> str:
    """'slot 0  processing   126 / 1,024  ██░░░░'."""
    state = "processing" if slot.processing else "idle"
    filled = round(bar_width * min(slot.held / slot.n_ctx, 1.0))
    bar = "█" * filled + "░" * (bar_width - filled)
    return f"slot {slot.id:<3} {state:<10} {slot.held:>7,} / {slot.n_ctx:<7,} {bar}"


def header(info: ServerInfo) -> list[str]:
    """Which server (version, URL, parallelism), then its model: its own words, control
    characters shown."""
    server = f"{info.kind} {info.version or '(version not reported)'} at {info.url}"
    if info.parallelism:
        server += f" · {info.parallelism}"
    model = f"model {info.model.rsplit('/', 1)[-1]}"
    return [visible_controls(server, one_line=True), visible_controls(model, one_line=True)]


def status(reading: Reading) -> str:
    """The line under the header: why there are no figures, or what the server refused."""
    snapshot = reading.snapshot
    return visible_controls(snapshot.error or "; ".join(snapshot.notes), one_line=True)


def lines(reading: Reading, info: ServerInfo) -> list[str]:
    """`top --once`'s text: the header, the status, a row per figure and one per slot."""
    out = header(info)
    if status(reading):
        out.append(status(reading))
    for figure in FIGURES:
        out.append(f"{figure.label:<20} {text(figure, reading)}")
    if reading.snapshot.kv_source:
        out.append(f"{'':<20} ({visible_controls(reading.snapshot.kv_source, one_line=True)})")
    out += [slot_line(slot) for slot in reading.snapshot.slots or ()]
    return out


def as_json(reading: Reading, info: ServerInfo) -> dict[str, Any]:
    """`top --once --json`: each figure's value (null where not reported or nothing to show) with
    its text, the interval, the slots and the server."""
    figures = {
        figure.key: {"value": _value(figure, reading), "text": text(figure, reading)} for figure in FIGURES
    }
    snapshot = reading.snapshot
    return {
        "server": {"kind": info.kind, "version": info.version, "url": info.url, "model": info.model},
        "interval_s": reading.rates.seconds if reading.rates else None,
        "error": snapshot.error,
        "notes": list(snapshot.notes),
        "figures": figures,
        "kv_source": snapshot.kv_source or None,
        "slots": [asdict(slot) for slot in snapshot.slots] if snapshot.slots is not None else None,
    }


def _value(figure: Figure, reading: Reading) -> float | None:
    if reading.snapshot.error or not figure.reported(reading.snapshot):
        return None
    return figure.value(reading)
