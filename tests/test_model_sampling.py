"""A model's own sampling defaults (engine/model_sampling.py): read from its files or its card,
used for every setting the user did not choose, and said where they come from."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest

from engine.events import SamplingResolved, to_json
from engine.gguf_header import gguf_metadata
from engine.model_sampling import model_sampling, with_model_sampling
from engine.sampling import SamplingSettings
from engine.session import ChatSession
from engine.worker import InferenceWorker
from tests.test_worker import Recorder

QWEN3_GENERATION_CONFIG = {
    "do_sample": True,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
    "eos_token_id": 2,
}
"""Qwen3's published generation_config.json, as it sets sampling."""


@pytest.fixture
def recommending_dir(tiny_model_dir, tmp_path):
    """The tiny model with a generation_config.json that recommends sampling (a bad value too)."""
    directory = shutil.copytree(tiny_model_dir, tmp_path / "recommending")
    (directory / "generation_config.json").write_text(json.dumps({**QWEN3_GENERATION_CONFIG, "min_p": 7}))
    return directory


def write_gguf(path, **keys) -> None:
    """A GGUF header with these metadata keys (and a string array to skip past), no tensors."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_array("tokenizer.ggml.tokens", ["a", "bb", "<think>"] * 1000)
    for key, value in keys.items():
        (writer.add_float32 if isinstance(value, float) else writer.add_int32)(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_generation_config_json_gives_the_values_it_sets_and_drops_a_bad_one(recommending_dir):
    own = model_sampling(str(recommending_dir))
    assert own.values == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}  # min_p 7 is out of range
    assert own.source == "generation_config.json"


def test_a_gguf_says_its_sampling_in_llama_cpps_keys(tmp_path):
    path = tmp_path / "sampled.gguf"
    write_gguf(
        path,
        **{
            "general.sampling.temp": 0.8,
            "general.sampling.top_k": 64,
            "general.sampling.penalty_repeat": 1.1,
        },
    )
    header = gguf_metadata(path)
    assert (header["general.sampling.top_k"], header["general.architecture"]) == (64, "llama")
    own = model_sampling(str(path))
    assert own.values == {"temperature": 0.8, "top_k": 64, "repetition_penalty": 1.1}
    assert own.source == "the GGUF's general.sampling keys"


def test_a_model_that_recommends_nothing_keeps_llmchats_defaults(tiny_model_dir, tmp_path):
    assert model_sampling(str(tiny_model_dir)) is None
    write_gguf(tmp_path / "plain.gguf")
    assert model_sampling(str(tmp_path / "plain.gguf")) is None
    (tmp_path / "junk.gguf").write_bytes(b"GGUF\x03\x00")  # a header cut short recommends nothing
    assert model_sampling(str(tmp_path / "junk.gguf")) is None


def test_the_built_in_model_takes_its_cards_recommendation():
    own = model_sampling("smollm2-135m")
    assert own.values == {"temperature": 0.2, "top_p": 0.9} and own.source == "SmolLM2's model card"


def test_what_the_user_chose_wins_and_the_rest_is_the_models_or_llmchats():
    from engine.model_sampling import ModelSampling

    own = ModelSampling({"temperature": 0.2, "top_p": 0.9}, "a card")
    chosen = SamplingSettings(temperature=1.0, top_k=5, min_p=0.3)
    settings, from_model = with_model_sampling(chosen, own, chosen=["temperature", "top_k"])
    assert (settings.temperature, settings.top_k, settings.top_p) == (1.0, 5, 0.9)
    assert settings.min_p == 0.0  # not chosen: a setting the model does not make is llmchat's
    assert from_model == ("top_p",)
    # Another model loaded after it: its values replace the first model's, not the user's.
    settings, from_model = with_model_sampling(settings, None, chosen=["temperature", "top_k"])
    assert (settings.temperature, settings.top_k, settings.top_p) == (1.0, 5, 1.0) and from_model == ()


def test_at_temperature_0_the_models_filters_are_not_taken():
    """`ask -t 0` on SmolLM2 took the card's top-p 0.9: its top-k then held one candidate."""
    own = model_sampling("smollm2-135m")
    settings, from_model = with_model_sampling(SamplingSettings(temperature=0), own, ["temperature"])
    assert (settings.temperature, settings.top_p, from_model) == (0, 1.0, ())


