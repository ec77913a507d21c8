"""Thinking tokens (engine/thinking.py): thought told from answer as an answer streams, locally
(by the markers' ids, or as text) and from a server (its reasoning fields), counted apart in the
turn's figures; `--thinking on|off` sets a template's enable_thinking.

The end-to-end tests run Qwen3's published chat template (tests/data/qwen3_chat_template.jinja)
on a tiny random Qwen3 whose vocabulary holds `<think>` and `</think>` as added tokens, as
Qwen3's does; step mode (the session's own way to choose each token) forces a thinking block.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from engine.events import (
    Forked,
    PromptTokens,
    StepPaused,
    TokenSampled,
    TurnFinished,
    TurnStats,
    to_json,
)
from engine.sampling import SamplingSettings
from engine.thinking import (
    Markers,
    ThoughtSplitter,
    kept,
    opens_block,
    split_saved,
    switch_problem,
    thinking_figures,
)
from tests.reliability.hostile_server import HostileServer, chunk, stream_reply
from tests.tiny import build_tiny_model
from tui.cli import app

QWEN3_TEMPLATE = (Path(__file__).parent / "data" / "qwen3_chat_template.jinja").read_text()
IDS = Markers(open_id=90, close_id=91)

# -- the splitter, on a table ---------------------------------------------------------------
CASES = {
    "markers as ids": (
        IDS,
        False,
        [(90, "<think>"), (5, "hmm"), (91, "</think>"), (6, "\n\n"), (7, "Paris")],
        [True, True, True, False, False],
    ),
    "markers as text, split across tokens": (
        Markers(),
        False,
        [(None, "<th"), (None, "ink>"), (None, "hmm"), (None, "</th"), (None, "ink>"), (None, "Paris")],
        [True, True, True, True, True, False],
    ),
    "a block opened and closed in one piece (a server's chunk)": (
        Markers(),
        False,
        [(None, "<think>\n\n</think>\n\n"), (None, "Paris")],
        [True, False],
    ),
    "whitespace before the block": (
        Markers(),
        False,
        [(None, "\n"), (None, "<think>"), (None, "hmm"), (None, "</think>"), (None, "Paris")],
        [False, True, True, True, False],
    ),
    "the prompt opened the block (ids)": (
        IDS,
        True,
        [(5, "hmm"), (91, "</think>"), (7, "Paris")],
        [True, True, False],
    ),
    "the prompt opened the block (text)": (
        Markers(),
        True,
        [(None, "hmm"), (None, "</"), (None, "think>"), (None, "Paris")],
        [True, True, True, False],
    ),
    "enable_thinking=False: the prompt closed an empty block": (
        IDS,
        opens_block("<|im_start|>assistant\n<think>\n\n</think>\n\n"),
        [(7, "Paris"), (8, ".")],
        [False, False],
    ),
    "no markers at all: all answer": (
        Markers(),
        False,
        [(None, "The"), (None, " capital"), (None, " <think> is a tag")],
        [False, False, False],
    ),
    "markers as text mid-answer are the answer's": (
        Markers(),
        False,
        [(None, "Use "), (None, "<think>"), (None, " tags")],
        [False, False, False],
    ),
    "a marker's text where the vocabulary has its id is the answer's": (
        IDS,
        False,
        [(None, "<think>"), (7, "Paris")],
        [False, False],
    ),
    "an answer that starts like a marker, then is not one: only the stray '<' is misfiled": (
        Markers(),
        False,
        [(None, "<"), (None, "b>bold"), (None, "</b>")],
        [True, False, False],
    ),
    "an unclosed block at the end: all thought": (
        IDS,
        False,
        [(90, "<think>"), (5, "hmm"), (6, " and")],
        [True, True, True],
    ),
    "an unclosed block at the end (text)": (
        Markers(),
        False,
        [(None, "<think>"), (None, "hmm </thi")],
        [True, True],
    ),
}


@pytest.mark.parametrize("markers, opened, tokens, thought", CASES.values(), ids=CASES.keys())
def test_the_splitter_tells_thought_from_answer(markers, opened, tokens, thought):
    splitter = ThoughtSplitter(markers, opened)
    assert [splitter.is_thought(token_id, text) for token_id, text in tokens] == thought


def test_a_local_vocabulary_without_the_marker_token_never_opens_a_block_as_text(tiny_loaded):
    """SmolLM2 has no `<think>` token: an answer that starts "<" (HTML, say) is answer."""
    from engine.session import ChatSession

    session = ChatSession(tiny_loaded)
    splitter = session.thought_splitter()
    assert session.thought_markers.open_id is None
    assert [splitter.is_thought(None, text) for text in ("<th", "ink>", "hi")] == [False, False, False]


@pytest.mark.parametrize(
    "generation_prompt, opened",
    [
        ("<|im_start|>assistant\n", False),
        ("<｜Assistant｜><think>\n", True),  # DeepSeek-R1 distills
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # Qwen3, enable_thinking=False
        ("", False),
    ],
)
def test_the_generation_prompt_says_whether_the_answer_starts_as_thought(generation_prompt, opened):
    assert opens_block(generation_prompt) is opened


@pytest.mark.parametrize(
    "text, parts",
    [
        ("<think>hmm</think>\n\nParis", ("<think>hmm</think>", "\n\nParis")),
        ("hmm</think>Paris", ("hmm</think>", "Paris")),  # the prompt opened it
        ("\n<think>hmm", ("\n<think>hmm", "")),  # cut while it thought
        ("Paris", ("", "Paris")),
        ("Use <think> and </think> tags", ("", "Use <think> and </think> tags")),
    ],
)
def test_a_kept_answer_parts_into_thought_and_answer(text, parts):
    assert split_saved(text) == parts


@pytest.mark.parametrize(
    "pieces, text",
    [
        ([(True, "hmm"), (True, " ok"), (False, "Paris")], "<think>hmm ok</think>Paris"),
        ([(True, "<think>"), (True, "hmm"), (True, "</think>"), (False, "Paris")], "<think>hmm</think>Paris"),
        ([(True, "hmm")], "<think>hmm"),
        ([(False, "Paris")], "Paris"),
    ],
)
def test_a_servers_thought_is_kept_with_its_markers(pieces, text):
    assert kept(pieces) == text
    assert split_saved(kept(pieces))[1] == "".join(t for thought, t in pieces if not thought)


def step(index: int, latency_s: float, thinking: bool) -> TokenSampled:
    return TokenSampled(index, index, "x", "x", -0.1, (), latency_s, index, thinking=thinking)


def test_the_figures_count_thought_and_time_its_first_token_and_the_answers():
    steps = [step(0, 0.5, True), step(1, 0.1, True), step(2, 0.1, False), step(3, 0.1, False)]
    assert thinking_figures(steps) == (2, 0.5, pytest.approx(0.7))
    assert thinking_figures([step(0, 0.5, False)]) == (0, None, 0.5)
    assert thinking_figures([]) == (0, None, None)


def test_a_template_has_a_thinking_switch_only_where_it_reads_enable_thinking():
    assert switch_problem(QWEN3_TEMPLATE) is None
    assert "no thinking switch" in switch_problem("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert "no thinking switch" in switch_problem(None)


def test_the_json_carries_the_flag_per_token_and_the_figures_per_turn():
    assert to_json(step(0, 0.5, True))["thinking"] is True
    stats = TurnStats(10, 0, 10, 4, 0.5, 0.1, 0.1, 20.0, 10.0, "eos", thought_tokens=2)
    stats = TurnStats(**{**vars(stats), "first_thought_s": 0.5, "first_answer_s": 0.7})
    turn = to_json(TurnFinished(stats, "<think>a</think>b"))
    assert (turn["thought_tokens"], turn["first_thought_ms"], turn["first_answer_ms"]) == (2, 500.0, 700.0)
    plain = to_json(TurnFinished(TurnStats(10, 0, 10, 4, 0.5, 0.1, 0.1, 20.0, 10.0, "eos"), "b"))
    assert (plain["thought_tokens"], plain["first_thought_ms"]) == (0, None)


# -- end to end on a tiny Qwen3 with Qwen3's template ---------------------------------------------
@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """A tiny random Qwen3 whose tokenizer has `<think>` and `</think>` as added tokens (not special,
    as Qwen3's), with Qwen3's chat template."""
    from tokenizers import AddedToken
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), family="qwen3")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.add_tokens(
        [AddedToken(marker, normalized=False, special=False) for marker in ("<think>", "</think>")]
    )
    tokenizer.chat_template = QWEN3_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(directory)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def qwen3(qwen3_dir):
    from engine import models

    return models.load(str(qwen3_dir), "fp32", "cpu")


def session_for(loaded, thinking: bool | None = None, max_new_tokens: int = 16):
    """Greedy, with every token offered in step mode (so any can be taken)."""
    from engine.session import ChatSession

    settings = SamplingSettings(temperature=0.0, max_new_tokens=max_new_tokens)
    return ChatSession(loaded, settings, show_top_k=len(loaded.tokenizer), thinking=thinking)


def forced(session, text: str, forcing: list[int]) -> list:
    """Send `text`, taking `forcing`'s tokens first (step mode), then decoding freely."""
    session.step_gate.pause()
    events, left = [], list(forcing)
    for event in session.send(text):
        events.append(event)
        if isinstance(event, StepPaused) and left:
            session.step_gate.take(left.pop(0))
        elif isinstance(event, StepPaused):
            session.step_gate.resume()
    session.step_gate.resume()  # the answer ended before the forcing did
    return events


def block_ids(tokenizer, thought: str, answer: str) -> list[int]:
    words = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    marker = tokenizer.convert_tokens_to_ids
    return [marker("<think>"), *words(thought), marker("</think>"), *words(answer)]


def test_a_forced_thinking_block_streams_as_thought_and_is_counted_apart(qwen3):
    session = session_for(qwen3)
    assert session.thought_markers == Markers(*qwen3.tokenizer.convert_tokens_to_ids(["<think>", "</think>"]))
    forcing = block_ids(qwen3.tokenizer, "hmm ok", "\n\nParis")
    events = forced(session, "What is the capital of France?", forcing)
    tokens = [e for e in events if isinstance(e, TokenSampled)]
    thought = len(forcing) - len(qwen3.tokenizer("\n\nParis", add_special_tokens=False)["input_ids"])
    assert [t.id for t in tokens[: len(forcing)]] == forcing
    assert [t.thinking for t in tokens] == [True] * thought + [False] * (len(tokens) - thought)
    stats = events[-1].stats
    assert stats.thought_tokens == thought and stats.generated_tokens == len(tokens)
    assert stats.first_thought_s == stats.ttft_s
    assert stats.first_answer_s == pytest.approx(sum(t.latency_s for t in tokens[: thought + 1]))
    answer = session.messages[-1].content
    assert answer.startswith("<think>hmm ok</think>") and split_saved(answer)[1].startswith("\n\nParis")


def test_the_next_turn_templates_the_thought_away_and_a_fork_inside_it_is_thought(qwen3):
    session = session_for(qwen3)
    forced(session, "What is the capital of France?", block_ids(qwen3.tokenizer, "hmm", "Paris"))
    first = session.trace
    follow_up = list(session.send("And of Germany?"))
    prompt = qwen3.tokenizer.decode(next(e for e in follow_up if isinstance(e, PromptTokens)).ids)
    assert "<think>" not in prompt  # Qwen3's template drops an earlier turn's thought
    events = list(session.fork(1, first.steps[1].top_k[1].id, answer=1))  # another word of thought
    assert isinstance(events[0], Forked) and events[1].index == 1 and events[1].thinking


@pytest.mark.parametrize("thinking", [None, True, False])
def test_thinking_off_puts_an_empty_block_in_the_prompt(qwen3, thinking):
    session = session_for(qwen3, thinking=thinking, max_new_tokens=2)
    events = list(session.send("What is the capital of France?"))
    prompt = qwen3.tokenizer.decode(next(e for e in events if isinstance(e, PromptTokens)).ids)
    empty_block = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert prompt.endswith(empty_block) is (thinking is False)
    assert prompt.endswith("<|im_start|>assistant\n") is (thinking is not False)
    assert not session.starts_thinking


def test_a_prompt_that_opens_the_block_starts_the_answer_as_thought(qwen3_dir):
    """DeepSeek-R1's distills end the generation prompt with '<think>\\n': the model writes its
    thought straight away and closes it."""
    from engine import models

    opening = QWEN3_TEMPLATE.replace(
        "{{- '<|im_start|>assistant\\n' }}", "{{- '<|im_start|>assistant\\n<think>\\n' }}"
    )
    loaded = models.load(str(qwen3_dir), "fp32", "cpu", chat_template=opening)
    session = session_for(loaded)
    assert session.starts_thinking
    forcing = block_ids(loaded.tokenizer, "hmm", "Paris")[1:]  # no <think>: the prompt opened it
    tokens = [e for e in forced(session, "Hi", forcing) if isinstance(e, TokenSampled)]
    marker = forcing.index(loaded.tokenizer.convert_tokens_to_ids("</think>"))
    assert [t.thinking for t in tokens[: marker + 2]] == [True] * (marker + 1) + [False]


def test_a_template_without_the_switch_is_refused_with_one_line(tiny_loaded):
    from engine.models import ModelError

    with pytest.raises(ModelError, match="--thinking off: the chat template has no thinking switch"):
        session_for(tiny_loaded, thinking=False)


# -- ask --------------------------------------------------------------------------------------------
def ask(*args: str):
    return CliRunner().invoke(app, ["ask", "--no-save", "-t", "0", "-n", "4", *args])


def test_ask_thinking_off_sends_the_empty_block_and_reports_per_token(qwen3_dir):
    result = ask("--json", "-m", str(qwen3_dir), "--thinking", "off", "Hi")
    assert result.exit_code == 0, result.output
    events = [json.loads(line) for line in result.stdout.splitlines()]
    prompt = next(e for e in events if e["event"] == "prompt")
    assert "".join(prompt["pieces"]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert all("thinking" in e for e in events if e["event"] == "token")
    turn = next(e for e in events if e["event"] == "turn")
    assert {"thought_tokens", "first_thought_ms", "first_answer_ms"} <= turn.keys()


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--thinking", "maybe"], "--thinking must be on or off, got 'maybe'"),
        (["--thinking", "on", "--raw"], "--thinking: --raw sends the text without a template"),
        (
            ["--thinking", "on", "--chat-template", "chatml"],
            "--chat-template chatml: the chat template has no",
        ),
        (["--thinking", "on", "--server", "http://127.0.0.1:9/v1"], "a server applies its own chat template"),
    ],
)
def test_a_thinking_flag_that_cannot_work_exits_2_before_loading(flags, said):
    result = ask(*flags, "Hi")
    assert result.exit_code == 2 and said in result.stderr


