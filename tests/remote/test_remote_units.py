"""The remote session's pure parts: URLs and keys, the request per server, chunk parsing
(vLLM's shapes included, which this machine cannot serve), the metrics gauge, the GGUF header."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from openai.types.chat import ChatCompletionChunk

from engine.gguf_header import gguf_metadata
from engine.remote import dialects
from engine.remote.chunks import parse
from engine.remote.client import RemoteError, api_key, base_url, root_url, shown_url
from engine.remote.metrics import gauge
from engine.remote.request import chat_request, unsupported
from engine.remote.shape import gguf_shape
from engine.remote.turn import Prompt, RemoteTurn
from engine.sampling import SamplingSettings
from tests.remote.llama_server import smollm2_gguf


@pytest.mark.parametrize(
    "given, base, root",
    [
        ("http://h:8000/v1", "http://h:8000/v1", "http://h:8000"),
        ("http://h:8000/v1/", "http://h:8000/v1", "http://h:8000"),
        ("http://h:8000", "http://h:8000/v1", "http://h:8000"),
        ("https://h/proxy/v1", "https://h/proxy/v1", "https://h/proxy"),
    ],
)
def test_urls(given, base, root):
    assert base_url(given) == base
    assert root_url(base) == root


def test_a_shown_url_carries_no_credentials():
    assert shown_url("https://user:secret@h:8443/v1?key=abc#x") == "https://h:8443/v1"


def test_not_a_url():
    with pytest.raises(RemoteError, match="not a server URL"):
        base_url("localhost:8000")


def test_the_key_comes_from_the_named_variable(monkeypatch):
    monkeypatch.setenv("MY_KEY", "sk-1")
    assert api_key("MY_KEY") == "sk-1"
    assert api_key(None) is None
    monkeypatch.delenv("MY_KEY")
    with pytest.raises(RemoteError, match="MY_KEY is not set") as caught:
        api_key("MY_KEY")
    assert "sk-1" not in str(caught.value)


def test_every_setting_is_sent_explicitly_where_the_server_takes_it():
    settings = SamplingSettings(temperature=0.5, top_k=0, top_p=0.9, min_p=0.05, seed=7, max_new_tokens=9)
    request = chat_request("m", [{"role": "user", "content": "hi"}], settings, dialects.LLAMA_CPP, 10)
    assert request["stream"] and request["logprobs"] and request["top_logprobs"] == 10
    assert request["stream_options"] == {"include_usage": True}
    assert (request["temperature"], request["top_p"], request["seed"], request["max_tokens"]) == (
        0.5,
        0.9,
        7,
        9,
    )
    extra = request["extra_body"]
    # llama-server's own defaults (top-k 40, min-p 0.05) would apply if 'off' were left out.
    assert extra == {
        "timings_per_token": True,
        "return_progress": True,
        "top_k": 0,
        "min_p": 0.05,
        "repeat_penalty": 1.0,
    }
    vllm = chat_request("m", [], settings, dialects.VLLM, 50)["extra_body"]
    assert vllm["top_k"] == -1 and vllm["return_token_ids"] is True and "repeat_penalty" not in vllm
    assert chat_request("m", [], settings, dialects.VLLM, 50)["top_logprobs"] == 20  # the API's cap
    assert "extra_body" not in chat_request("m", [], settings, dialects.GENERIC, 5)


def test_settings_a_server_does_not_take_are_named():
    settings = SamplingSettings(top_k=40, min_p=0.0, repetition_penalty=1.2)
    assert unsupported(settings, dialects.OLLAMA) == ["top_k", "repetition_penalty"]
    assert unsupported(settings, dialects.VLLM) == []
    assert unsupported(SamplingSettings(), dialects.GENERIC) == []


def chunk(**fields) -> ChatCompletionChunk:
    base = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": []}
    return ChatCompletionChunk.model_validate({**base, **fields})


def entry(token, logprob, top, token_id=None):
    item = {"token": token, "bytes": list(token.encode()), "logprob": logprob, "top_logprobs": top}
    return item if token_id is None else {**item, "id": token_id}


def test_a_vllm_chunk_with_several_tokens_and_their_ids():
    raw = chunk(
        system_fingerprint="vllm-tp8",
        choices=[
            {
                "index": 0,
                "delta": {"content": " Paris."},
                "token_ids": [7042, 30],
                "logprobs": {
                    "content": [
                        entry(" Paris", -0.1, [entry(" Paris", -0.1, []), entry(" Lyon", -3.0, [])]),
                        entry(".", -0.5, [entry(".", -0.5, []), entry(",", -1.2, [])]),
                    ]
                },
            }
        ],
    )
    parsed = parse(raw)
    assert [e.id for e in parsed.entries] == [7042, 30]
    assert parsed.entries[0].top[1].id is None  # vLLM's alternatives carry no ids
    assert parsed.entries[0].top[0].prob == pytest.approx(math.exp(-0.1))
    assert parsed.fingerprint == "vllm-tp8"
    turn = RemoteTurn(Prompt((1, 2, 3), ("a", "b", "c")), started=0.0, wait_for_progress=False)
    events = list(turn.add(parsed))
    texts = [e.text for e in events if hasattr(e, "text")]
    assert texts == [" Paris", "."]  # each token's own text from its bytes
    tokens = [e for e in events if hasattr(e, "rank")]
    assert [t.rank for t in tokens] == [1, 1] and [t.position for t in tokens] == [3, 4]


def test_a_llama_cpp_split_character_arrives_as_one_entry():
    """A Korean character over three byte tokens: one entry, the last token's id, all the text."""
    raw = chunk(
        timings={"predicted_n": 3},
        choices=[
            {
                "index": 0,
                "delta": {"content": "어"},
                "logprobs": {
                    "content": [
                        {
                            "id": 129,
                            "token": "어",
                            "bytes": [236, 150, 180],
                            "logprob": -0.007,
                            "top_logprobs": [
                                {"id": 129, "token": "\ufffd", "bytes": [180], "logprob": -0.007}
                            ],
                        }
                    ]
                },
            }
        ],
    )
    parsed = parse(raw)
    assert parsed.entries[0].id == 129 and parsed.entries[0].piece == "<0xB4>"  # its own byte
    turn = RemoteTurn(Prompt((), ()), started=0.0, wait_for_progress=False)
    list(turn.add(parse(chunk(choices=[{"index": 0, "delta": {"content": "x"}}]))))
    list(turn.add(parsed))
    assert turn.text() == "x어" and turn.generated_tokens() == 3  # counted by the server


