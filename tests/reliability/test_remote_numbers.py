"""Numbers and shapes a server sends are untrusted input (issue 31): a logprob past exp's range, a
count past any integer column, a chunk of the wrong shape. The turn either reads them as 'not
reported' or ends with one line; the answer shown so far is kept either way."""

from __future__ import annotations

import json
import math

import pytest

from engine.events import TokenSampled, TurnFinished, to_json
from engine.remote.session import connect
from engine.remote.target import RemoteTarget
from engine.sampling import SamplingSettings
from tests.reliability.hostile_server import Reply, chunk, stream_reply


def alternatives(logprob: float) -> dict:
    entry = {"token": "lo", "logprob": logprob, "bytes": [108, 111]}
    return {"logprobs": {"content": [{**entry, "top_logprobs": [entry]}]}}


CASES = {
    "logprob past exp's range": [chunk("Hel"), chunk("lo", choice=alternatives(800.0))],
    "a positive logprob": [chunk("Hel"), chunk("lo", choice=alternatives(3.0))],
    "a count past any column": [chunk("Hel"), chunk("lo"), chunk("", usage={"prompt_tokens": 10**30})],
    "a chunk without choices": [chunk("Hel"), {"id": "c", "object": "chat.completion.chunk", "model": "f"}],
    "content a number": [chunk("Hel"), chunk(5)],
    "logprobs content a string": [chunk("Hel"), chunk("lo", choice={"logprobs": {"content": "x"}})],
}
READ_AS_NOT_REPORTED = {"logprob past exp's range", "a positive logprob", "a count past any column"}


@pytest.mark.parametrize("case", CASES)
def test_what_the_server_sends_never_escapes_the_turn(hostile, case):
    server = hostile({("POST", "/v1/chat/completions"): stream_reply(*CASES[case], chunk("", finish="stop"))})
    session = connect(RemoteTarget(server.url), SamplingSettings(temperature=0))
    events = list(session.send("Hi"))
    finished = events[-1]
    assert isinstance(finished, TurnFinished), events[-3:]
    assert finished.text.startswith("Hel") and session.messages[-1].content == finished.text
    assert "\n" not in (finished.error or "")
    if case in READ_AS_NOT_REPORTED:  # a number out of range is not a reason to end the turn
        assert not finished.error and finished.stats.stop == "eos" and finished.text == "Hello"
    for token in (e for e in events if isinstance(e, TokenSampled)):
        assert token.logprob is None or (math.isfinite(token.logprob) and token.logprob <= 0)
        assert all(0 <= c.prob <= 1 for c in token.top_k)
    stats = finished.stats
    assert stats.prompt_tokens is None or stats.prompt_tokens < 2**63


TIMINGS = {
    "timings NaN and infinite": '{"prompt_ms": NaN, "predicted_ms": Infinity, "predicted_per_token_ms": -Infinity}',  # noqa: E501
    "a count that would fill memory": '{"predicted_n": 1000000000000000, "cache_n": 1000000000000000}',
    "more cached than prompted": '{"prompt_n": 3, "cache_n": 50}',
}


@pytest.mark.parametrize("case", TIMINGS)
def test_server_timings_out_of_range_are_read_as_not_reported(hostile, case):
    last = json.dumps(chunk("", finish="stop", usage={"prompt_tokens": 10, "completion_tokens": 2}))
    last = last[:-1] + f', "timings": {TIMINGS[case]}}}'
    server = hostile({("POST", "/v1/chat/completions"): stream_reply(chunk("Hel"), chunk("lo"), last)})
    session = connect(RemoteTarget(server.url), SamplingSettings(temperature=0))
    finished = list(session.send("Hi"))[-1]
    assert finished.text == "Hello" and not finished.error
    written = json.dumps(to_json(finished), allow_nan=False)  # what `ask --json` writes: valid JSON
    assert "NaN" not in written and "Infinity" not in written
    stats = finished.stats
    assert stats.prefilled_tokens is None or stats.prefilled_tokens >= 0
    assert stats.generated_tokens < 10**6


ENDLESS = [chunk(f"t{i} ") for i in range(40)]
CUT = {
    "cut after four tokens": stream_reply(*ENDLESS[:4], done=False),
    "an empty 200": Reply(200, [], content_type="text/event-stream", length=False),
    "[DONE] alone": stream_reply(),
    "an html page": Reply(200, [b"<html><body>maintenance</body></html>"], content_type="text/html"),
}


@pytest.mark.parametrize("case", CUT)
def test_a_stream_that_ends_without_its_end_says_so_and_keeps_what_came(hostile, case):
    server = hostile({("POST", "/v1/chat/completions"): CUT[case]})
    session = connect(RemoteTarget(server.url), SamplingSettings(temperature=0))
    finished = list(session.send("Hi"))[-1]
    assert finished.stats.stop == "error" and finished.error, finished
    assert "\n" not in finished.error
    assert session.messages[-1].content == finished.text
    if case == "cut after four tokens":
        assert finished.text == "t0 t1 t2 t3 " and "ended without its end" in finished.error


def test_a_server_that_ignores_max_tokens_is_stopped_at_it(hostile):
    server = hostile({("POST", "/v1/chat/completions"): stream_reply(*ENDLESS, chunk("", finish="stop"))})
    session = connect(RemoteTarget(server.url), SamplingSettings(temperature=0, max_new_tokens=8))
    finished = list(session.send("Hi"))[-1]
    assert finished.stats.stop == "length" and not finished.error
    assert finished.text == "".join(f"t{i} " for i in range(8))
