"""The top line: which model runs at which precision, or how far its loading has got.

The progress bar is drawn as text: a ProgressBar widget keeps timers running (and the
screen repainting) even when hidden, which the inference thread would pay for.
"""

from __future__ import annotations

from textual.content import Content
from textual.widget import Widget

from engine.events import ModelInfo
from tui.fmt import human_bytes

BAR_WIDTH = 24


def describe(info: ModelInfo) -> str:
    if info.server is not None:
        return describe_server(info)
    return (
        f"{info.name} · {info.precision} · {info.device} · {info.parameters / 1e6:.1f}M params"
        f" · weights {human_bytes(info.weight_bytes)} · context {info.context:,}"
    )


def describe_server(info: ModelInfo) -> str:
    """Which server, its version and parallelism where it tells, and the model."""
    server = info.server
    parts = [f"{server.kind} {server.version or '(version not reported)'}", server.url, info.name]
    parts += [p for p in (server.parallelism, server.quantization) if p]
    if info.context:
        parts.append(f"context {info.context:,}")
    return " · ".join(parts)


def progress_bar(fraction: float, width: int = BAR_WIDTH) -> Content:
    done = round(max(0.0, min(1.0, fraction)) * width)
    return Content.assemble(
        ("━" * done, "$accent"), ("━" * (width - done), "$text-muted 30%"), f" {fraction:.0%}"
    )


class StatusBar(Widget):
    DEFAULT_CSS = """
    StatusBar { dock: top; height: 1; background: $panel; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.info: ModelInfo | None = None
        self.shown_fingerprint: str | None = None
        self._line = Content("")

    def render(self) -> Content:
        return Content.assemble((" llmchat ", "bold $background on $primary"), " ", self._line)

    def _say(self, *parts) -> None:
        self._line = Content.assemble(*parts)
        self.refresh()

    def starting(self, spec: str, precision: str) -> None:
        self._say(f"starting the engine (importing torch) for {spec} at {precision}…")

    def connecting(self, url: str) -> None:
        self._say(f"starting the engine, then connecting to {url}…")

    def loading(self, spec: str, precision: str, stage: str, fraction: float) -> None:
        if precision == "server":  # the stage says where it connects
            self._say(f"{stage}…")
            return
        self._say(f"loading {spec} at {precision}: {stage}  ", progress_bar(fraction))

    def ready(self, info: ModelInfo) -> None:
        self.info = info
        self._say(describe(info))

    def fingerprint(self, fingerprint: str) -> None:
        """A server's `system_fingerprint` (vLLM's names its parallel setup), once its first answer
        brought one; the build a llama-server sends is its version, already shown."""
        server = self.info.server if self.info is not None else None
        if server is None or fingerprint in (server.version, self.shown_fingerprint):
            return
        self.shown_fingerprint = fingerprint
        self._say(describe(self.info), ("  fingerprint ", "$text-muted"), fingerprint)

    def failed(self, message: str) -> None:
        current = describe(self.info) if self.info else "no model loaded"
        self._say(current, ("  ✖ " + message, "$text-error"))
