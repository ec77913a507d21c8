"""Issue 17, data lost: the config file is the user's. A file llmchat cannot read is never
rewritten; a change touches only the key llmchat owns (the theme), atomically; an unknown
theme is reported and left in the file as the user wrote it."""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import replace

import pytest
from textual.widgets import Select

from tests.tui_fakes import FakeFactory
from tests.tui_screen import wait_for
from tui import config
from tui.app import make_app
from tui.config import load_config, save_theme
from tui.options import options_from
from tui.screens.settings import SettingsScreen

WIDE = (160, 45)
MALFORMED = {
    "trailing comma": '{\n  "model": "my-model",\n  "sampling": {"temperature": 0.3},\n}\n',
    "not an object": "[1, 2, 3]\n",
}


def app_from_file(path, **flags):
    """The app as `llmchat` builds it (the config file's options, flags over them), with a fake engine."""
    loaded, _ = load_config(path)
    options = replace(options_from(loaded, config_path=path, **flags), cursor_blink=False)
    return make_app(options, FakeFactory())


async def start_and_choose_theme(app, theme: str | None = None) -> None:
    async with app.run_test(size=WIDE) as pilot:
        await wait_for(pilot, lambda: app.turns.ready, what="the model to load")
        await pilot.pause(0.3)  # the start-up theme change is saved (or not) by now
        if theme is not None:
            await pilot.press("ctrl+s")
            await wait_for(pilot, lambda: isinstance(app.screen, SettingsScreen))
            app.screen.query_one("#theme", Select).value = theme
            await pilot.pause(0.3)
            assert app.theme == theme


def notices(app) -> str:
    return "\n".join(str(n.message) for n in app._notifications)


@pytest.mark.parametrize("text", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_file_that_cannot_be_read_is_reported_and_never_rewritten(tmp_path, text):
    path = tmp_path / "config.json"
    path.write_text(text)
    app = app_from_file(path)
    asyncio.run(start_and_choose_theme(app, "llmchat-high-contrast"))
    assert path.read_text() == text  # neither the start nor the user's theme choice rewrote it
    assert "theme was not saved" in notices(app)
    _, problem = load_config(path)
    assert str(path) in problem and "left as it is" in problem


@pytest.mark.parametrize("text", MALFORMED.values(), ids=MALFORMED.keys())
def test_save_theme_refuses_a_file_it_cannot_read(tmp_path, text):
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(config.ConfigError, match="not saved"):
        save_theme("llmchat-light", path)
    assert path.read_text() == text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


def test_an_unknown_theme_is_reported_and_the_file_left_as_it_was(tmp_path):
    path = tmp_path / "config.json"
    text = json.dumps({"theme": "no-such-theme", "model": "my-model"}, indent=4) + "\n"
    path.write_text(text)
    app = app_from_file(path)
    asyncio.run(start_and_choose_theme(app))
    assert app.theme == config.DEFAULT_THEME
    assert "unknown theme 'no-such-theme'" in notices(app)
    assert path.read_text() == text


def test_the_file_is_rewritten_only_for_a_new_theme_and_only_its_theme_key_changes(tmp_path):
    path = tmp_path / "config.json"
    # The user's own spacing, an unknown key, and the theme the app opens with.
    text = '{"model": "my-model",  "colour": "red", "theme": "llmchat-dark", "context": 512}'
    path.write_text(text)
    asyncio.run(start_and_choose_theme(app_from_file(path)))
    assert path.read_text() == text  # the theme it opened with is already there
    asyncio.run(start_and_choose_theme(app_from_file(path, theme="llmchat-light")))  # --theme is remembered
    saved = json.loads(path.read_text())
    assert list(saved) == ["model", "colour", "theme", "context"]  # the user's order and unknown keys stay
    assert saved == {"model": "my-model", "colour": "red", "theme": "llmchat-light", "context": 512}


def test_a_failed_write_leaves_the_file_and_no_temporary_behind(tmp_path, monkeypatch):
    path = tmp_path / "config.json"
    text = '{"model": "my-model"}'
    path.write_text(text)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", disk_full)
    with pytest.raises(OSError):
        save_theme("llmchat-light", path)
    assert path.read_text() == text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


def test_a_symlinked_file_stays_a_link_and_its_target_is_updated(tmp_path):
    dotfiles = tmp_path / "dotfiles"
    dotfiles.mkdir()
    target = dotfiles / "llmchat.json"
    target.write_text('{"model": "my-model"}')
    os.chmod(target, 0o640)
    link = tmp_path / "config" / "config.json"
    link.parent.mkdir()
    link.symlink_to(target)
    save_theme("llmchat-light", link)
    assert link.is_symlink()
    assert json.loads(target.read_text()) == {"model": "my-model", "theme": "llmchat-light"}
    assert target.stat().st_mode & 0o777 == 0o640
