"""Shows engine events in the widgets (display only; the app keeps the turn state).

Gathered tokens reach the answer at every update; the panels (phase, KV cache, top-k,
token chips) record every token but repaint at most every `STATS_S`: they are read, not
watched, and repainting them is most of an update's cost.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from textual.css.query import NoMatches
from textual.timer import Timer

from engine.events import (
    CacheChanged,
    ContextTrimmed,
    DecodeStep,
    DraftRound,
    Event,
    ModelLoading,
    Notice,
    PhaseChanged,
    PrefillProgress,
    PromptTokens,
    TokenSampled,
    TurnStats,
)
from tui.fmt import SLOWER_STEPS, count, decode_rate, ms, thinking_part
from tui.widgets.chat_log import ChatLog
from tui.widgets.kv_cache import KVCachePanel
from tui.widgets.phase import PhasePanel
from tui.widgets.status_bar import StatusBar
from tui.widgets.token_stream import TokenStream
from tui.widgets.top_k import TopKPanel

if TYPE_CHECKING:
    from tui.app_parts import AppParts

STATS_S = 0.5
"""Panels repaint at most this often while tokens stream (twice a second)."""
STOPS = {
    "eos": "done",
    "length": "stopped at max new tokens",
    "cancelled": "⏹ stopped (Esc): the partial answer stays",
    "context": "stopped: the context window is full",
    "error": "stopped by an error",
}


def turn_summary(stats: TurnStats, error: str = "") -> str:
    """The line under a finished answer (with a server's own TTFT beside ours, where it reports it)."""
    server = stats.server
    own = f" (server prefill {server.prompt_ms:.0f} ms)" if server and server.prompt_ms is not None else ""
    stop = f"{STOPS['error']}: {error}" if error else STOPS.get(stats.stop, stats.stop)
    busy = f" · ⚠ {stats.contention.describe()}" if stats.contention and stats.contention.busy else ""
    step = f" ({SLOWER_STEPS[stats.step_path]})" if stats.step_path in SLOWER_STEPS else ""
    thought = f" · {thinking_part(stats)}" if stats.thought_tokens else ""
    rate = f" · {decode_rate(stats.decode_tok_s)}{step}" if stats.decode_tok_s > 0 else ""  # one token: none
    tokens = count(stats.generated_tokens, "token")
    return f"{tokens} · TTFT {ms(stats.ttft_s)}{own}{thought}{rate}{busy} · {stop}"


def prefill_note(event: PhaseChanged) -> str:
    """What the answer says while the prompt is prefilled (a server may not tell the counts)."""
    if event.tokens is None:
        return "the server is prefilling the prompt…"
    if event.reused is None:
        return f"the server is prefilling {count(event.tokens, 'prompt token')} (cache reuse not reported)…"
    return f"prefilling {count(event.tokens, 'new token')} ({event.reused:,} reused from the cache)…"


class Router:
    def __init__(self, app: AppParts) -> None:
        self.app = app
        self._stats_shown = 0.0
        self._stats_timer: Timer | None = None

    async def show_gathered(self, tokens: list[TokenSampled], figures: list[Event]) -> None:
        """Tokens and the newest figures taken from the inbox."""
        app = self.app
        paint = time.monotonic() - self._stats_shown >= STATS_S
        if tokens:
            app.part(PhasePanel).add_tokens(tokens, repaint=paint)
            app.part(TopKPanel).show_token(tokens[-1], repaint=paint)
            app.part(TokenStream).add(tokens, repaint=paint)
            await app.part(ChatLog).add_tokens(tokens)
        for event in figures:
            self._figure(event, paint)
        if paint:
            self._stats_shown = time.monotonic()
        elif self._stats_timer is None:  # repaint them soon even if no more tokens come
            self._stats_timer = app.set_timer(STATS_S, self.repaint_stats)

    def repaint_stats(self) -> None:
        self._stats_timer = None
        self._stats_shown = time.monotonic()
        try:
            for panel in (PhasePanel, KVCachePanel, TopKPanel, TokenStream):
                self.app.part(panel).refresh()
        except (NoMatches, IndexError):  # the timer fired while the app was closing: nothing to paint
            return

    def _figure(self, event: Event, paint: bool = True) -> None:
        app = self.app
        match event:
            case CacheChanged():
                app.part(KVCachePanel).set_cache(event, repaint=paint)
            case PrefillProgress():
                app.part(PhasePanel).prefill_progress(event, repaint=paint)
            case ModelLoading(stage, fraction):
                app.part(StatusBar).loading(app.options.model, app.precision, stage, fraction)

    async def show(self, event: Event) -> None:
        """An event that arrived in order (the inbox was drained first)."""
        app = self.app
        chat = app.part(ChatLog)
        match event:
            case PromptTokens():
                app.part(TokenStream).set_prompt(event)
            case PhaseChanged():
                await self._phase_changed(event, chat)
            case ContextTrimmed():
                chat.forget_first(event.dropped_messages)  # the saved messages' indices moved up
                chat.add_note(trimmed_note(event))
            case Notice(message):
                chat.add_note(message)
            case DecodeStep():
                app.part(PhasePanel).set_decode_step(event)
            case DraftRound():
                app.part(TokenStream).add_round(event)
                app.part(PhasePanel).add_round(event, repaint=False)
            case _:
                self._figure(event)

    async def _phase_changed(self, event: PhaseChanged, chat: ChatLog) -> None:
        """Prefill opens the answer and its turn in the panels; decode says Esc stops it."""
        app = self.app
        if event.phase == "prefill":
            await chat.begin_answer(prefill_note(event))
            app.part(TokenStream).begin_turn()
            app.part(PhasePanel).set_phase(event)
            app.part(KVCachePanel).set_turn(event)
            return
        app.part(PhasePanel).set_phase(event)
        if event.phase == "decode" and chat.current is not None:
            chat.current.set_note("decoding… (Esc stops)")


def trimmed_note(event: ContextTrimmed) -> str:
    return (
        f"The conversation outgrew the {event.capacity:,}-token window: the oldest "
        f"{event.dropped_messages} messages were dropped "
        f"({event.tokens_before:,} → {event.tokens_after:,} tokens)."
    )
