"""`--chat-template NAME|FILE` (engine/chat_templates.py): a model that ships no template is given
one by name or from a file, and a turn ends at that format's end-of-turn token."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from engine import models
from engine.chat_templates import NAMED, template_text
from engine.events import PromptTokens
from engine.sampling import SamplingSettings
from engine.session import ChatSession
from tui.cli import app

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "}]
RENDERED = {
    "chatml": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n Hi <|im_end|>\n"
    "<|im_start|>assistant\n",
    "gemma": "<B><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n",
    "llama3": "<B><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
}


@pytest.fixture(scope="module")
def base_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with its chat template taken away: a base model."""
    base = shutil.copytree(tiny_model_dir, tmp_path_factory.mktemp("base") / "model")
    (base / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    return base


@pytest.mark.parametrize("name", NAMED)
def test_each_named_template_renders_its_familys_turns(tiny_loaded, name):
    """The published formats: Gemma folds the system prompt into the first user turn and calls the
    answer 'model'; Gemma and Llama 3 trim each message and start with the tokenizer's BOS."""
    tokenizer = tiny_loaded.tokenizer
    text = tokenizer.apply_chat_template(
        CHAT, chat_template=NAMED[name], add_generation_prompt=True, tokenize=False
    )
    assert text == RENDERED[name].replace("<B>", tokenizer.bos_token)


def test_a_base_model_given_a_template_chats_and_stops_at_its_end_of_turn(base_dir, tmp_path):
    path = tmp_path / "mine.jinja"
    path.write_text(NAMED["chatml"], encoding="utf-8")
    loaded = models.load(str(base_dir), "fp32", "cpu", chat_template=template_text(str(path)))
    session = ChatSession(loaded, SamplingSettings(temperature=0.0, max_new_tokens=4))
    events = list(session.send("Hi"))
    ids = next(e for e in events if isinstance(e, PromptTokens)).ids
    assert loaded.tokenizer.decode(ids) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert loaded.tokenizer.convert_tokens_to_ids("<|im_end|>") in session.stop_ids


@pytest.mark.parametrize(
    "choice, said",
    [
        ("mistral7", "neither a template name (chatml, gemma, llama3) nor a file"),
        ("NOT_UTF8", "not UTF-8 text"),
        ("NO_MESSAGES", "does not read `messages`"),
    ],
)
def test_a_template_that_cannot_be_used_is_one_line_before_loading(tmp_path, choice, said):
    files = {"NOT_UTF8": b"\xff\xfe{{ messages }}", "NO_MESSAGES": b"{{ hello }}"}
    if choice in files:
        path = tmp_path / "t.jinja"
        path.write_bytes(files[choice])
        choice = str(path)
    result = CliRunner().invoke(app, ["ask", "--no-save", "--chat-template", choice, "hi"])
    assert result.exit_code == 2 and said in result.stderr and result.stderr.count("\n") == 1


def test_raw_and_a_template_together_are_refused():
    result = CliRunner().invoke(app, ["ask", "--raw", "--chat-template", "chatml", "hi"])
    assert result.exit_code == 2 and "choose one" in result.stderr


def test_ask_with_a_named_template_on_a_base_model(base_dir):
    flags = ["--no-save", "-t", "0", "-n", "3", "-m", str(base_dir), "--chat-template", "chatml"]
    result = CliRunner().invoke(app, ["ask", *flags, "Hi"])
    assert result.exit_code == 0, result.output
    assert "3 tokens" in result.stderr or "stop: eos" in result.stderr


def test_bench_raw_on_a_base_model_measures_speculation_and_kv_caches_on_raw_text(base_dir):
    """`bench --raw --speculative lookup --kv-cache int8` on a base model (Gemma 3 270M's case): the
    speculative answers and the caches' quality went through the chat template, and the run ended in
    a traceback ("Cannot use chat template functions")."""
    from engine import bench

    config = bench.BenchConfig(
        model=str(base_dir),
        prompt_lengths=(8,),
        decode_tokens=6,
        repeats=1,
        turns=1,
        raw=True,
        compile=False,
        speculative="lookup",
        kv_caches=("int8",),
        kv_cache_context=64,
    )
    (result,) = bench.run(config, report=lambda line: None)["results"]
    assert result["speculative"]["identical"] and result["speculative"]["plain_tok_s"] > 0
    assert result["kv_cache"]["int8"]["quality"]["steps"] > 0
