"""A config.json with values of the wrong type (issue 17): each bad key is named with the file
and ignored, the others are kept, and nothing reaches the engine to fail later."""

from __future__ import annotations

import json

import pytest

from tui.config import Config, load_config
from tui.engine_link import resolve_sampling


def write(path, raw: dict) -> None:
    path.write_text(json.dumps(raw), encoding="utf-8")


def test_a_key_of_the_wrong_type_is_named_and_ignored_and_the_others_kept(tmp_path):
    path = tmp_path / "config.json"
    write(
        path,
        {
            "model": "my-model",
            "precision": 16,
            "device": None,
            "theme": "llmchat-light",
            "system": 42,
            "context": "abc",
            "sampling": {"temperature": "hot", "top_k": 5, "seed": 1.5, "colour": 1},
        },
    )
    config, problem = load_config(path)
    assert config == Config(model="my-model", theme="llmchat-light", sampling={"top_k": 5})
    assert problem.startswith(f"{path}: ") and "\n" not in problem
    for named in (
        "precision must be a string, got 16",
        "device must be a string, got null",
        "system must be a string or null, got 42",
        'context must be a positive whole number of tokens or null, got "abc"',
        'sampling.temperature must be a number, got "hot"',
        "sampling.seed must be a whole number or null, got 1.5",
        "sampling.colour is not a sampling setting",
    ):
        assert named in problem, problem
    assert "ignored" in problem


def test_a_context_that_is_not_positive_and_text_that_is_not_utf8_are_ignored(tmp_path):
    path = tmp_path / "config.json"
    # A JSON file can spell a lone surrogate, which no tokenizer or database can take.
    path.write_text('{"context": 0, "system": "hi \\udcff", "sampling": {"top_k": true}}', encoding="utf-8")
    config, problem = load_config(path)
    assert config == Config()
    assert "context must be a positive whole number of tokens or null, got 0" in problem
    assert "system is not valid UTF-8" in problem
    assert "sampling.top_k must be a whole number, got true" in problem


def test_a_sampling_value_out_of_range_loses_only_itself():
    settings, problem, chosen = resolve_sampling({"temperature": 9, "top_k": 5})
    assert settings.top_k == 5 and settings.temperature == 0.7
    assert chosen == ["top_k"]  # the model's own temperature, where it has one, is used
    assert problem == "temperature must be in [0, 5], got 9: using the default 0.7"


def test_sampling_as_anything_but_an_object_is_named(tmp_path):
    path = tmp_path / "config.json"
    write(path, {"sampling": [1, 2], "precision": "bf16"})
    config, problem = load_config(path)
    assert config == Config(precision="bf16")
    assert "sampling must be an object" in problem


@pytest.mark.parametrize(
    "url, why",
    [
        ("http://127.0.0.1:99999/v1", "port"),
        ("http://127.0.0.1:abc/v1", "port"),
        ("http://[::1/v1", ""),
        ("http://h:8000/v1?api_key=sk-SECRET", "query"),
    ],
)
def test_a_server_url_no_client_can_use_is_named_when_the_file_is_read(tmp_path, url, why):
    """It was caught only when the app connected (a traceback for a bad port), the key in a query shown."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"server": url, "theme": "llmchat-light"}), encoding="utf-8")
    config, problem = load_config(path)
    assert config.server is None and config.theme == "llmchat-light"
    assert "server: " in problem and why in problem and "SECRET" not in problem