def test_the_worker_answers_with_the_models_sampling_where_the_user_set_none(recommending_dir):
    recorder = Recorder()
    worker = InferenceWorker(recorder, SamplingSettings(max_new_tokens=4))
    try:
        worker.set_sampling(worker.sampling, chosen=["top_k"])  # the user set top_k 0 (as llmchat's)
        worker.load(str(recommending_dir), "fp32", "cpu")
        event = next(e for e in recorder.until(SamplingResolved) if isinstance(e, SamplingResolved))
        assert event.from_model == ("temperature", "top_p") and event.source == "generation_config.json"
        assert (worker.session.sampling.temperature, worker.session.sampling.top_k) == (0.6, 0)
        assert worker.session.sampling.max_new_tokens == 4  # given, not llmchat's default: chosen
        line = to_json(event)
        assert (
            line["event"] == "sampling"
            and line["temperature"] == 0.6
            and line["from_model"]
            == [
                "temperature",
                "top_p",
            ]
        )
    finally:
        worker.shutdown()


@pytest.mark.real_model
def test_smollm2s_own_sampling_makes_the_right_first_answer_likelier(smollm2):
    """A newcomer's first question. On the built-in Q4_1 file its first token is a near tie,
    'The' 15.2% against 'L' 14.0% (at llmchat's T 0.7 it answered 'Allein est la capital de
    France…'): the card's T 0.2 and top-p 0.9 give 'The' most of the mass the draw is made from."""
    import torch

    from engine.sampling import Sampler
    from engine.session import Message

    session = ChatSession(smollm2, SamplingSettings())
    session.messages.append(Message("user", "What is the capital of France?"))
    with torch.inference_mode():
        logits = session.forward(session.template(session.messages))
    the = smollm2.tokenizer.convert_tokens_to_ids("The")

    def chance_of_the(settings: SamplingSettings) -> float:
        draw = Sampler(settings, show_top_k=10).sample(logits, torch.tensor([], dtype=torch.long))
        return dict(zip(draw.top_ids, draw.top_probs)).get(the, 0.0)

    own, _ = with_model_sampling(SamplingSettings(), model_sampling("smollm2-135m"), ())
    assert chance_of_the(own) > 0.55 > 0.3 > chance_of_the(SamplingSettings())

    # llmchat's system prompt for the built-in model: 'The' is all the mass the card's draw is
    # made from (the template's own system prompt left 'L…' a 40% chance), so the answer starts right.
    from tui.options import BUILT_IN_SYSTEM

    session = ChatSession(smollm2, SamplingSettings(), system_prompt=BUILT_IN_SYSTEM)
    session.messages.append(Message("user", "What is the capital of France?"))
    with torch.inference_mode():
        logits = session.forward(session.template(session.messages))
    assert chance_of_the(own) > 0.95


def test_the_built_in_model_starts_with_llmchats_system_prompt_unless_one_is_given():
    from tui.config import Config
    from tui.options import BUILT_IN_SYSTEM, options_from

    default = options_from(Config())
    assert default.system == BUILT_IN_SYSTEM and default.system_is_default
    assert options_from(Config(system="Be a pirate.")).system == "Be a pirate."
    assert options_from(Config(), system="").system == ""  # '' keeps the template's own
    for flags in ({"model": "/models/other"}, {"server": "http://127.0.0.1:9/v1"}, {"raw": True}):
        options = options_from(Config(), **flags)
        assert options.system is None and not options.system_is_default, flags


def test_the_app_says_which_sampling_is_the_models_and_settings_marks_it(recommending_dir, tmp_path):
    from textual.widgets import Input, Label

    from tests.test_tui_model import WIDE
    from tests.test_tui_model import Recorder as AppRecorder
    from tests.tui_fakes import real_tiny_app
    from tests.tui_screen import screen_text, wait_for
    from tui.screens.settings import SettingsScreen

    recorder = AppRecorder()

    async def scenario():
        app = real_tiny_app(recorder, recommending_dir, tmp_path, {"top_p": 0.5})  # config.json's top_p
        async with app.run_test(size=WIDE) as pilot:
            await wait_for(pilot, lambda: app.turns.ready and app.model_sampling[0], timeout=60)
            assert (
                "Sampling: temperature 0.6, top-k 20: the model's own (generation_config.json)"
                in " ".join(screen_text(app).split())
            )
            assert (app.sampling.temperature, app.sampling.top_k, app.sampling.top_p) == (0.6, 20, 0.5)
            await pilot.press("ctrl+s")
            await wait_for(pilot, lambda: isinstance(app.screen, SettingsScreen))
            labels = [str(label.render()) for label in app.screen.query(Label)]
            assert "Temperature (0 = greedy) ◆" in labels and "Top-p" in labels  # top-p is the user's
            assert "the model's own default (generation_config.json)" in screen_text(app)
            app.screen.query_one("#temperature", Input).value = "0.3"
            await pilot.press("ctrl+s")
            await wait_for(pilot, lambda: not isinstance(app.screen, SettingsScreen))
            assert app.model_sampling[0] == ("top_k",)  # the temperature is the user's now
            assert app.engine.chosen >= {"temperature", "top_p"}

    asyncio.run(scenario())