def test_ask_thinking_on_a_model_without_the_switch_exits_2_with_one_line(tiny_model_dir):
    result = ask("-m", str(tiny_model_dir), "--thinking", "on", "Hi")
    assert result.exit_code == 2
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .endswith("the chat template has no thinking switch (it does not read enable_thinking)")
    )


def test_ask_prints_thought_to_stderr_and_the_answer_to_stdout():
    import sys

    from tui.cli.ask import Printer

    written: list[tuple[str, str]] = []
    write = lambda stream, text: written.append(("out" if stream is sys.stdout else "err", text))  # noqa: E731
    printer = Printer(False, write, on_terminal=False, thought_on_terminal=False)
    said = [("<think>", True), ("hmm", True), ("</think>", True), ("Paris", False)]
    for index, (text, thinking) in enumerate(said):
        printer.emit(TokenSampled(index, index, text, text, -0.1, (), 0.1, index, thinking=thinking))
    assert written == [
        ("err", "<think>"),
        ("err", "hmm"),
        ("err", "</think>"),
        ("err", "\n"),
        ("out", "Paris"),
    ]


def test_the_stats_line_says_what_the_thinking_took():
    from tui.cli.ask import stats_line

    stats = TurnStats(10, 0, 10, 5, 0.1, 0.05, 0.06, 100.0, 20.0, "eos", thought_tokens=3)
    line = stats_line(TurnStats(**{**vars(stats), "first_thought_s": 0.1, "first_answer_s": 0.25}))
    assert "5 tokens | thought 3 tok, first thought 100 ms, first answer 250 ms | stop: eos" in line
    assert "thought" not in stats_line(TurnStats(10, 0, 10, 5, 0.1, 0.05, 0.06, 100.0, 20.0, "eos"))


