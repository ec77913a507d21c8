"""llmchat's themes: each `*.tcss` file here declares one theme as Textual CSS variables.

`$primary: #5fafff;` and friends become the fields of a `textual.theme.Theme`
(primary, secondary, accent, warning, error, success, foreground, background, surface,
panel, boost, dark, luminosity-spread, text-alpha); any other `$name` becomes a custom
variable. The file's stem, prefixed with `llmchat-`, is the theme's name.
"""

from __future__ import annotations

import re
from pathlib import Path

from textual.theme import Theme

FOLDER = Path(__file__).parent
_DECLARATION = re.compile(r"\$([a-z][a-z0-9-]*)\s*:\s*([^;]+);")
_COLOURS = (
    "primary",
    "secondary",
    "accent",
    "warning",
    "error",
    "success",
    "foreground",
    "background",
    "surface",
    "panel",
    "boost",
)


def parse_theme(name: str, text: str) -> Theme:
    """A Theme from `$name: value;` declarations (comments are ignored)."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.DOTALL)
    values = {key: value.strip() for key, value in _DECLARATION.findall(text)}
    if "primary" not in values:
        raise ValueError(f"theme {name}: $primary is required")
    theme = Theme(
        name=name,
        dark=values.pop("dark", "true") == "true",
        luminosity_spread=float(values.pop("luminosity-spread", 0.15)),
        text_alpha=float(values.pop("text-alpha", 0.95)),
        **{key: values.pop(key) for key in _COLOURS if key in values},
    )
    theme.variables = values
    return theme


def load_themes(folder: Path = FOLDER) -> list[Theme]:
    return [
        parse_theme(f"llmchat-{path.stem}", path.read_text(encoding="utf-8"))
        for path in sorted(folder.glob("*.tcss"))
    ]