def test_text_without_logprobs_is_one_token_without_an_id():
    parsed = parse(chunk(choices=[{"index": 0, "delta": {"content": "Hi"}}]))
    assert len(parsed.entries) == 1
    assert (parsed.entries[0].id, parsed.entries[0].logprob, parsed.entries[0].top) == (None, None, ())


def test_usage_and_cached_tokens():
    parsed = parse(
        chunk(
            usage={
                "prompt_tokens": 50,
                "completion_tokens": 7,
                "total_tokens": 57,
                "prompt_tokens_details": {"cached_tokens": 32},
            }
        )
    )
    assert (parsed.usage.prompt_tokens, parsed.usage.completion_tokens, parsed.usage.cached_tokens) == (
        50,
        7,
        32,
    )


def test_metrics_gauge():
    page = (
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75\n'
        "vllm:kv_cache_usage_perc_other 9\n"
    )
    assert gauge(page, "vllm:kv_cache_usage_perc") == 0.5
    assert gauge(page, "sglang:token_usage") is None
    # Read by the Prometheus parser: a NaN sample is no figure, and a page that is no Prometheus
    # page (an HTML error, junk) has none.
    assert gauge(page + 'vllm:kv_cache_usage_perc{engine="2"} NaN\n', "vllm:kv_cache_usage_perc") == 0.5
    assert gauge("<html><body>502</body></html>", "vllm:kv_cache_usage_perc") is None
    assert gauge('vllm:kv_cache_usage_perc{engine="0" 0.25\n', "vllm:kv_cache_usage_perc") is None


def test_gguf_header():
    meta = gguf_metadata(Path(smollm2_gguf()))
    assert meta["general.architecture"] == "llama" and meta["llama.block_count"] == 30
    shape = gguf_shape(smollm2_gguf())
    assert (shape.layers, shape.heads, shape.kv_heads, shape.head_dim) == (30, 9, 3, 64)
    assert gguf_shape("/nonexistent.gguf") is None


def test_a_chunks_gap_is_shared_by_the_tokens_it_carried(monkeypatch):
    """TTFT to the first token; a later chunk of two tokens splits its gap between them."""
    clock = iter([1.0, 1.5, 1.6])
    monkeypatch.setattr("engine.remote.turn.time.perf_counter", lambda: next(clock))

    def tokens(*texts):
        return chunk(
            choices=[
                {
                    "index": 0,
                    "delta": {"content": "".join(texts)},
                    "logprobs": {"content": [entry(t, -0.1, [entry(t, -0.1, [])]) for t in texts]},
                }
            ]
        )

    turn = RemoteTurn(Prompt((), ()), started=0.0, wait_for_progress=False)
    latencies = []
    for raw in (tokens("A"), tokens("B", "C"), tokens("D")):
        latencies += [e.latency_s for e in turn.add(parse(raw)) if hasattr(e, "latency_s")]
    assert latencies == pytest.approx([1.0, 0.25, 0.25, 0.1])
    assert turn.itl == pytest.approx([0.25, 0.25, 0.1]) and turn.ttft_s == 1.0
    stats = turn.stats(turn.stop(False, False, None))
    assert stats.generated_tokens == 4 and stats.itl_p50_s == pytest.approx(0.25)
