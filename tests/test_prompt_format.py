"""`--raw` (engine/prompt_format.py): the text goes to the model as it is, and the answer
continues it; a chat model's template is what raw leaves out."""

from __future__ import annotations

from typer.testing import CliRunner

from engine.events import PromptTokens, TurnFinished
from engine.instruments.tokview import tokenizer_view
from engine.sampling import SamplingSettings
from engine.session import ChatSession
from tui.cli import app

TEXT = "The capital of France is"


def prompt_ids(events) -> list[int]:
    return list(next(e for e in events if isinstance(e, PromptTokens)).ids)


def test_raw_sends_the_text_as_it_is_and_a_follow_up_continues_the_answer(tiny_loaded):
    tokenizer = tiny_loaded.tokenizer
    session = ChatSession(tiny_loaded, SamplingSettings(temperature=0.0, max_new_tokens=6), raw=True)
    first = list(session.send(TEXT))
    assert prompt_ids(first) == tokenizer(TEXT)["input_ids"]
    answer = first[-1].text
    assert isinstance(first[-1], TurnFinished) and answer
    second = list(session.send(" Paris"))
    assert tokenizer.decode(prompt_ids(second)) == TEXT + answer + " Paris"


def test_the_chat_template_is_what_raw_leaves_out(tiny_loaded):
    tokenizer = tiny_loaded.tokenizer
    settings = SamplingSettings(temperature=0.0, max_new_tokens=2)
    chat = tokenizer.decode(prompt_ids(ChatSession(tiny_loaded, settings).send(TEXT)))
    raw = tokenizer.decode(prompt_ids(ChatSession(tiny_loaded, settings, raw=True).send(TEXT)))
    assert raw == TEXT and chat == f"<|im_start|>user\n{TEXT}<|im_end|>\n<|im_start|>assistant\n"


def test_the_tokenizer_view_shows_a_raw_turn(tiny_loaded):
    session = ChatSession(tiny_loaded, SamplingSettings(temperature=0.0, max_new_tokens=4), raw=True)
    list(session.send(TEXT))
    trace = session.trace
    view = tokenizer_view(session, trace.prompt_ids, 0, [s.id for s in trace.steps])
    assert view.template.startswith(TEXT) and "<|im_start|>" not in view.template


def test_raw_with_a_server_is_refused_before_connecting():
    result = CliRunner().invoke(app, ["ask", "--raw", "--server", "http://127.0.0.1:9/v1", "hi"])
    assert result.exit_code == 2 and "--raw: a server applies its own chat template" in result.stderr
