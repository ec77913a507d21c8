"""Side endpoints that answer JSON of the wrong shape (issue 31): a list or a string where an
object belongs, models without ids, token lists that are not lists of ids. Each is read as 'not
reported' where the app can do without it, else one line; never a traceback."""

from __future__ import annotations

import pytest

from engine.events import TurnFinished
from engine.remote.client import RemoteError
from engine.remote.session import connect
from engine.remote.target import RemoteTarget
from engine.sampling import SamplingSettings
from tests.reliability.hostile_server import json_reply, raw_json_reply

SIDE = ["/props", "/version", "/get_server_info", "/api/version", "/slots", "/v1/models/fake"]
WRONG = {"a list": [1, 2], "a string": "hello", "a number": 7, "null": None, "nested junk": {"a": [{}]}}


@pytest.mark.parametrize("path", SIDE)
@pytest.mark.parametrize("shape", WRONG)
def test_a_side_endpoint_of_the_wrong_shape_is_not_reported(hostile, path, shape):
    server = hostile({("GET", path): json_reply(WRONG[shape])})
    session = connect(RemoteTarget(server.url), SamplingSettings(temperature=0))
    finished = list(session.send("Hi"))[-1]
    assert isinstance(finished, TurnFinished) and finished.text == "Hello"


TOKENIZE = {
    "ids missing": {"nothing": 1},
    "ids a string": {"tokens": "1 2 3"},
    "ids infinite": '{"tokens": [1, Infinity]}',
    "ids a dict": {"tokens": {"a": 1}},
    "tokens without id": {"tokens": [{"piece": "x"}]},
}


@pytest.mark.parametrize("case", TOKENIZE)
def test_a_malformed_tokenize_leaves_the_prompt_unknown(hostile, case):
    body = TOKENIZE[case]
    reply = raw_json_reply(body) if isinstance(body, str) else json_reply(body)
    props = {"model_path": "x.gguf", "n_ctx": 4096, "build_info": "b1", "chat_template": "t"}
    server = hostile({("GET", "/props"): json_reply(props), ("POST", "/tokenize"): reply})
    session = connect(RemoteTarget(server.url), SamplingSettings(temperature=0))
    finished = list(session.send("Hi"))[-1]
    assert isinstance(finished, TurnFinished) and finished.text == "Hello"


@pytest.mark.parametrize("models", [{"data": [{"object": "model"}]}, {"data": "x"}, [1], {"data": [1, "a"]}])
def test_a_model_list_without_ids_is_one_line(hostile, models):
    server = hostile({("GET", "/v1/models"): json_reply(models)})
    with pytest.raises(RemoteError) as refused:
        connect(RemoteTarget(server.url))
    assert "\n" not in str(refused.value) and "model" in str(refused.value)


LLAMA_PROPS = {"model_path": "x.gguf", "n_ctx": 4096, "build_info": "b1", "chat_template": "t"}
PIECES = {
    "tokens without id": {"tokens": [{"piece": "x"}]},
    "an id a string": {"tokens": [{"id": "7", "piece": "x"}]},
    "an id infinite": '{"tokens": [{"id": Infinity, "piece": "x"}]}',
    "an id a dict": {"tokens": [{"id": {"a": 1}, "piece": "x"}]},
    "a piece of bad bytes": {"tokens": [{"id": 1, "piece": [999, "a", -1]}]},
    "ids not a list": {"tokens": 5},
}


@pytest.mark.parametrize("case", PIECES)
def test_a_malformed_tokenize_in_the_tokenizer_view_is_one_line(hostile, case):
    """F5 on a server asks /tokenize for pieces; a reply without ids ended the whole app (rc 1)."""
    body = PIECES[case]
    reply = raw_json_reply(body) if isinstance(body, str) else json_reply(body)
    server = hostile({("GET", "/props"): json_reply(LLAMA_PROPS), ("POST", "/tokenize"): reply})
    tokenizer = connect(RemoteTarget(server.url)).server_tokenizer
    assert tokenizer.available
    try:
        pieces = tokenizer.pieces("hi")
    except RemoteError as e:
        assert "\n" not in str(e)
    else:  # read, where what came can be read
        assert case == "a piece of bad bytes" and pieces == [(1, b"")]
