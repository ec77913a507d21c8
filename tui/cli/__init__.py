"""The `llmchat` command line: the app by default, plus headless `ask`, `bench` and
`conversations`. Nothing here imports Textual until the app starts."""

from tui.cli.main import app

__all__ = ["app"]
