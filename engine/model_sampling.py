"""A model's own sampling defaults: what its makers recommend, where they say it.

Read from the model's files, in the order a user's tools read them: an HF model's
`generation_config.json` (the values it sets), a GGUF's `general.sampling.*` keys (llama.cpp's
server seeds its defaults from them), else the built-in model's card (SmolLM2's recommends
T 0.2, top-p 0.9: at llmchat's own T 0.7 its first answer to "What is the capital of France?"
was French nonsense). A value the user set (a flag, config.json, Settings) wins over the model's;
llmchat's defaults (engine/sampling.py) fill in what neither says.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from engine.events import SamplingResolved
from engine.gguf_header import gguf_metadata
from engine.models import DEFAULT_MODEL, resolve
from engine.sampling import SamplingSettings

GENERATION_CONFIG_KEYS = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}
"""generation_config.json key -> SamplingSettings field."""

GGUF_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
"""llama.cpp's GGUF sampling keys -> SamplingSettings field."""

FILTERS = ("top_k", "top_p", "min_p")
"""A model's filters are not taken at temperature 0: they would only cut the distribution the
panels show (F4's top-k read one candidate at 100%)."""

CARDS = {DEFAULT_MODEL: ({"temperature": 0.2, "top_p": 0.9}, "SmolLM2's model card")}
"""Built-in models whose files say nothing: their cards' recommendation."""


@dataclass(frozen=True)
class ModelSampling:
    values: dict[str, float | int]
    """SamplingSettings fields the model sets, each a value SamplingSettings takes."""
    source: str
    """Where they come from, in words ("generation_config.json", "SmolLM2's model card")."""


def model_sampling(spec: str) -> ModelSampling | None:
    """The sampling defaults the model `spec` names, or None where it recommends none."""
    try:
        source = resolve(spec)
    except Exception:  # a model that loaded resolves; anything else recommends nothing
        return None
    if source.kind == "gguf":
        found = _usable(_from_gguf(Path(source.location)), "the GGUF's general.sampling keys")
    elif source.kind == "dir":
        found = _usable(_from_generation_config(Path(source.location)), "generation_config.json")
    else:
        found = _usable(_from_hub(source.location), "generation_config.json")
    if found is None and spec in CARDS:
        return ModelSampling(*CARDS[spec])
    return found


def resolved(
    spec: str, settings: SamplingSettings, chosen: Iterable[str]
) -> tuple[SamplingSettings, SamplingResolved]:
    """The settings to answer with once model `spec` has loaded (`with_model_sampling`), and the
    event that says so."""
    own = model_sampling(spec)
    settings, from_model = with_model_sampling(settings, own, chosen)
    return settings, SamplingResolved(dataclasses.asdict(settings), from_model, own.source if own else None)


def with_model_sampling(
    settings: SamplingSettings, own: ModelSampling | None, chosen: Iterable[str]
) -> tuple[SamplingSettings, tuple[str, ...]]:
    """`settings` with every field the user did not choose set to the model's own value, or
    llmchat's default where the model has none; and the fields that came from the model."""
    chosen = set(chosen)
    defaults = SamplingSettings()
    values = dict(own.values) if own is not None else {}
    greedy = settings.temperature == 0 if "temperature" in chosen else values.get("temperature") == 0
    if greedy:  # as transformers' generate without sampling: the most probable token either way,
        values = {k: v for k, v in values.items() if k not in FILTERS}  # and the panels show it all
    free = [name for name in SamplingSettings.names() if name not in chosen]
    changes = {name: values.get(name, getattr(defaults, name)) for name in free}
    return dataclasses.replace(settings, **changes), tuple(name for name in free if name in values)


def chosen_fields(settings: SamplingSettings) -> list[str]:
    """The fields of `settings` that are not llmchat's defaults: someone chose them."""
    defaults = SamplingSettings()
    return [name for name in SamplingSettings.names() if getattr(settings, name) != getattr(defaults, name)]


def _usable(raw: dict[str, Any], source: str) -> ModelSampling | None:
    """The values SamplingSettings takes (a file's value out of range is left out, one by one)."""
    kept = {}
    for name, value in raw.items():
        try:
            SamplingSettings(**{name: value})
        except (ValueError, TypeError):
            continue
        kept[name] = value
    return ModelSampling(kept, source) if kept else None


def _from_generation_config(directory: Path) -> dict[str, Any]:
    try:
        raw = json.loads((directory / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(raw, dict):
        return {}
    return {field: raw[key] for key, field in GENERATION_CONFIG_KEYS.items() if key in raw}


def _from_hub(repo: str) -> dict[str, Any]:
    """From the hub cache only: loading the model put the file there (no network here)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        path = try_to_load_from_cache(repo, "generation_config.json")
    except Exception:
        return {}
    return _from_generation_config(Path(path).parent) if isinstance(path, str) else {}


def _from_gguf(path: Path) -> dict[str, Any]:
    try:
        header = gguf_metadata(path)
    except (OSError, ValueError, struct.error):  # a header that cannot be read recommends nothing
        return {}
    found = {key: header[key] for key in GGUF_KEYS if isinstance(header.get(key), (int, float))}
    return {
        GGUF_KEYS[key]: round(value, 6) if isinstance(value, float) else value for key, value in found.items()
    }
