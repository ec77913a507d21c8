"""Settings: precision (reloads in the background), KV cache precision (from the next turn),
sampling (applies from the next token), theme.

Every field is checked as it is typed; a bad value gets a message under it and is never
applied. Imports the engine's settings, so the app opens this screen only once the
engine has started.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from textual import on
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select, Static

from engine.events import ServerInfo
from engine.quant.precision import PRECISIONS, cpu_note
from engine.sampling import SamplingSettings
from tui.config import KV_CACHE_CHOICES
from tui.fmt import plain_text

FIELDS = {
    "temperature": "Temperature (0 = greedy)",
    "top_k": "Top-k (0 = off)",
    "top_p": "Top-p",
    "min_p": "Min-p",
    "repetition_penalty": "Repetition penalty (1 = off)",
    "seed": "Seed (blank = random)",
    "max_new_tokens": "Max new tokens",
}
WHOLE = {"top_k", "seed", "max_new_tokens"}
NAMES = {
    "temperature": "temperature",
    "top_k": "top-k",
    "top_p": "top-p",
    "min_p": "min-p",
    "repetition_penalty": "repetition penalty",
    "seed": "seed",
    "max_new_tokens": "max new tokens",
}
"""Each field as the user reads it (in a notice), not as the code names it."""
OFF = "off"


def speculation_choices(model: str) -> list[tuple[str, str]]:
    """The drafters Settings offers: off, prompt lookup, and the model's own cheap copy."""
    return [
        ("off (plain decoding)", OFF),
        ("prompt lookup (n-gram match)", "lookup"),
        (f"draft model: {model} (w8 on a CPU)", model),
    ]


def drafters(choice: str | None, model: str) -> list[tuple[str, str]]:
    """The drafters offered, with the one in use added where it is none of them (a path)."""
    choices = speculation_choices(model)
    if choice is not None and choice not in [value for _, value in choices]:
        choices.append((plain_text(f"draft model: {choice}", one_line=True), choice))
    return choices


def draft_tokens_problem(text: str) -> str | None:
    text = text.strip()
    if not (text.isdigit() and 1 <= int(text) <= 8):
        return f"draft tokens must be a whole number from 1 to 8, got {text!r}"
    return None


def parse_field(name: str, text: str) -> Any:
    """Text from an input to a field value; ValueError says what is wrong."""
    text = text.strip()
    if name == "seed" and not text:
        return None
    try:
        return int(text) if name in WHOLE else float(text)
    except ValueError:
        kind = "a whole number" if name in WHOLE else "a number"
        raise ValueError(f"{name} must be {kind}, got {text!r}") from None


def check_field(settings: SamplingSettings, name: str, text: str) -> str | None:
    """None when the value is acceptable, else the reason (with the allowed range)."""
    try:
        replace(settings, **{name: parse_field(name, text)})
    except ValueError as e:
        return str(e)
    return None


def changes(old: SamplingSettings, new: SamplingSettings) -> dict[str, Any]:
    """The fields whose value differs, with their new values."""
    return {name: getattr(new, name) for name in FIELDS if getattr(old, name) != getattr(new, name)}


def describe_changes(old: SamplingSettings, new: SamplingSettings) -> str:
    """'temperature 0.7 → 0.3; max new tokens 512 → 60' (a blank seed reads as random)."""

    def shown(name: str, settings: SamplingSettings) -> str:
        return field_text(settings, name) or "random"

    return "; ".join(f"{NAMES[name]} {shown(name, old)} → {shown(name, new)}" for name in changes(old, new))


def field_text(settings: SamplingSettings, name: str) -> str:
    value = getattr(settings, name)
    return "" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def _choice(options: list[tuple[str, str]], value: str, id: str) -> Select:
    """A compact drop-down that always holds a value."""
    return Select(options, value=value, allow_blank=False, compact=True, id=id)


def _problem(name: str) -> Static:
    """The hidden line under a field that says what is wrong with its value."""
    problem = Static("", id=f"{name}-error", classes="error", markup=False)
    problem.display = False
    return problem


