"""The phase panel: IDLE / PREFILL / DECODE at a glance, which decode step runs (eager, compiled,
still compiling), TTFT, ITL, tokens/s with the CPU share they were measured at, and a latency sparkline.

Drawn by `render()` at a fixed height, so an update repaints this panel only (no layout pass).
Given a single line (small terminals), it draws a one-line strip instead.
"""

from __future__ import annotations

import statistics
import time

from textual.content import Content
from textual.timer import Timer
from textual.widget import Widget

from engine.events import DecodeStep, DraftRound, PhaseChanged, PrefillProgress, TokenSampled, TurnStats
from engine.speculative.speedup import SpeedUp
from tui.fmt import count, decode_rate, ms, prefill_rate, sparkline

BADGES = {
    "idle": ("IDLE", "$text-muted on $panel"),
    "prefill": ("PREFILL", "bold $background on $warning"),
    "decode": ("DECODE", "bold $background on $success"),
}
WHY = {
    "idle": "waiting for a prompt",
    "prefill": "the whole prompt at once: compute-bound",
    "decode": "one token per step: memory-bound",
}


STEPS = {"compiled": "compiled", "eager": "eager fused", "hf": "transformers forward"}


def elapsed(seconds: float) -> str:
    """0:07, 1:05: a build's running time."""
    whole = int(seconds)
    return f"{whole // 60}:{whole % 60:02d}"


def step_line(step: DecodeStep | None, building_s: float | None = None, server: str | None = None) -> Content:
    """Which decode step runs, in one line; `building_s` the compile's running time now; `server`
    the kind of server that decodes (it does not say which step: "not known yet" all session)."""
    if step is None and server is not None:
        return Content.assemble(
            ("decode step ", "bold"), (f"on the server ({server}): not reported", "$text-muted")
        )
    if step is None:
        return Content.styled("decode step: not known yet", "$text-muted")
    if step.compile == "building":
        shown = step.elapsed_s if building_s is None else building_s
        return Content.assemble(
            ("decode step ", "bold"),
            f"{step.step} · {step.attention}",  # short: the time must fit a 42-cell panel
            (f" · compiling {elapsed(shown)}…", "bold $text-warning"),
        )
    attention = "" if step.step == "hf" else f" · attention {step.attention}"
    return Content.assemble(("decode step ", "bold"), f"{STEPS[step.step]}{attention}")


def step_why(step: DecodeStep, width: int | None = None) -> Content:
    """Why that step (and not a faster one): red when the compile failed or was given up; a
    reason too long for `width` leaves out its closing parenthesis ("compile off: --no-compile")."""
    if step.compile == "building":
        return Content.styled("the compiled step takes over when ready", "$text-muted")
    style = "$text-error" if step.compile in ("failed", "given up") else "$text-muted"
    why = step.why
    if width is not None and len(why) > width and why.endswith(")") and " (" in why:
        why = why[: why.rindex(" (")]
    return Content.styled(why, style)


def step_word(step: DecodeStep | None, building_s: float | None = None) -> str:
    """The decode step in a word or two, for the one-line strip."""
    if step is None:
        return ""
    if step.compile == "building":
        return f" · eager, compiling {elapsed(step.elapsed_s if building_s is None else building_s)}"
    return f" · {STEPS[step.step]}"


STRIP_CELLS = 78
"""The one-line strip's cells before it is laid out: an 80-column screen inside its border."""
PANEL_CELLS = 52
"""The Phase panel's text width (54 columns, less its padding): a longer line is cut."""


