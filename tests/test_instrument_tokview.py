"""Tokenizer view: pieces and their cost, the template, the cached/new boundary, message spans."""

import pytest

from engine.events import PromptTokens, TokenSampled
from engine.instruments.tokview import message_spans, text_cost, tokenizer_view
from engine.sampling import SamplingSettings
from engine.session import ChatSession

ENGLISH = "How does inference work?"
KOREAN = "추론은 어떻게 작동하나요?"


def test_text_cost_counts_pieces_and_characters(tiny_loaded):
    cost = text_cost(tiny_loaded.tokenizer, ENGLISH)
    assert cost.characters == len(ENGLISH) and cost.tokens == len(cost.pieces)
    assert b"".join(p.bytes for p in cost.pieces) == ENGLISH.encode("utf-8")
    assert cost.chars_per_token == pytest.approx(len(ENGLISH) / cost.tokens)


def test_a_rare_script_costs_more_tokens_per_character(tiny_loaded):
    english = text_cost(tiny_loaded.tokenizer, ENGLISH)
    korean = text_cost(tiny_loaded.tokenizer, "어떻게 작동 추론 café 🤖")
    assert korean.chars_per_token < english.chars_per_token / 2
    assert any(p.text.startswith("<0x") for p in korean.pieces)  # a piece holding part of a character


@pytest.mark.real_model
def test_smollm2_english_and_korean_costs(smollm2):
    assert text_cost(smollm2.tokenizer, ENGLISH).tokens == 5
    korean = text_cost(smollm2.tokenizer, KOREAN)
    assert (korean.tokens, korean.characters) == (32, 14)


def two_turns(loaded) -> tuple[ChatSession, PromptTokens, list[int]]:
    session = ChatSession(
        loaded, SamplingSettings(temperature=0.0, max_new_tokens=5), system_prompt="Be brief."
    )
    list(session.send(ENGLISH))
    events = list(session.send("unhappiness"))
    prompt = next(e for e in events if isinstance(e, PromptTokens))
    answer = [e.id for e in events if isinstance(e, TokenSampled)]
    return session, prompt, answer


def test_the_view_marks_cached_prefilled_and_generated(tiny_loaded):
    session, prompt, answer = two_turns(tiny_loaded)
    view = tokenizer_view(session, prompt.ids, prompt.reused, answer)
    assert view.reused == prompt.reused > 0 and view.prefilled == len(prompt.ids) - prompt.reused
    assert view.generated == len(answer)
    sources = [p.source for p in view.pieces]
    assert sources == ["cached"] * view.reused + ["prefilled"] * view.prefilled + ["generated"] * len(answer)
    assert [p.id for p in view.pieces] == [*prompt.ids, *answer]
    assert view.template.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert "<|im_start|>user\nunhappiness<|im_end|>" in view.template
    assert view.template.startswith(view.template_cached) and len(view.template_cached) > 0
    assert all(p.special == (p.id in session.namer.special) for p in view.pieces)


def test_spans_cut_the_conversation_by_message(tiny_loaded):
    session, prompt, answer = two_turns(tiny_loaded)
    ids = [*prompt.ids, *answer]
    spans = message_spans(session, ids)
    assert [(s.role, s.message) for s in spans] == [
        ("system", None),
        ("user", 0),
        ("assistant", 1),
        ("user", 2),
        ("assistant", 3),
    ]
    assert spans[0].start == 0 and spans[-1].end == len(ids)
    assert all(a.end == b.start for a, b in zip(spans, spans[1:]))
    view = tokenizer_view(session, prompt.ids, prompt.reused, answer)
    assert view.span_cost(spans[1]).text == f"user\n{ENGLISH}\n"
    assert view.span_cost(spans[3]).text == "user\nunhappiness\n"


def test_spans_of_an_answer_in_progress(tiny_loaded):
    session, prompt, _ = two_turns(tiny_loaded)
    del session.messages[-1]  # as during the answer: the last message is the user's
    spans = message_spans(session, prompt.ids)
    assert [(s.role, s.message) for s in spans][-2:] == [("user", 2), ("assistant", None)]
    assert spans[-1].end == len(prompt.ids)


DEFAULT_SYSTEM_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""SmolLM2's kind of template: with no system message it puts in a system prompt of its own."""


@pytest.fixture
def default_system_template(tiny_loaded):
    tokenizer = tiny_loaded.tokenizer
    original, tokenizer.chat_template = tokenizer.chat_template, DEFAULT_SYSTEM_TEMPLATE
    yield tiny_loaded
    tokenizer.chat_template = original


def test_the_templates_own_system_prompt_is_its_own_span_not_user_1(default_system_template):
    from tui.screens.tokenizer import span_lines

    session = ChatSession(default_system_template, SamplingSettings(temperature=0.0, max_new_tokens=5))
    events = list(session.send(ENGLISH))
    prompt = next(e for e in events if isinstance(e, PromptTokens))
    view = tokenizer_view(
        session, prompt.ids, prompt.reused, [e.id for e in events if isinstance(e, TokenSampled)]
    )
    assert view.template.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>")
    spans = view.spans
    assert [(s.role, s.message, s.default) for s in spans[:2]] == [("system", None, True), ("user", 0, False)]
    assert view.span_cost(spans[0]).text == "system\nYou are a helpful assistant.\n"
    assert view.span_cost(spans[1]).text == f"user\n{ENGLISH}\n"  # user #1 counts only itself
    table = "\n".join(line.plain for line in span_lines(view))
    assert "system (template)" in table and "no system prompt was set" in table


def test_no_default_system_span_where_the_template_adds_none(tiny_loaded):
    session = ChatSession(tiny_loaded, SamplingSettings(temperature=0.0, max_new_tokens=5))
    events = list(session.send(ENGLISH))
    prompt = next(e for e in events if isinstance(e, PromptTokens))
    assert [(s.role, s.default) for s in message_spans(session, prompt.ids)] == [
        ("user", False),
        ("assistant", False),
    ]
