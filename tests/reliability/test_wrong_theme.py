"""Issue 31: a config file whose "theme" has the wrong type (`"theme": 5`) was rewritten at start with
llmchat-dark, the user's value lost. It is read as the default for the run, with one line saying
so, and the file changes only when the user picks a theme."""

from __future__ import annotations

import asyncio
import json

from tests.reliability.test_config_file import app_from_file, start_and_choose_theme
from tui import config
from tui.config import load_config

TEXT = '{"model": "my-model",  "theme": 5, "colour": "red"}'
"""The user's own spacing and an unknown key, with a theme of the wrong type."""


def test_a_wrong_typed_theme_is_the_default_for_the_run_and_stays_in_the_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(TEXT)
    _, problem = load_config(path)
    assert "theme must be a string, got 5" in problem and "\n" not in problem
    app = app_from_file(path)
    asyncio.run(start_and_choose_theme(app))
    assert app.theme == config.DEFAULT_THEME
    assert path.read_text() == TEXT  # rewritten with "theme": "llmchat-dark"


def test_a_theme_the_user_picks_replaces_the_wrong_typed_one(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(TEXT)
    asyncio.run(start_and_choose_theme(app_from_file(path), "llmchat-light"))
    assert json.loads(path.read_text()) == {"model": "my-model", "theme": "llmchat-light", "colour": "red"}


def test_a_theme_given_with_the_flag_is_remembered_over_the_wrong_typed_one(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(TEXT)
    asyncio.run(start_and_choose_theme(app_from_file(path, theme="llmchat-high-contrast")))
    assert json.loads(path.read_text())["theme"] == "llmchat-high-contrast"