class PhasePanel(Widget):
    DEFAULT_CSS = """
    PhasePanel { height: 9; border: round $primary 50%; border-title-color: $text; padding: 0 1;
        text-wrap: nowrap; text-overflow: ellipsis; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.border_title = "Phase"
        self.phase = "idle"
        self.prompt_new = 0
        self.prompt_reused = 0
        self.progress: tuple[int, int] | None = None
        self.ttft_s: float | None = None
        self.itl: list[float] = []
        self.tokens = 0
        self.thought = 0
        """Of this turn's tokens, those that were thought."""
        self.final: TurnStats | None = None
        self.waiting_step: int | None = None
        """Step mode: the index of the token waiting for the user's choice."""
        self.rounds: list[DraftRound] = []
        """This turn's speculative rounds (none without --speculative)."""
        self.speedup: SpeedUp | None = None
        """A finished speculative answer against plain decoding in this session."""
        self.decode_step: DecodeStep | None = None
        self.server: str | None = None
        """The kind of server that decodes (None: the local engine)."""
        self._build_started = 0.0
        """time.monotonic() when the compile shown started (its elapsed time counts on from it)."""
        self._ticker: Timer | None = None

    def on_mount(self) -> None:
        self._ticker = self.set_interval(1.0, self.refresh, pause=True)

    # -- what the engine said -------------------------------------------------
    def set_server(self, kind: str) -> None:
        """A server decodes: its step is not known here, and the panel says so."""
        self.server = kind
        self.set_decode_step(None)

    def set_decode_step(self, step: DecodeStep | None) -> None:
        """What runs a decode step now (None: unknown, e.g. a server decodes); while a compile
        builds, its elapsed time counts on each second."""
        self.decode_step = step
        self._build_started = time.monotonic() - (step.elapsed_s if step else 0.0)
        if self._ticker is not None:
            if step is not None and step.compile == "building":
                self._ticker.resume()
            else:
                self._ticker.pause()
        self.refresh()

    @property
    def building_s(self) -> float | None:
        step = self.decode_step
        if step is None or step.compile != "building":
            return None
        return time.monotonic() - self._build_started

    def clear(self) -> None:
        """Nothing measured yet (a new chat, or a resumed one: the figures of the last turn are gone)."""
        self.phase, self.prompt_new, self.prompt_reused, self.progress = "idle", 0, 0, None
        self.ttft_s, self.itl, self.tokens, self.final, self.waiting_step = None, [], 0, None, None
        self.thought = 0
        self.refresh()

    def step_waiting(self, index: int) -> None:
        """Step mode: token `index` waits for the user's choice (the model is not computing)."""
        self.waiting_step = index
        self.refresh()

    def set_phase(self, event: PhaseChanged) -> None:
        self.phase, self.waiting_step = event.phase, None
        if event.phase == "prefill":
            self.prompt_new, self.prompt_reused = event.tokens, event.reused
            self.progress, self.ttft_s, self.final = None, None, None
            self.itl, self.tokens, self.thought, self.rounds, self.speedup = [], 0, 0, [], None
        self.refresh()

    def add_round(self, event: DraftRound, repaint: bool = True) -> None:
        self.rounds.append(event)
        if repaint:
            self.refresh()

    def prefill_progress(self, event: PrefillProgress, repaint: bool = True) -> None:
        self.progress = (event.done, event.total)
        if repaint:
            self.refresh()

    def add_tokens(self, tokens: list[TokenSampled], repaint: bool = True) -> None:
        self.waiting_step = None
        for token in tokens:
            if token.index == 0:
                self.ttft_s = token.latency_s
            else:
                self.itl.append(token.latency_s)
        self.tokens += len(tokens)
        self.thought += sum(token.thinking for token in tokens)
        if repaint:
            self.refresh()

    def finish(self, stats: TurnStats, speedup: SpeedUp | None = None) -> None:
        self.final, self.waiting_step, self.speedup = stats, None, speedup
        self.phase = "idle"
        self.ttft_s = stats.ttft_s
        self.refresh()

    # -- drawing ----------------------------------------------------------------
    @property
    def text_width(self) -> int:
        """Cells a line may take: the panel's own, PANEL_CELLS before it is laid out."""
        return self.content_size.width or PANEL_CELLS

    def render(self) -> Content:
        if self.content_size.height <= 1:
            return self._strip()
        label, style = BADGES[self.phase]
        return Content.assemble(
            (f" {label} ", style),
            " ",
            self._detail(),
            "\n",
            step_line(self.decode_step, self.building_s, self.server),
            "\n",
            self._why(),
            "\n",
            self._timings(),
            "\n",
            self._sparkline_and_share(),
            "\n",
            self._caption(),
        )

    def _timings(self) -> Content:
        """Two lines: TTFT and ITL, then the decode and prefill rates."""
        last = self.itl[-1] if self.itl else None
        prefill = prefill_rate(self.final) if self.final else "–"
        itl = f"last {ms(last)} · median {ms(self.median_itl)}"
        if len(f"TTFT {ms(self.ttft_s)}  ITL {itl}") > self.text_width:  # a 46-column side: "median 1…"
            itl = f"median {ms(self.median_itl)}"
        if self.speculative:  # a round's tokens arrive together: their gaps say nothing alone
            itl = f"{ms(self.median_itl)}/token (round ÷ tokens)"  # PANEL_CELLS: it was cut
            if len(f"TTFT {ms(self.ttft_s)}  ITL {itl}") > self.text_width:
                itl = f"{ms(self.median_itl)}/token"
        return Content.assemble(
            ("TTFT ", "bold"),
            ms(self.ttft_s),
            "  ",
            ("ITL ", "bold"),
            itl,
            "\n",
            ("decode ", "bold"),
            decode_rate(self.decode_tok_s),
            "  ",
            ("prefill ", "bold"),
            prefill,
        )

    def _caption(self) -> Content:
        """Under the sparkline; after a speculative answer, its speed against plain decoding instead."""
        if self.final is not None and self.final.speculative is not None and self.speedup is not None:
            if self.speedup.plain is None:
                return Content.styled(self.speedup.short(), "$text-muted")
            return Content.assemble(("speed-up ", "bold"), self.speedup.short())
        top = ms(max(self.itl, default=None))
        caption = f"ITL of each token, newest right (top = {top})"
        if len(caption) > self.text_width:  # "(top = 9…" on a 46-column side
            caption = f"ITL per token, newest right (top {top})"
        return Content.styled(caption, "$text-muted")

    def _why(self) -> Content:
        """What the phase costs; with speculation, what the rounds kept (a K-token verify reads the
        weights once, like one decode step: the reason it pays); after a server's turn, its own
        figures."""
        if not self.rounds:
            return self._server_figures()
        drafted = sum(len(r.drafted) for r in self.rounds)
        kept = sum(r.accepted for r in self.rounds)
        emitted = kept + len(self.rounds)
        n = len(self.rounds)
        # Within the panel's 52 cells ("4.5 tokens/forw…" was cut): the verify time where it fits,
        # F6 has it and a round's draft time.
        head = f"{kept}/{drafted} drafts kept"
        rest = f" · {emitted / n:.1f} tokens/pass"
        verify = f" · verify {ms(sum(r.verify_s for r in self.rounds) / n)}"
        fits = len(head + rest + verify) <= self.text_width
        return Content.assemble((head, "bold"), rest + (verify if fits else ""))

    def _share(self) -> Content:
        """The CPU share the last turn's figures were measured at; a warning on a busy machine, with
        the threads it kept where others took cores (the load, which only backs the share up, is
        in the chat's line and F6)."""
        measured = self.final.contention if self.final is not None else None
        if measured is None or measured.cpu_share is None:
            return Content("")
        if measured.fewer_threads:  # the CPU share of the thread it kept says little
            threads = f"{measured.threads} of {measured.configured_threads} threads"
            return Content.styled(f" ⚠ busy machine: {threads}", "bold $text-warning")
        if measured.busy:
            return Content.styled(f" ⚠ busy machine: CPU {measured.cpu_share:.0%}", "bold $text-warning")
        return Content.styled(f" CPU share {measured.cpu_share:.0%}", "$text-muted")

    def _sparkline_and_share(self) -> Content:
        """The ITL sparkline, with the CPU share its figures were measured at at its right."""
        share = self._share()
        width = max(10, self.content_size.width - share.cell_length)
        return Content.assemble((sparkline(self.itl, width), "$accent"), share)

    def _strip(self) -> Content:
        """The one-line form for small terminals."""
        label, style = BADGES[self.phase]
        numbers = f"TTFT {ms(self.ttft_s)} · ITL {ms(self.median_itl)} · {decode_rate(self.decode_tok_s)}"
        busy = self.final is not None and self.final.contention is not None and self.final.contention.busy
        head = Content.assemble((f" {label} ", style))
        tail = Content.assemble(
            (" " + numbers, "$text-muted"), (step_word(self.decode_step, self.building_s), "$text-muted")
        )
        detail = Content.assemble("  ", self._strip_detail())
        # The busy flag and the step before the detail: where the line would pass the strip's
        # width, the detail is left out whole, then the flag is shortened ("compiled  8 token…").
        width = self.content_size.width or STRIP_CELLS
        for flag, end in ((" ⚠ busy machine", detail), (" ⚠ busy machine", ""), (" ⚠ busy", "")):
            line = head + Content.styled(flag if busy else "", "bold $text-warning") + tail + end
            if line.cell_length <= width:
                break
        return line

    def _strip_detail(self) -> Content:
        """The detail, short where the strip would cut it at 80 columns ("compiled  last tu…")."""
        final = self.final
        if self.phase == "idle" and self.waiting_step is None and final is not None:
            return Content.styled(f"{count(final.generated_tokens, 'token')} · {final.stop}", "$text-muted")
        return self._detail()

    def _server_figures(self) -> Content:
        """Why the phase costs what it does; after a server's turn, its own figures instead; outside
        prefill, why the decode step is the one named above it."""
        server = self.final.server if self.final is not None else None
        if self.phase != "idle" or server is None or server.prompt_ms is None:
            if self.phase != "prefill" and self.decode_step is not None:
                return step_why(self.decode_step, self.text_width)
            return Content.styled(WHY[self.phase], "italic $text-muted")
        per_token = server.predicted_per_token_ms
        decode = f" · ITL {per_token:.1f} ms" if per_token is not None else ""
        return Content.assemble(
            ("server's own ", "bold"),
            f"prefill {server.prompt_ms:.0f} ms{decode}",
            (" (ours add network and queue)", "$text-muted"),
        )

    def _detail(self) -> Content:
        if self.waiting_step is not None:
            waiting = f"⏸ step mode: token {self.waiting_step + 1} waits for your choice"
            return Content.styled(waiting, "$text-accent")
        if self.phase == "prefill":
            return Content(self._prefill_detail())
        if self.phase == "decode":
            return Content(f"token {self.tokens}" + (f" ({self.thought:,} thought)" if self.thought else ""))
        if self.final is not None:
            final = self.final
            thought = f" ({final.thought_tokens:,} thought)" if final.thought_tokens else ""
            return Content.styled(
                f"last turn: {count(final.generated_tokens, 'token')}{thought}, stop: {final.stop}",
                "$text-muted",
            )
        return Content("")

    def _prefill_detail(self) -> str:
        """New and reused prompt tokens (a server may report neither) and the chunks done."""
        done = f" · {self.progress[0]}/{self.progress[1]} done" if self.progress else ""
        new = "? new tokens" if self.prompt_new is None else count(self.prompt_new, "new token")
        reused = "reuse not reported" if self.prompt_reused is None else f"{self.prompt_reused:,} reused"
        return f"{new} · {reused} from the cache{done}"

    @property
    def speculative(self) -> bool:
        return bool(self.rounds) or (self.final is not None and self.final.speculative is not None)

    @property
    def median_itl(self) -> float | None:
        """The median gap between tokens; with speculation the time per token (its gaps are a
        round's, then ~0 for the tokens the round kept: 'ITL 0.1 ms')."""
        if self.speculative:
            rate = self.decode_tok_s
            return 1 / rate if rate > 0 else None
        if self.final is not None and self.final.generated_tokens > 1:
            return self.final.itl_p50_s
        return statistics.median(self.itl) if self.itl else None

    @property
    def decode_tok_s(self) -> float:
        if self.final is not None:
            return self.final.decode_tok_s
        total = sum(self.itl)
        return len(self.itl) / total if total > 0 else 0.0