# -- a server's reasoning fields ----------------------------------------------------------------------
def logprob(token: str, token_id: int | None = None) -> dict:
    entry = {"token": token, "logprob": -0.1, "bytes": list(token.encode()), "top_logprobs": []}
    if token_id is not None:
        entry["id"] = token_id  # llama.cpp's own field
    return entry


def with_logprobs(delta: dict, *tokens: dict) -> dict:
    body = chunk(None)
    body["choices"][0]["delta"] = delta
    body["choices"][0]["logprobs"] = {"content": list(tokens)}
    return body


def delta(**fields) -> dict:
    body = chunk(None)
    body["choices"][0]["delta"] = fields
    return body


SHAPES = {
    # tools/server: the role chunk carries the <think> token's logprobs (its text parsed away),
    # then each token's diff with its logprobs: reasoning_content, then content
    "llama.cpp reasoning_content": [
        with_logprobs({"role": "assistant", "content": None}, logprob("<think>", 9)),
        with_logprobs({"reasoning_content": "hmm"}, logprob("hmm", 10)),
        with_logprobs({"reasoning_content": " ok"}, logprob(" ok", 11)),
        with_logprobs({"content": "Paris"}, logprob("Paris", 12)),
    ],
    # DeltaMessage: `reasoning`, and the deprecated `reasoning_content` copied from it
    "vLLM reasoning (and its copy)": [
        with_logprobs({"reasoning": "hmm", "reasoning_content": "hmm"}, logprob("hmm")),
        with_logprobs({"reasoning": " ok", "reasoning_content": " ok"}, logprob(" ok")),
        with_logprobs({"content": "Paris"}, logprob("Paris")),
    ],
    "vLLM before 0.10: reasoning_content": [
        delta(reasoning_content="hmm"),
        delta(reasoning_content=" ok"),
        delta(content="Paris"),
    ],
    "Ollama's OpenAI API: reasoning, no logprobs": [
        delta(role="assistant", content="", reasoning="hmm"),
        delta(role="assistant", content="", reasoning=" ok"),
        delta(role="assistant", content="Paris"),
    ],
    "thinking": [delta(thinking="hmm"), delta(thinking=" ok"), delta(content="Paris")],
    "no parser on the server: the markers in the content": [
        delta(content="<think>"),
        delta(content="hmm"),
        delta(content=" ok"),
        delta(content="</think>"),
        delta(content="Paris"),
    ],
}


