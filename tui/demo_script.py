"""A scripted demo as data: the steps of a TOML file, checked before the app opens.

A script is a list of `[[step]]` tables. Each step has a `caption` (what the class should look
at) and may have a `prompt` to send, settings to apply first (`sampling`, `kv_cache`,
`speculative`), an `instrument` to open once its answer is in, and `keys` to press in it.
Settings carry over from step to step, so each step's state is the sum of the steps up to it:
going back restores that state (a prompt already asked is not asked again).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

DEMOS = Path(__file__).resolve().parent.parent / "demos"
"""The demos shipped with llmchat (`llmchat demo inference` names demos/inference.toml)."""

FIELDS = {"caption", "prompt", "instrument", "keys", "sampling", "kv_cache", "speculative"}
SAMPLING_FIELDS = {"temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed", "max_new_tokens"}
KV_CACHES = ("model", "fp32", "bf16", "fp16", "int8")
"""`kv_cache`: a precision, or "model" for the model precision's own."""


class ScriptError(ValueError):
    """A script that cannot run, in one line naming the file and the step."""


@dataclass(frozen=True)
class DemoStep:
    caption: str
    prompt: str | None = None
    instrument: str | None = None
    """An instrument's or lesson's name (tui/instruments.py): inspector, tokenizer, attention, …"""
    keys: tuple[str, ...] = ()
    """Keys pressed in the instrument once it is open (Textual's names: "m", "right", "x")."""
    sampling: dict[str, Any] = field(default_factory=dict)
    kv_cache: str | None = None
    speculative: str | None = None
    """"lookup" to draft from the conversation, "off" for plain decoding."""


@dataclass(frozen=True)
class Settings:
    """The settings in force at a step: the script's changes up to it (None: as the app started)."""

    sampling: tuple[tuple[str, Any], ...] = ()
    kv_cache: str | None = None
    speculative: str | None = None


@dataclass(frozen=True)
class DemoScript:
    path: Path
    steps: tuple[DemoStep, ...]

    def settings_at(self, index: int) -> Settings:
        """The settings of step `index` (0-based): each step's changes applied in order."""
        sampling: dict[str, Any] = {}
        kv_cache = speculative = None
        for step in self.steps[: index + 1]:
            sampling |= step.sampling
            kv_cache = step.kv_cache or kv_cache
            speculative = step.speculative or speculative
        return Settings(tuple(sorted(sampling.items())), kv_cache, speculative)


def resolve(name: str) -> Path:
    """A script's path: a file as given, or the name of a shipped demo ("inference")."""
    given = Path(name).expanduser()
    if given.is_file() or given.suffix:
        return given
    return DEMOS / f"{name}.toml"


def load(name: str, instruments: set[str]) -> DemoScript:
    """The script `name` names, checked against the instruments the app has; ScriptError if bad."""
    path = resolve(name)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ScriptError(f"cannot read the demo script {path}: {e.strerror or e}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ScriptError(f"{path} is not valid TOML: {e}") from None
    steps = data.get("step")
    if not isinstance(steps, list) or not steps or not all(isinstance(s, dict) for s in steps):
        raise ScriptError(f"{path} has no steps: write each as a [[step]] table with a caption")
    return DemoScript(path, tuple(_step(s, n, path, instruments) for n, s in enumerate(steps, 1)))


def _step(table: dict, number: int, path: Path, instruments: set[str]) -> DemoStep:
    def bad(what: str) -> ScriptError:
        return ScriptError(f"{path}, step {number}: {what}")

    unknown = sorted(set(table) - FIELDS)
    if unknown:
        raise bad(f"unknown field {unknown[0]!r} (a step has {', '.join(sorted(FIELDS))})")
    caption = table.get("caption")
    if not isinstance(caption, str) or not caption.strip():
        raise bad("every step needs a caption: what the class should look at")
    prompt = table.get("prompt")
    if prompt is not None and (not isinstance(prompt, str) or not prompt.strip()):
        raise bad("prompt must be text")
    instrument = table.get("instrument")
    if instrument is not None and instrument not in instruments:
        raise bad(f"unknown instrument {instrument!r} (one of {', '.join(sorted(instruments))})")
    keys = table.get("keys", [])
    if not isinstance(keys, list) or not all(isinstance(k, str) and k for k in keys):
        raise bad('keys must be a list of key names, e.g. ["m", "right"]')
    if keys and instrument is None:
        raise bad("keys are pressed in an instrument: name one")
    sampling = table.get("sampling", {})
    if not isinstance(sampling, dict) or set(sampling) - SAMPLING_FIELDS:
        raise bad(f"sampling takes {', '.join(sorted(SAMPLING_FIELDS))}")
    kv_cache = table.get("kv_cache")
    if kv_cache is not None and kv_cache not in KV_CACHES:
        raise bad(f"kv_cache is one of {', '.join(KV_CACHES)}")
    speculative = table.get("speculative")
    if speculative is not None and speculative not in ("lookup", "off"):
        raise bad('speculative is "lookup" or "off"')
    return DemoStep(caption.strip(), prompt, instrument, tuple(keys), sampling, kv_cache, speculative)