class SettingsScreen(ModalScreen[None]):
    DEFAULT_CSS = """
    SettingsScreen { align: center middle; }
    SettingsScreen > VerticalScroll { width: 76; max-width: 100%; height: auto; max-height: 100%;
        border: thick $primary; background: $surface; padding: 0 1; }
    SettingsScreen .heading { text-style: bold; color: $text-primary; margin-top: 1; }
    SettingsScreen .row { height: 1; }
    SettingsScreen .row > Label { width: 30; }
    SettingsScreen .row > Input, SettingsScreen .row > Select { width: 1fr; }
    SettingsScreen Select > SelectOverlay.-textual-compact { border: round $accent !important;
        background: $panel; max-height: 10; }
    SettingsScreen .error { color: $text-error; height: auto; }
    SettingsScreen .hint { color: $text-muted; }
    SettingsScreen #buttons { height: auto; margin-top: 1; align-horizontal: right; }
    SettingsScreen Button { margin-left: 1; }
    """
    BINDINGS = [Binding("escape", "dismiss", "Close"), Binding("ctrl+s", "apply", "Apply")]

    class PrecisionChosen(Message):
        def __init__(self, precision: str) -> None:
            super().__init__()
            self.precision = precision

    class SpeculationChosen(Message):
        def __init__(self, choice: str | None, k: int) -> None:
            super().__init__()
            self.choice, self.k = choice, k

    class KVCacheChosen(Message):
        def __init__(self, precision: str) -> None:
            super().__init__()
            self.precision = precision

    class SamplingApplied(Message):
        def __init__(self, settings: SamplingSettings) -> None:
            super().__init__()
            self.settings = settings

    def __init__(
        self,
        precision: str,
        device: str,
        sampling: SamplingSettings,
        themes: list[str],
        speculation: tuple[str | None, int, str] = (None, 4, ""),
        server: ServerInfo | None = None,
        kv_cache: str = "fp32",
        model_sampling: tuple[tuple[str, ...], str | None] = ((), None),
    ) -> None:
        """`speculation`: (the drafter now, or None; K; the model spec, for its own draft copy);
        `kv_cache`: the KV cache precision in use; `model_sampling`: the sampling fields that hold
        the model's own defaults, and where those come from."""
        super().__init__()
        self.model_sampling = model_sampling
        self.kv_cache = kv_cache
        self.speculation = speculation
        self.precision = precision
        self.device = device
        self.sampling = sampling
        self.themes = themes
        self.server = server
        """A model on a server: it decides the precision, and reads sampling once per request."""

    def compose(self):
        with VerticalScroll():
            yield Static("Settings", classes="heading")
            if self.server is not None:
                yield from self._server_precision()
            else:
                yield from self._precision_choice()
            # The theme sits high in the dialog, so its list opens inside the dialog on a small terminal.
            with Horizontal(classes="row"):
                yield Label("Theme (remembered)")
                yield _choice([(t, t) for t in self.themes], self.app.theme, "theme")
            yield from self._sampling_fields()
            yield from self._speculation_fields()
            with Horizontal(id="buttons"):
                yield Button("Apply  ^s", id="apply", variant="primary")
                yield Button("Close  esc", id="close")

    def _sampling_fields(self):
        yield Static(self._sampling_heading(), classes="heading")
        from_model, source = self.model_sampling
        if from_model:
            own = f"◆ the model's own default ({source}); a value you apply is kept instead"
            yield Static(own, id="model-sampling", classes="hint", markup=False)
        unsupported = self.server.unsupported_settings if self.server else ()
        for name, label in FIELDS.items():
            with Horizontal(classes="row"):
                mark = " ◆" if name in from_model else ""
                yield Label(label + mark + (" ✖ not supported by this server" if name in unsupported else ""))
                yield Input(field_text(self.sampling, name), id=name, compact=True, select_on_focus=True)
            yield _problem(name)

    def _speculation_fields(self):
        choice, k, model = self.speculation
        yield Static(
            "Speculative decoding: a drafter proposes K tokens, the model checks them in one "
            "forward pass (same answers at temperature 0); from the next answer on.",
            classes="heading",
        )
        with Horizontal(classes="row"):
            yield Label("Drafter")
            yield _choice(drafters(choice, model), choice or OFF, "speculative")
        with Horizontal(classes="row"):
            yield Label("Draft tokens K (1..8)")
            yield Input(str(k), id="draft_tokens", compact=True, select_on_focus=True)
        yield _problem("draft_tokens")

    def _precision_choice(self):
        yield Static(
            "Precision: a change reloads the model in the background, keeps the conversation, "
            "and re-prefills the cache on the next turn.",
            classes="hint",
        )
        with Horizontal(classes="row"):
            yield Label("Precision")
            yield _choice([(p, p) for p in PRECISIONS], self.precision, "precision")
        yield Static(self._precision_note(self.precision), id="precision-note", classes="hint")
        yield from self._kv_cache_choice()

    def _kv_cache_choice(self):
        yield Static(
            "KV cache precision: what the cache stores (int8: one scale per token and head); from "
            "the next turn, which prefills the conversation again. F8 compares it with fp32.",
            classes="hint",
        )
        with Horizontal(classes="row"):
            yield Label("KV cache")
            kv_cache = self.kv_cache if self.kv_cache in KV_CACHE_CHOICES else KV_CACHE_CHOICES[0]
            yield _choice([(p, p) for p in KV_CACHE_CHOICES], kv_cache, "kv_cache")

    def _server_precision(self):
        weights = self.server.quantization or "not reported"  # the server's words: text, not markup
        yield Static(
            plain_text(
                f"Precision: the server decides it (weights: {weights}); "
                "restart without --server to choose one.",
                one_line=True,
            ),
            classes="hint",
            id="precision-note",
        )

    def _sampling_heading(self) -> str:
        if self.server is not None:
            return "Sampling (remembered): Enter applies; the server reads it from the next answer."
        return "Sampling (remembered): Enter applies; it takes effect from the next token, also mid-answer."

    def on_mount(self) -> None:
        options = getattr(self.app, "options", None)
        for field in self.query(Input):  # as the chat's prompt: a snapshot must not catch a blink
            field.cursor_blink = options.cursor_blink if options is not None else True
        if self.server is not None:
            self.query_one("#temperature", Input).focus()
            return
        self._show_note(self.precision)
        self.query_one("#temperature", Input).focus()

    def _show_note(self, precision: str) -> None:
        note = self.query_one("#precision-note", Static)
        note.update(self._precision_note(precision))
        note.display = bool(self._precision_note(precision))

    def _precision_note(self, precision: str) -> str:
        note = cpu_note(precision) if self.device == "cpu" else None
        return note or ""

    @on(Select.Changed, "#precision")
    def _precision(self, event: Select.Changed) -> None:
        self._show_note(str(event.value))
        if event.value != self.precision:
            self.precision = str(event.value)
            self.post_message(self.PrecisionChosen(self.precision))

    @on(Select.Changed, "#kv_cache")
    def _kv_cache(self, event: Select.Changed) -> None:
        if event.value != self.kv_cache:
            self.kv_cache = str(event.value)
            self.post_message(self.KVCacheChosen(self.kv_cache))

    @on(Select.Changed, "#theme")
    def _theme(self, event: Select.Changed) -> None:
        self.app.theme = str(event.value)

    @on(Input.Changed)
    def _check(self, event: Input.Changed) -> None:
        name = event.input.id or ""
        if name == "draft_tokens":
            self._show_problem(name, draft_tokens_problem(event.value))
        else:
            self._show_problem(name, check_field(self.sampling, name, event.value))

    @on(Select.Changed, "#speculative")
    def _speculative(self) -> None:
        self._apply_speculation()

    def _apply_speculation(self) -> bool:
        """Post the drafter and K when they changed and K is valid."""
        text = self.query_one("#draft_tokens", Input).value
        problem = draft_tokens_problem(text)
        self._show_problem("draft_tokens", problem)
        if problem:
            return False
        value = str(self.query_one("#speculative", Select).value)
        choice, k = (None if value == OFF else value), int(text.strip())
        if (choice, k) != self.speculation[:2]:
            self.speculation = (choice, k, self.speculation[2])
            self.post_message(self.SpeculationChosen(choice, k))
        return True

    @on(Input.Submitted)
    def _submitted(self) -> None:
        self._apply()

    @on(Button.Pressed, "#apply")
    def action_apply(self) -> None:
        if self._apply():
            self.dismiss()

    @on(Button.Pressed, "#close")
    def _close(self) -> None:
        self.dismiss()

    def _show_problem(self, name: str, problem: str | None) -> None:
        message = self.query_one(f"#{name}-error", Static)
        message.update(problem or "")
        message.display = bool(problem)

    def _apply(self) -> bool:
        """Apply every field if all are valid; otherwise show each problem and change nothing."""
        values = self._valid_fields()
        if not (self._apply_speculation() and values is not None):
            return False
        settings = replace(self.sampling, **values)
        if settings != self.sampling:
            self.sampling = settings
            self.post_message(self.SamplingApplied(settings))
        return True

    def _valid_fields(self) -> dict[str, Any] | None:
        """Every sampling field's value, or None when one is wrong (each problem is shown)."""
        values, ok = {}, True
        for name in FIELDS:
            text = self.query_one(f"#{name}", Input).value
            problem = check_field(self.sampling, name, text)
            self._show_problem(name, problem)
            if problem:
                ok = False
            else:
                values[name] = parse_field(name, text)
        return values if ok else None
