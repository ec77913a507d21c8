"""Every instrument has a one-paragraph explanation with its formula."""

import pytest

from engine.instruments.explain import EXPLANATIONS, explain

INSTRUMENTS = {
    "inspector",
    "fork",
    "step",
    "stages",
    "tokenizer",
    "phases",
    "attention",
    "attention_matrix",
    "precision",
    "kv_heads",
    "context",
    "embeddings",
    "lens",
    "ablation",
    "lab",
}
LAB_VIEWS = {"lab.timeline", "lab.pool", "lab.steps", "lab.policies", "lab.sweep"}


def test_every_instrument_is_explained_in_one_paragraph():
    assert set(EXPLANATIONS) == INSTRUMENTS | LAB_VIEWS
    for key, entry in EXPLANATIONS.items():
        assert entry.title and entry.formula, key
        assert "\n" not in entry.text and 300 <= len(entry.text) <= 900, key
        assert "=" in entry.formula, key


def test_unknown_instrument():
    assert explain("phases").title == "Two phases, measured"
    with pytest.raises(ValueError, match="inspector"):
        explain("nope")
