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

from engine import DEFAULT_MODEL

CONFIG_ENV = "LLMCHAT_CONFIG_DIR"
DEFAULT_THEME = "llmchat-dark"


class ConfigError(RuntimeError):
    """The config file cannot be read, so it is not written either; the message is one line."""


@dataclass
class Config:
    model: str = DEFAULT_MODEL
    """Model spec: smollm2-135m, an HF directory, a .gguf file or a hub id."""
    precision: str = "fp32"
    """fp32, bf16, fp16, int8, nf4, w8a8, w8 or w4 (CPU)."""
    device: str = "auto"
    """auto, cpu or cuda."""
    theme: str = DEFAULT_THEME
    """The theme the app opens with; changing it in the app saves it here."""
    system: str | None = None
    """System prompt for new chats."""
    context: int | None = None
    """Limit the context window to this many tokens."""
    speculative: str | None = None
    """Speculative decoding: "lookup" or a draft MODEL[@PRECISION] with the same tokenizer; null is off."""
    draft_tokens: int = 4
    """Tokens drafted per speculative round, 1..8."""
    kv_cache: str | None = None
    """The KV cache's precision: fp32, bf16, fp16 or int8 (one scale per token and head); null keeps
    the model precision's own (fp32 on a CPU)."""
    server: str | None = None
    """An OpenAI-compatible server to chat with instead of a local model (e.g. http://host:8000/v1);
    `model` then names one of its models (the first it lists when left at the default)."""
    api_key_env: str | None = None
    """With a server: the environment variable that holds its API key (never the key itself)."""
    shots: str | None = None
    """The folder the palette's Screenshot saves SVGs in; null: `screenshots` in the data dir."""
    sampling: dict[str, Any] = field(default_factory=dict)
    """Defaults for sampling: temperature, top_k, top_p, min_p, repetition_penalty, seed, max_new_tokens."""


KV_CACHE_CHOICES = ("fp32", "bf16", "fp16", "int8")
"""engine/kvcache.py CACHE_PRECISIONS, kept here so the config is read without torch (a test checks)."""


def config_path() -> Path:
    folder = os.environ.get(CONFIG_ENV) or platformdirs.user_config_dir("llmchat")
    return Path(folder) / "config.json"


SAMPLING_TYPES = {
    "temperature": "number",
    "top_k": "whole",
    "top_p": "number",
    "min_p": "number",
    "repetition_penalty": "number",
    "seed": "whole or null",
    "max_new_tokens": "whole",
}
"""The kind of value each sampling default takes (the engine checks the ranges)."""


def load_config(path: Path | None = None) -> tuple[Config, str | None]:
    """The config (defaults where the file is absent) and a problem to show, if any.

    A key whose value has the wrong type is left out (its default is used) and named in the
    problem with the file; the other keys are kept.
    """
    path = path or config_path()
    try:
        raw = _read(path)
    except ConfigError as e:
        return Config(), f"ignoring {e}; the defaults are used and the file is left as it is"
    known = {f.name for f in fields(Config)}
    problems = [f"unknown keys {', '.join(sorted(set(raw) - known))}"] if set(raw) - known else []
    values = {}
    for key in sorted(known & set(raw)):
        value, wrong = _checked(key, raw[key])
        problems += wrong
        if value is not _IGNORED:
            values[key] = value
    return Config(**values), (f"{path}: ignored {'; '.join(problems)}" if problems else None)


_IGNORED = object()


def _checked(key: str, value: Any) -> tuple[Any, list[str]]:
    """The value to use for config key `key` (_IGNORED: the default) and what is wrong in it."""
    check = _CHECKS.get(key)
    return check(value) if check is not None else _checked_text(key, value)


def _checked_sampling(value: Any) -> tuple[Any, list[str]]:
    if not isinstance(value, dict):
        return _IGNORED, [f"sampling must be an object, got {_shown(value)}"]
    wrong = {name: _sampling_problem(name, item) for name, item in value.items()}
    kept = {name: item for name, item in value.items() if wrong[name] is None}
    return kept, [problem for problem in wrong.values() if problem]


