"""The user's config file: defaults for the app, and the theme they picked last.

It lives in the platform's user config dir (`platformdirs`), or in `$LLMCHAT_CONFIG_DIR`
when set (tests, portable installs). JSON, so it needs nothing beyond the standard library.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import platformdirs

from engine import DEFAULT_MODEL

CONFIG_ENV = "LLMCHAT_CONFIG_DIR"
DEFAULT_THEME = "llmchat-dark"


@dataclass
class Config:
    model: str = DEFAULT_MODEL
    """Model spec: smollm2-135m, an HF directory, a .gguf file or a hub id."""
    precision: str = "fp32"
    """fp32, bf16, fp16, int8, nf4, w8a8 or w8 (CPU)."""
    device: str = "auto"
    """auto, cpu or cuda."""
    theme: str = DEFAULT_THEME
    """The theme the app opens with; changing it in the app saves it here."""
    system: str | None = None
    """System prompt for new chats."""
    context: int | None = None
    """Limit the context window to this many tokens."""
    server: str | None = None
    """An OpenAI-compatible server to chat with instead of a local model (e.g. http://host:8000/v1);
    `model` then names one of its models (the first it lists when left at the default)."""
    api_key_env: str | None = None
    """With a server: the environment variable that holds its API key (never the key itself)."""
    sampling: dict[str, Any] = field(default_factory=dict)
    """Defaults for sampling: temperature, top_k, top_p, min_p, repetition_penalty, seed, max_new_tokens."""


def config_path() -> Path:
    folder = os.environ.get(CONFIG_ENV) or platformdirs.user_config_dir("llmchat")
    return Path(folder) / "config.json"


def load_config(path: Path | None = None) -> tuple[Config, str | None]:
    """The config (defaults where the file is absent) and a problem to show, if any."""
    path = path or config_path()
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return Config(), None
    except (OSError, ValueError) as e:
        return Config(), f"ignoring {path}: {e}"
    if not isinstance(raw, dict):
        return Config(), f"ignoring {path}: expected a JSON object"
    known = {f.name for f in fields(Config)}
    unknown = sorted(set(raw) - known)
    config = Config(**{k: v for k, v in raw.items() if k in known})
    if not isinstance(config.sampling, dict):
        config.sampling = {}
    return config, (f"{path}: unknown keys {', '.join(unknown)}" if unknown else None)


def save_theme(theme: str, path: Path | None = None) -> None:
    """Remember the theme, keeping whatever else the user wrote in the file."""
    path = path or config_path()
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(raw, dict):
            raw = {}
    except (OSError, ValueError):
        raw = {}
    raw["theme"] = theme
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
