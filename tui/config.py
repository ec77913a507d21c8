"""The user's config file: defaults for the app, and the theme they picked last.

It lives in the platform's user config dir (`platformdirs`), or in `$LLMCHAT_CONFIG_DIR`
when set (tests, portable installs). JSON, so it needs nothing beyond the standard library.

The file is the user's: llmchat owns only its "theme" key. A file that cannot be read (not
JSON, not an object) is reported and never written; a change rewrites the file atomically
(a temporary file in the same folder, then `os.replace`) with every other key as it was.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from contextlib import suppress
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import platformdirs

CONFIG_ENV = "LLMCHAT_CONFIG_DIR"
DEFAULT_MODEL = "smollm2-135m"
"""Same as engine.models.DEFAULT_MODEL, spelled here so the app opens without importing torch."""
DEFAULT_THEME = "llmchat-dark"


class ConfigError(RuntimeError):
    """The config file cannot be read, so it is not written either; the message is one line."""


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
    sampling: dict[str, Any] = field(default_factory=dict)
    """Defaults for sampling: temperature, top_k, top_p, min_p, repetition_penalty, seed, max_new_tokens."""


def config_path() -> Path:
    folder = os.environ.get(CONFIG_ENV) or platformdirs.user_config_dir("llmchat")
    return Path(folder) / "config.json"


def load_config(path: Path | None = None) -> tuple[Config, str | None]:
    """The config (defaults where the file is absent) and a problem to show, if any."""
    path = path or config_path()
    try:
        raw = _read(path)
    except ConfigError as e:
        return Config(), f"ignoring {e}; the defaults are used and the file is left as it is"
    known = {f.name for f in fields(Config)}
    unknown = sorted(set(raw) - known)
    config = Config(**{k: v for k, v in raw.items() if k in known})
    if not isinstance(config.sampling, dict):
        config.sampling = {}
    return config, (f"{path}: unknown keys {', '.join(unknown)}" if unknown else None)


def save_theme(theme: str, path: Path | None = None) -> None:
    """Remember the theme: only the "theme" key changes, and only when it differs.

    Raises ConfigError, writing nothing, when the file cannot be read; OSError when it cannot
    be written (the file is then as it was).
    """
    path = path or config_path()
    try:
        raw = _read(path)
    except ConfigError as e:
        raise ConfigError(
            f"the theme was not saved: {e}; fix the file, then choose the theme again"
        ) from None
    if raw.get("theme") == theme:
        return
    raw["theme"] = theme
    _replace(path, json.dumps(raw, indent=2, ensure_ascii=False) + "\n")


def _read(path: Path) -> dict[str, Any]:
    """The file's JSON object ({} when there is no file); ConfigError when it cannot be read."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it ({e.strerror or e})") from None
    except ValueError as e:  # not UTF-8
        raise ConfigError(f"{path}: cannot read it ({e})") from None
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: not a JSON object (it holds a JSON {_json_kind(raw)})")
    return raw


def _json_kind(value: Any) -> str:
    return {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(value), "number")


def _replace(path: Path, text: str) -> None:
    """Write `text` to `path` atomically: readers see the old file or the new one, never a part.

    A symlinked file (dotfiles) stays a link and its target changes; the target's permissions stay.
    """
    target = Path(os.path.realpath(path))
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        with suppress(FileNotFoundError):  # a new file keeps mkstemp's private 0600
            os.chmod(temporary, stat.S_IMODE(target.stat().st_mode))
        os.replace(temporary, target)
    except BaseException:
        with suppress(OSError):
            os.unlink(temporary)
        raise