def remote_answer(*chunks: dict):
    from engine.remote.session import connect
    from engine.remote.target import RemoteTarget

    reply = stream_reply(*chunks, chunk(None, finish="stop"))
    with HostileServer({("POST", "/v1/chat/completions"): reply}) as server:
        session = connect(RemoteTarget(server.url), SamplingSettings(temperature=0))
        events = list(session.send("What is the capital of France?"))
        session.close()
    return [e for e in events if isinstance(e, TokenSampled)], events[-1]


@pytest.mark.parametrize("chunks", SHAPES.values(), ids=SHAPES.keys())
def test_a_servers_thought_streams_as_thought_tokens(chunks):
    tokens, finished = remote_answer(*chunks)
    assert [t.thinking for t in tokens] == [True] * (len(tokens) - 1) + [False]
    assert (
        "".join(t.text for t in tokens if t.thinking).replace("<think>", "").replace("</think>", "")
        == "hmm ok"
    )
    assert tokens[-1].text == "Paris" and finished.stats.thought_tokens == len(tokens) - 1
    assert split_saved(finished.text) == (finished.text[: -len("Paris")], "Paris")
    assert finished.text.startswith("<think>") and "hmm ok</think>" in finished.text


@pytest.mark.parametrize("hostile", [5, ["hmm"], {"text": "hmm"}, None, True])
def test_a_reasoning_field_that_is_no_string_is_no_text(hostile):
    tokens, finished = remote_answer(
        delta(reasoning=hostile, reasoning_content=hostile), delta(content="Paris")
    )
    assert [(t.text, t.thinking) for t in tokens] == [("Paris", False)]
    assert finished.text == "Paris" and finished.stats.thought_tokens == 0


def test_a_turn_cut_while_the_server_thought_keeps_the_thought_unclosed():
    tokens, finished = remote_answer(delta(reasoning="hmm"))
    assert [t.thinking for t in tokens] == [True] and finished.text == "<think>hmm"
    assert finished.stats.first_answer_s is None and finished.stats.first_thought_s is not None
