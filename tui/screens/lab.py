"""The serving lab (F9): continuous batching over a paged KV cache, live, on the loaded model.

The run goes to the inference thread through `engine.call` (engine/lab/run.py). Its callbacks
only store the newest data (the request views, the last steps, finished policies, sweep
points); a timer on the UI thread draws whatever is newest four times a second, so a fast
lab never floods the screen. Esc (closing the screen) sets the stop event: the run ends at
its next step and the pool is dropped. The chat's own KV cache is never touched; the chat's
next answer waits until the lab is done.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import TYPE_CHECKING

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.content import Content
from textual.widgets import Button, Input, Label, Select, Static

from engine.instruments import phases
from engine.instruments.explain import explain
from engine.lab.run import Lab, LabConfig, LabError, PolicyResult, run
from engine.lab.scheduler import LabStopped, RequestView, StepRecord
from engine.lab.sweep import SweepPoint
from tui.fmt import plain_text
from tui.screens.instrument import InstrumentScreen
from tui.widgets import lab_views
from tui.widgets.explanation import ExplanationPanel

if TYPE_CHECKING:
    from tui.instruments import AnswerRef, Instruments

VIEWS = ("timeline", "pool", "steps", "policies", "sweep")
FIELDS = (("users", "requests", 8), ("max B", "max_batch", 4), ("pool MiB", "budget_mib", 48))
"""(label, LabConfig field, default): short labels, so the row fits 80 columns."""
SATURATE = "saturate"
"""The arrivals choice that serves LabConfig.saturating(): 4 x max B users at once, answers 1-64."""


def done_line(outputs_agree: bool) -> str:
    """The status once the lab is done: whether every policy gave every request the same tokens."""
    agree = "the same tokens" if outputs_agree else "different tokens (a near tie in the numerics)"
    return f"done: every policy gave {agree} for every request · the pool is freed · r runs again"


class LabScreen(InstrumentScreen):
    INSTRUMENT = "lab"
    DEFAULT_CSS = """
    LabScreen #controls { height: auto; margin-top: 1; }
    LabScreen #controls > Label { padding: 0 1 0 0; }
    LabScreen #controls > Input { width: 8; }
    LabScreen #controls > Select { width: 12; }
    LabScreen #controls > Button { margin-left: 1; min-width: 9; }
    """
    BINDINGS = [Binding("r", "run", "Run")]

    def __init__(self, link: Instruments, step: int | None = None, answer: AnswerRef | None = None) -> None:
        super().__init__(link, step, answer)
        self.stop = threading.Event()
        """Set when the screen closes: the lab ends at its next step and frees its pool."""
        self.lab: Lab | None = None
        self.running = False
        self.result = None
        """The finished run's LabResult (None until one finishes)."""
        self._policy = ""
        self._views: tuple[RequestView, ...] = ()
        self._clock = 0.0
        self._steps: deque[tuple[StepRecord, float]] = deque(maxlen=6)
        self._policies: list[dict] = []
        self._sweep: list[SweepPoint] = []
        self._version = self._drawn = 0
        self.balance: float | None = None
        """The machine's balance point (FLOP per byte) from the phases instrument's calibration."""

    # -- layout ----------------------------------------------------------------------------
    def compose_body(self) -> ComposeResult:
        yield Static(
            "Simulated users send real questions to the loaded model; the same workload is served one at a "
            "time, in static batches and with continuous batching, then decode is swept over B. "
            "A teaching instrument at classroom scale, not a serving path (llmchat --server serves for real)."
        )
        yield from self._controls()
        yield Static(id="status", classes="muted")
        yield from self._view_sections()

    def _controls(self) -> ComposeResult:
        """The workload's fields, how requests arrive, and Run."""
        with Horizontal(id="controls"):
            for label, name, default in FIELDS:
                yield Label(f" {label}")
                yield Input(str(default), id=name, type="number", compact=True)
            yield Label(" arrivals")
            yield Select(
                [("poisson", "poisson"), ("at once", "once"), ("saturate", SATURATE)],
                value="poisson",
                allow_blank=False,
                id="arrivals",
                compact=True,
            )
            yield Button("Run r", id="run", variant="primary", compact=True)

    def _view_sections(self) -> ComposeResult:
        """Each view under its title and its explanation (closed until ?), then the sweep's plot."""
        titles = {
            "timeline": "Requests",
            "pool": "The paged KV pool: one cell per block (the owner's id; · free)",
            "steps": "Last steps",
            "policies": "Three policies, same workload",
            "sweep": "Decode sweep: B sequences per step",
        }
        for view in VIEWS:
            yield Static(titles[view], id=f"{view}-title", classes="section")
            yield ExplanationPanel(explain(f"lab.{view}"), id=f"{view}-explain")
            yield Static(id=view)
        yield lab_views.SweepPlot(id="plot")

    def on_mount(self) -> None:
        options = getattr(self.app, "options", None)
        for _, name, _ in FIELDS:
            self.query_one(f"#{name}", Input).cursor_blink = (
                options.cursor_blink if options is not None else True
            )
        self.query_one("#run", Button).focus()
        self.set_title_line(f"{self.link.session.info.name} at {self.link.session.info.precision}")
        self._status("set the workload and press r (or the button); Esc stops the lab and frees its pool")
        self.set_interval(0.25, self._draw)

    def on_unmount(self) -> None:
        self.stop.set()

    def action_explain(self) -> None:
        """? opens the lab's explanation and each view's, in place (and closes them)."""
        super().action_explain()
        main = self.query_one(ExplanationPanel)
        for view in VIEWS:
            panel = self.query_one(f"#{view}-explain", ExplanationPanel)
            if panel.is_open != main.is_open:
                panel.toggle()

    def _status(self, text: str) -> None:
        self.query_one("#status", Static).update(plain_text(text))  # it may carry an error's words

    # -- running ----------------------------------------------------------------------------
    def config(self) -> LabConfig:
        """The form as a LabConfig; LabError (or ValueError) says what is wrong."""
        values = {}
        for label, name, _ in FIELDS:
            text = self.query_one(f"#{name}", Input).value.strip()
            try:
                values[name] = float(text) if name == "budget_mib" else int(text)
            except ValueError:
                raise LabError(f"{label} must be a number, got {text!r}") from None
        arrivals = str(self.query_one("#arrivals", Select).value)
        if arrivals == SATURATE:
            return LabConfig(**values).saturating()
        config = LabConfig(**values, arrivals=arrivals)
        config.workload  # checks the workload's own fields
        return config

    @on(Button.Pressed, "#run")
    @on(Input.Submitted)
    def action_run(self) -> None:
        if self.running:
            self._status("the lab is running; Esc stops it")
            return
        try:
            config = self.config()
        except ValueError as e:
            self._status(f"✖ {e}")
            return
        self.query_one("#requests", Input).value = str(config.requests)  # saturate sets the users
        self.running, self.result = True, None
        self._policies, self._sweep, self._views, self._policy = [], [], (), ""
        self._steps.clear()
        self._touch()
        busy = getattr(self.app, "turns", None) is not None and self.app.turns.busy
        self._status("starting" + (" after the answer in progress…" if busy else "…"))
        self.run_worker(self._run(config), exclusive=True)

    async def _run(self, config: LabConfig) -> None:
        info = self.link.session.info
        peaks = phases.cached_calibration(info.device, phases.dtype_of(info.compute_dtype))
        self.balance = peaks.balance if peaks is not None else None
        try:
            self.result = await self.on_engine(self.link.engine.call(self._lab_run(config, peaks)))
        except LabStopped:
            return
        except ValueError as e:  # LabError, PoolError: the budget, the model
            self._status(f"✖ {e}")
            return
        finally:
            self.running = False
        self._touch()
        self._draw()
        self._status(done_line(self.result.outputs_agree))

    def _lab_run(self, config: LabConfig, peaks):
        """The lab as one call on the inference thread, reporting through this screen's callbacks."""

        def lab_run(session):
            return run(
                session.loaded,
                config,
                calibration=peaks,
                on_start=self._started,
                on_step=self._stepped,
                on_policy=self._policy_done,
                on_sweep=self._swept,
                stop=self.stop,
            )

        return lab_run

    # -- callbacks on the inference thread: store the newest data only --------------------------
    def _touch(self) -> None:
        self._version += 1

    def _started(self, lab: Lab) -> None:
        self.lab = lab
        self._touch()

    def _stepped(self, policy: str, record: StepRecord, views: tuple[RequestView, ...]) -> None:
        if policy != self._policy:  # a new policy: its own steps only
            self._steps.clear()
        self._policy, self._views, self._clock = policy, views, record.clock_s
        self._steps.append((record, self.lab.intensity(list(record.feeds))))
        self._touch()

    def _policy_done(self, result: PolicyResult) -> None:
        self._policies = [*self._policies, result.to_json()]
        self._touch()

    def _swept(self, point: SweepPoint) -> None:
        self._sweep = [*self._sweep, point]
        self._touch()

    # -- drawing on the UI thread ----------------------------------------------------------------
    def _draw(self) -> None:
        if self._drawn == self._version or self.lab is None:
            return
        self._drawn = self._version
        if self.running:
            self._status(self._progress())
        self.query_one("#timeline-title", Static).update(f"Requests ({self._policy or 'waiting'})")
        timeline = self.query_one("#timeline", Static)
        width = max(10, min(40, timeline.size.width - 60))  # the bar takes what the row leaves
        timeline.update(Content("\n").join(lab_views.timeline_lines(self._views, self._clock, width)))
        self.query_one("#pool", Static).update(Content("\n").join(self._pool_lines(self.lab, self._views)))
        self._draw_tables()

    def _draw_tables(self) -> None:
        """The last steps, the three policies, and the sweep as a table and a plot."""
        self.query_one("#steps", Static).update(
            Content("\n").join(lab_views.step_lines(list(self._steps), self.balance))
        )
        policies = lab_views.policy_lines(self._policies)
        if self.result is not None:
            policies.append(lab_views.pace_line(self.result.verdict))
        self.query_one("#policies", Static).update(Content("\n").join(policies))
        skipped = self.result.sweep_skipped if self.result is not None else ()
        self.query_one("#sweep", Static).update(
            Content("\n").join(lab_views.sweep_lines(self._sweep, skipped))
        )
        self.query_one("#plot", lab_views.SweepPlot).show(self._sweep)

    def _progress(self) -> str:
        """Where the run is: the policy and step, or the sweep's B once the three policies are done."""
        if len(self._policies) == 3:
            return f"sweeping B = {self._sweep[-1].batch if self._sweep else '…'}"
        return (
            f"policy {self._policy or '…'}: step {self._steps[-1][0].index if self._steps else 0}"
            f" · clock {self._clock:.2f} s · the chat waits until the lab is done · Esc stops"
        )

    def _pool_lines(self, lab: Lab, views: tuple[RequestView, ...]) -> list[Content]:
        """The paged pool: its figures, the block map, and the preemptions so far."""
        pool = lab.pool_json() if lab.pool.num_blocks else self._pool_info()
        longest = max(len(s.prompt) for s in lab.specs) + lab.config.max_new
        lines = lab_views.pool_lines(pool, views, longest, lab.kv.token_bytes())
        lines += lab_views.block_map(views, pool["blocks"])
        preempted = sum(v.preemptions for v in views)
        lines.append(Content.styled(f"preemptions in this policy so far: {preempted}", "$text-muted"))
        return lines

    def _pool_info(self) -> dict:
        """The pool as it was (once released, the lab's result keeps its description)."""
        return (
            self.result.pool
            if self.result is not None
            else {
                "blocks": 0,
                "block_size": 0,
                "block_bytes": 0,
                "tensor_bytes": 0,
                "formula_bytes": 0,
                "formula": "",
            }
        )
