"""The top line: which model runs at which precision, or how far its loading has got.

The progress bar is drawn as text: a ProgressBar widget keeps timers running (and the
screen repainting) even when hidden, which the inference thread would pay for.
"""

from __future__ import annotations

from textual.content import Content
from textual.widget import Widget

from engine.events import ModelInfo
from tui.fmt import human_bytes, visible_controls

BAR_WIDTH = 24


def describe(info: ModelInfo, width: int = 1000) -> str:
    """The model in one line: the longest form that fits `width` cells (a small terminal gets a short one)."""
    if info.server is not None:
        return describe_server(info, width)
    head = f"{shown(info.name)} · {info.precision} · {info.device}"
    weights, context = human_bytes(info.weight_bytes), window(info)
    forms = (
        f"{head} · {info.parameters / 1e6:.1f}M params · weights {weights} · context {context}",
        f"{head} · {info.parameters / 1e6:.1f}M params · {weights} · {context} context",
        f"{head} · {weights} · {context} context",
        head,
    )
    return next((form for form in forms if len(form) <= width), head)


def describe_server(info: ModelInfo, width: int = 1000) -> str:
    """Which server, its version and parallelism where it tells, and the model; shorter forms
    (the details, then the version, then the URL left out) where `width` is small."""
    server = info.server
    where = [f"{server.kind} {server.version or '(version not reported)'}", server.url, info.name]
    details = [p for p in (server.parallelism, server.quantization) if p]
    context = [f"context {window(info)}"] if info.context else []
    forms = [
        " · ".join(where + details + context),
        " · ".join(where + context),
        " · ".join([server.kind, server.url, info.name]),
        " · ".join([server.kind, info.name]),
    ]
    forms = [shown(form) for form in forms]  # the server's own words: shown, never obeyed
    return next((form for form in forms if len(form) <= width), forms[-1])


def shown(text: str) -> str:
    """A path, URL or message from outside, on the one line: its controls visible (a Content's
    plain parts are never markup)."""
    return visible_controls(text, one_line=True)


def window(info: ModelInfo) -> str:
    """The context window, and the model's where `--context` keeps the session to less."""
    if info.context_limit:
        return f"{info.context_limit:,} of {info.context:,}"
    return f"{info.context:,}"


def progress_bar(fraction: float, width: int = BAR_WIDTH) -> Content:
    done = round(max(0.0, min(1.0, fraction)) * width)
    return Content.assemble(
        ("━" * done, "$accent"), ("━" * (width - done), "$text-muted 30%"), f" {fraction:.0%}"
    )


class StatusBar(Widget):
    DEFAULT_CSS = """
    StatusBar { dock: top; height: 1; background: $panel; text-wrap: nowrap; text-overflow: ellipsis; }
    """
    BADGE = " llmchat "

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.info: ModelInfo | None = None
        self.shown_fingerprint: str | None = None
        self._line = Content("")
        self._ready = False
        """The line shows the loaded model (not a load in progress or a failure)."""

    def render(self) -> Content:
        line = self._line
        if self.info is not None and self._ready:  # the model's line, as long as the width allows
            width = self.size.width - len(self.BADGE) - 1
            extra = self._fingerprint_part() if self.info.server is not None else Content("")
            line = Content.assemble(describe(self.info, width - extra.cell_length), extra)
        return Content.assemble((self.BADGE, "bold $background on $primary"), " ", line)

    def _fingerprint_part(self) -> Content:
        if self.shown_fingerprint is None:
            return Content("")
        return Content.assemble(("  fingerprint ", "$text-muted"), shown(self.shown_fingerprint))

    def _say(self, *parts, ready: bool = False) -> None:
        self._line = Content.assemble(*parts)
        self._ready = ready
        self.refresh()

    def starting(self, spec: str, precision: str) -> None:
        self._say(f"starting the engine (importing torch) for {shown(spec)} at {precision}…")

    def connecting(self, url: str) -> None:
        self._say(f"starting the engine, then connecting to {shown(url)}…")

    def loading(self, spec: str, precision: str, stage: str, fraction: float) -> None:
        if precision == "server":  # the stage says where it connects
            self._say(f"{shown(stage)}…")
            return
        self._say(f"loading {shown(spec)} at {precision}: {shown(stage)}  ", progress_bar(fraction))

    def ready(self, info: ModelInfo) -> None:
        self.info, self.shown_fingerprint = info, None
        self._say(describe(info), ready=True)

    def fingerprint(self, fingerprint: str) -> None:
        """A server's `system_fingerprint` (vLLM's names its parallel setup), once its first answer
        brought one; the build a llama-server sends is its version, already shown."""
        server = self.info.server if self.info is not None else None
        if server is None or fingerprint in (server.version, self.shown_fingerprint):
            return
        self.shown_fingerprint = fingerprint
        self._say(describe(self.info), ready=True)  # drawn with the model's line in `render`

    def failed(self, message: str) -> None:
        current = describe(self.info) if self.info else "no model loaded"
        self._say(current, ("  ✖ " + shown(message), "$text-error"))