def _checked_context(value: Any) -> tuple[Any, list[str]]:
    if value is None or (_is_whole(value) and value >= 1):
        return value, []
    return _IGNORED, [f"context must be a positive whole number of tokens or null, got {_shown(value)}"]


def _checked_kv_cache(value: Any) -> tuple[Any, list[str]]:
    if value is None or value in KV_CACHE_CHOICES:
        return value, []
    return _IGNORED, [f"kv_cache must be one of {', '.join(KV_CACHE_CHOICES)} or null, got {_shown(value)}"]


def _checked_draft_tokens(value: Any) -> tuple[Any, list[str]]:
    if _is_whole(value) and 1 <= value <= 8:
        return value, []
    return _IGNORED, [f"draft_tokens must be a whole number from 1 to 8, got {_shown(value)}"]


def _checked_text(key: str, value: Any) -> tuple[Any, list[str]]:
    """Every other key is a string; some may be null."""
    from engine.utf8 import utf8_problem  # torch-free

    nullable = key in ("system", "speculative", "server", "api_key_env")
    if not (isinstance(value, str) or (nullable and value is None)):
        return _IGNORED, [f"{key} must be a string{' or null' if nullable else ''}, got {_shown(value)}"]
    problem = utf8_problem(value, key) if value is not None else None
    return (_IGNORED, [problem]) if problem else (value, [])


def _checked_server(value: Any) -> tuple[Any, list[str]]:
    """A server URL no client can use (a bad port, a query) is caught here, not at connect."""
    from engine.remote.target import url_problem  # no HTTP stack

    value, problems = _checked_text("server", value)
    problem = url_problem(value) if isinstance(value, str) else None
    return (_IGNORED, [f"server: {problem}"]) if problem else (value, problems)


_CHECKS = {
    "server": _checked_server,
    "sampling": _checked_sampling,
    "context": _checked_context,
    "kv_cache": _checked_kv_cache,
    "draft_tokens": _checked_draft_tokens,
}
"""The keys that are not plain strings, each with its check."""


def _sampling_problem(name: str, value: Any) -> str | None:
    kind = SAMPLING_TYPES.get(name)
    if kind is None:
        return f"sampling.{name} is not a sampling setting ({', '.join(SAMPLING_TYPES)})"
    if kind == "number" and not _is_number(value):
        return f"sampling.{name} must be a number, got {_shown(value)}"
    if kind.startswith("whole") and not (_is_whole(value) or (kind.endswith("null") and value is None)):
        return f"sampling.{name} must be a {kind.replace('whole', 'whole number')}, got {_shown(value)}"
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    """A value as it is spelled in the JSON file."""
    return json.dumps(value, ensure_ascii=True)


def save_theme(theme: str, path: Path | None = None) -> None:
    """Remember the theme: only the "theme" key changes, and only when it differs.

    Raises ConfigError, writing nothing, when the file cannot be read; OSError when it cannot
    be written (the file is then as it was).
    """
    save_keys({"theme": theme}, path, "the theme was not saved", "choose the theme again")


def save_sampling(changed: dict[str, Any], path: Path | None = None) -> None:
    """Remember sampling fields changed in the app (merged into the file's `sampling`), keeping the
    rest; raises as `save_theme` does."""
    if changed:
        save_keys({"sampling": changed}, path, "the sampling settings were not saved", "change them again")


def save_keys(values: dict[str, Any], path: Path | None, not_saved: str, retry: str) -> None:
    """Set the app's own keys in the config file, atomically, keeping every other key; a dict value
    (sampling) is merged into the dict already there. A file that cannot be read is never written."""
    path = path or config_path()
    try:
        raw = _read(path)
    except ConfigError as e:
        raise ConfigError(f"{not_saved}: {e}; fix the file, then {retry}") from None
    merged = dict(raw)
    for key, value in values.items():
        old = raw.get(key)
        merged[key] = {**old, **value} if isinstance(value, dict) and isinstance(old, dict) else value
    if merged != raw:
        _replace(path, json.dumps(merged, indent=2, ensure_ascii=False) + "\n")


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
