"""The KV cache panel: a gauge of tokens against the window, real bytes, and the per-token formula.

Drawn by `render()`; its height follows its lines (so no word is cut at any width). A new token
only changes numbers within a line, so it repaints this panel alone; a new turn or model lays it
out again.
"""

from __future__ import annotations

from textual.content import Content
from textual.widget import Widget

from engine.events import CacheChanged, ModelInfo, PhaseChanged, TurnStats
from tui.fmt import human_bytes

GAUGE_WIDTH = 30


def gauge(used: int, capacity: int, width: int = GAUGE_WIDTH) -> Content:
    filled = round(width * used / capacity) if capacity else 0
    filled = min(width, max(filled, 1 if used else 0))
    return Content.assemble(("█" * filled, "$accent"), ("░" * (width - filled), "$text-muted"))


SHORT_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def formula(info: ModelInfo) -> str:
    """The bytes-per-token formula with this model's numbers plugged in; a quantized cache adds
    its scale per token and head (int8: one float32 beside each row of head_dim int8 values)."""
    element = f"{info.cache_element_bytes} B ({SHORT_DTYPE.get(info.cache_dtype, info.cache_dtype)})"
    if info.cache_scale_bytes:
        row = f"({info.head_dim} dims × {element} + {info.cache_scale_bytes} B scale)"
    else:
        row = f"{info.head_dim} dims × {element}"
    return (
        f"2 (K,V) × {info.layers} layers × {info.kv_heads} kv heads × {row}"
        f" = {info.kv_bytes_per_token:,} B/token"
    )


def short_formula(info: ModelInfo) -> str:
    """The formula in one short line, for a server's model (its cache type is assumed, not told)."""
    return (
        f"2×{info.layers}×{info.kv_heads}×{info.head_dim}×{info.cache_element_bytes} B"
        f" = {info.kv_bytes_per_token:,} B, {info.cache_dtype.split(' ')[0]} assumed"
    )


# -- the same context with other K/V head counts (MHA, this model, MQA): computed from the shape
def head_sharing(info: ModelInfo) -> list[tuple[str, int, int]]:
    """(name, K/V heads, bytes per token) for one K/V head per query head (MHA), this model's
    count where it lies between (GQA), and one shared head (MQA): 2 × layers × h × (head_dim ×
    element + scale), the scale being an int8 cache's float32 per token and head."""
    parts = (info.layers, info.heads, info.kv_heads, info.head_dim, info.cache_element_bytes)
    if any(p is None for p in parts):
        return []
    counts = [("MHA", info.heads)]
    if 1 < info.kv_heads < info.heads:
        counts.append(("GQA", info.kv_heads))
    if info.heads > 1:
        counts.append(("MQA", 1))
    row = info.head_dim * info.cache_element_bytes + (info.cache_scale_bytes or 0)
    return [(name, h, 2 * info.layers * h * row) for name, h in counts]


def held_formula(used: int, per_token: int, layers: int, layer_positions: tuple[int, ...]) -> str:
    """The cache's bytes by the formula: tokens × bytes per token, or, where sliding windows hold
    fewer positions than the context, each kind of layer's positions × a layer's bytes per position."""
    if not layer_positions:
        return f"{used:,} × {per_token:,} B = {human_bytes(used * per_token)}"
    counts: dict[int, int] = {}
    for held in layer_positions:
        counts[held] = counts.get(held, 0) + 1
    parts = " + ".join(f"{n} × {held:,}" for held, n in sorted(counts.items(), reverse=True))
    per_position = per_token // layers
    total = sum(layer_positions) * per_position
    return f"({parts}) positions × {per_position:,} B = {human_bytes(total)}"


def head_sharing_lines(
    info: ModelInfo, used: int, real: int | None, layer_positions: tuple[int, ...] = ()
) -> list[Content]:
    """A short table: bytes per token and at the current context for each head count (a sliding
    window's layers counted with the positions they hold). Only this model's row can be measured
    (its tensors' bytes, where they equal the formula's)."""
    rows = head_sharing(info)
    if not rows:
        return []
    lines = [Content.assemble(("K/V heads ", "bold"), f" B/token   at {used:,} tokens")]
    share = sum(layer_positions) / (used * info.layers) if layer_positions and used else 1.0
    for name, heads, per_token in rows:
        mine = heads == info.kv_heads
        total = round(used * per_token * share)
        measured = mine and real is not None and real == total
        lines.append(
            Content.assemble(
                (f"{name} {heads:<2}", "bold" if mine else ""),
                (" ◀" if mine else "  ", "$accent"),
                f"{per_token:>10,} {human_bytes(total):>11} ",
                ("measured" if measured else "this model" if mine else "computed", "$text-muted"),
            )
        )
    return lines


class KVCachePanel(Widget):
    DEFAULT_CSS = """
    KVCachePanel { height: auto; border: round $primary 50%; border-title-color: $text; padding: 0 1; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.border_title = "KV cache"
        self.info: ModelInfo | None = None
        self.cache: CacheChanged | None = None
        self.turn: PhaseChanged | None = None
        self.finished: TurnStats | None = None
        """The last finished turn (None while one runs): explains why its last token is not cached."""
        self.fresh = False
        self.resumed = False
        """A saved conversation was just resumed: the next turn prefills its history, or reuses a
        saved cache."""
        self.server_fill: tuple[float, str] | None = None
        """A server's whole KV cache in use (0..1) and the metric it came from."""
        self.fill_before_turn = False
        """The server-wide fill was read before the running turn (it is read again at its end): it
        showed "/slots: 0 tokens held" beside this chat's growing count, as if they disagreed."""

    def set_model(self, info: ModelInfo) -> None:
        """A (re)loaded model starts with an empty cache."""
        self.info, self.cache, self.turn, self.finished, self.server_fill = info, None, None, None, None
        self.fresh, self.resumed = True, False
        self.refresh(layout=True)

    def set_resumed(self) -> None:
        """A saved conversation became current (its cache, if loaded from disk, follows as CacheChanged)."""
        self.turn, self.finished, self.fresh, self.resumed = None, None, False, True
        self.refresh(layout=True)

    def set_turn(self, event: PhaseChanged) -> None:
        self.turn, self.finished = event, None
        self.fresh = self.resumed = False
        self.fill_before_turn = self.server_fill is not None
        self.refresh(layout=True)

    def finish(self, stats: TurnStats) -> None:
        self.finished = stats
        self.refresh(layout=True)

    def set_cache(self, event: CacheChanged, repaint: bool = True) -> None:
        self.cache = event
        if event.server_fill is not None:  # read once a turn: kept until the next reading
            self.server_fill = (event.server_fill, event.server_fill_source)
            self.fill_before_turn = False
        if repaint:
            self.refresh(layout=self.resumed)  # "resumed from disk" may take another line

    def clear(self) -> None:
        self.cache, self.turn, self.finished = None, None, None
        self.resumed = False
        self.refresh(layout=True)

    def render(self) -> Content:
        if self.info is None:
            return Content.styled("no model loaded yet", "$text-muted")
        if self.info.server is not None:
            return Content("\n").join(self._server_lines())
        capacity = self.cache.capacity if self.cache else self.info.window
        used = self.cache.tokens if self.cache else 0
        real = self.cache.bytes if self.cache else 0
        per_token = self.cache.bytes_per_token if self.cache else self.info.kv_bytes_per_token
        held = self.cache.layer_positions if self.cache else ()
        lines = [
            Content.assemble(gauge(used, capacity), f" {used / capacity:.1%}" if capacity else ""),
            Content.assemble(("tokens ", "bold"), f"{used:,} / {capacity:,} in the window"),
            Content.assemble(("bytes  ", "bold"), f"{human_bytes(real)} in the tensors"),
            Content.assemble(("per token ", "bold"), formula(self.info)),
            Content.assemble(("formula ", "bold"), held_formula(used, per_token, self.info.layers, held)),
            *head_sharing_lines(self.info, used, real if self.cache else None, held),
            self._turn_line(),
            *self._reuse_stopped_line(),
            *self._unfed_line(),
        ]
        return Content("\n").join(lines)

    def _server_lines(self) -> list[Content]:
        """The cache lives on the server: this conversation's share, the formula where the model's
        shape is known, the server-wide fill where its metrics tell, and what it does not report."""
        info, cache = self.info, self.cache
        used = cache.tokens if cache else None
        capacity = cache.capacity if cache else info.window
        tokens = "not reported" if used is None else f"{used:,}"
        window = f" / {capacity:,}" if capacity else ""
        return [
            _server_gauge(used, capacity),
            Content.assemble(("tokens ", "bold"), f"{tokens}{window} on the server (this chat)"),
            _server_total(used, info.kv_bytes_per_token),
            _per_token_line(info),
            self._server_fill_line(),
            self._turn_line(),
        ]

    def _server_fill_line(self) -> Content:
        if self.server_fill is None:
            return Content.styled("server-wide cache use: not reported", "$text-muted")
        fill, source = self.server_fill
        return Content.assemble(
            ("server ", "bold"),
            f"{fill:.1%} of its KV cache in use ({source})",
            (" · read before this turn, again at its end" if self.fill_before_turn else "", "$text-muted"),
        )

    def _unfed_line(self) -> list[Content]:
        """After a turn: the answer's last token was never fed back, so the cache lacks it."""
        stats, cache = self.finished, self.cache
        if stats is None or cache is None or not stats.generated_tokens:
            return []
        if cache.tokens != stats.prompt_tokens + stats.generated_tokens - 1:
            return []
        return [
            Content.styled(
                f"cache = {stats.prompt_tokens:,} prompt + {stats.generated_tokens:,} answer − 1: decoding "
                "stopped on the last token, so it was never fed back; the next turn prefills it",
                "$text-muted",
            )
        ]

    def _turn_line(self) -> Content:
        if self.resumed or self.fresh:
            return self._next_turn_line()
        if self.turn is None:
            return Content.styled("this turn: –", "$text-muted")
        if self.turn.reused is None:
            return Content.styled("this turn: prefix-cache reuse not reported by the server", "$text-muted")
        return Content.assemble(
            ("this turn ", "bold"),
            (f"{self.turn.reused:,} reused", "$text-success"),
            " · ",
            (f"{self.turn.tokens:,} newly prefilled", "$text-warning"),
        )

    def _reuse_stopped_line(self) -> list[Content]:
        """Where this turn's prompt did not hold an earlier answer as sampled: the token reuse
        stopped at, and why."""
        turn = self.turn
        if turn is None or not turn.reuse_stopped:
            return []
        stopped = f"reuse stopped at token {turn.reused:,}: {turn.reuse_stopped}"
        return [Content.styled(stopped, "$text-warning")]

    def _next_turn_line(self) -> Content:
        """Before the first turn on a resumed or a new cache: what the next turn will reuse."""
        if self.resumed and self.cache is not None and self.cache.tokens:
            return Content.styled(
                f"resumed from disk: next turn reuses {self.cache.tokens:,} tokens", "$text-success"
            )
        if self.resumed:
            return Content.styled("resumed: the next turn prefills the history", "$text-warning")
        if self.info is not None and self.info.server is not None:
            # 52 cells: it was cut at "…decides the"
            return Content.styled("next turn: reuse is up to the server's prefix cache", "$text-muted")
        return Content.styled("new cache: the next turn prefills the whole conversation", "$text-warning")


def _server_gauge(used: int | None, capacity: int | None) -> Content:
    """The share of the window this chat holds on the server, where the server says."""
    if used is not None and capacity:
        return Content.assemble(gauge(used, capacity), f" {used / capacity:.1%} of the window")
    return Content.styled("the window's use: not reported by the server", "$text-muted")


def _server_total(used: int | None, per_token: int | None) -> Content:
    """The cache's bytes by the formula, where the server says the tokens and the shape is known."""
    if per_token and used is not None:
        return Content.assemble(
            ("formula ", "bold"), f"{used:,} × {per_token:,} B = {human_bytes(used * per_token)}"
        )
    return Content.styled("bytes: held by the server, not reported", "$text-muted")


def _per_token_line(info: ModelInfo) -> Content:
    """The bytes a token's K and V take, where the server reports the model's shape."""
    if info.kv_bytes_per_token:
        return Content.assemble(("per token ", "bold"), short_formula(info))
    return Content.styled("per token: the model's shape is not reported", "$text-muted")
