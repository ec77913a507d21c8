"""Detection and requests for the servers this machine cannot run (vLLM, SGLang, Ollama),
against a fake that answers their documented endpoints and records what it was sent. The
real path is proven against llama.cpp in test_llama_server.py; this checks the routing."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from engine.events import TurnFinished
from engine.remote.session import connect
from engine.remote.target import RemoteTarget
from engine.sampling import SamplingSettings

SERVERS = {
    "vllm": {
        # ModelList/ModelCard of vllm/entrypoints/openai/protocol.py, every field as vLLM fills it
        "/v1/models": {
            "object": "list",
            "data": [
                {
                    "id": "meta-llama/Llama-3.1-70B-Instruct",
                    "object": "model",
                    "created": 1764556800,
                    "owned_by": "vllm",
                    "root": "meta-llama/Llama-3.1-70B-Instruct",
                    "parent": None,
                    "max_model_len": 8192,
                    "permission": [
                        {
                            "id": "modelperm-5c1d7c0a8d4e4b1c9e0f",
                            "object": "model_permission",
                            "created": 1764556800,
                            "allow_create_engine": False,
                            "allow_sampling": True,
                            "allow_logprobs": True,
                            "allow_search_indices": False,
                            "allow_view": True,
                            "allow_fine_tuning": False,
                            "organization": "*",
                            "group": None,
                            "is_blocking": False,
                        }
                    ],
                }
            ],
        },
        "/version": {"version": "0.11.0"},
        "/metrics": 'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.125\n',
    },
    "sglang": {
        # SGLang's ModelList/ModelCard (sglang/srt/entrypoints/openai/protocol.py): no permissions
        "/v1/models": {
            "object": "list",
            "data": [
                {
                    "id": "qwen",
                    "object": "model",
                    "created": 1764556800,
                    "owned_by": "sglang",
                    "root": "qwen",
                    "max_model_len": 32768,
                }
            ],
        },
        "/get_server_info": {"version": "0.5.0", "tp_size": 8, "dp_size": 2},
        "/metrics": 'sglang:token_usage{model_name="qwen"} 0.5\n',
    },
    "ollama": {
        # Ollama's /v1/models (openai/openai.go ToListCompletion): owned_by is the name's namespace
        "/v1/models": {
            "object": "list",
            "data": [{"id": "llama3.2:1b", "object": "model", "created": 1764556800, "owned_by": "library"}],
        },
        "/api/version": {"version": "0.12.3"},
    },
}


def chunk(**choice) -> bytes:
    body = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": [choice]}
    return f"data: {json.dumps(body)}\n\n".encode()


def answer_with(kind: str) -> bytes:
    logprobs = {"content": [{"token": "Hi", "bytes": [72, 105], "logprob": -0.2, "top_logprobs": []}]}
    extra = {"token_ids": [13347]} if kind == "vllm" else {}
    usage = {
        "prompt_tokens": 20,
        "completion_tokens": 1,
        "total_tokens": 21,
        "prompt_tokens_details": {"cached_tokens": 16},
    }
    done = {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "m",
        "choices": [],
        "usage": usage,
    }
    return (
        chunk(index=0, delta={"content": "Hi"}, logprobs=logprobs, **extra)
        + chunk(index=0, delta={}, finish_reason="stop")
        + f"data: {json.dumps(done)}\n\ndata: [DONE]\n\n".encode()
    )


@pytest.fixture
def fake():
    servers = []

    def start(kind: str):
        routes, sent = SERVERS[kind], []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                body = routes.get(self.path)
                if body is None:
                    self._reply(404, b'{"error": {"message": "not found"}}')
                else:
                    self._reply(200, (body if isinstance(body, str) else json.dumps(body)).encode())

            def do_POST(self):
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                sent.append((self.path, request))
                if self.path != "/v1/chat/completions":
                    self._reply(404, b'{"error": {"message": "not found"}}')
                    return
                self._reply(200, answer_with(kind), "text/event-stream")

            def _reply(self, status, body, kind="application/json"):
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/v1", sent

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def chat(url: str) -> tuple:
    session = connect(RemoteTarget(url), SamplingSettings(temperature=0, top_k=0, min_p=0.1))
    events = list(session.send("Hello"))
    return session, events


def test_vllm(fake):
    url, sent = fake("vllm")
    session, events = chat(url)
    info = session.info
    assert (info.server.kind, info.server.version, info.context) == ("vllm", "0.11.0", 8192)
    assert info.kv_bytes_per_token is None  # vLLM does not expose the model's shape
    request = dict(sent)["/v1/chat/completions"]
    assert request["return_token_ids"] is True and request["top_k"] == -1 and request["min_p"] == 0.1
    assert request["logprobs"] is True and request["stream_options"] == {"include_usage": True}
    finished = events[-1]
    assert isinstance(finished, TurnFinished) and finished.text == "Hi"
    assert finished.stats.reused_tokens == 16  # usage.prompt_tokens_details.cached_tokens
    token = next(e for e in events if getattr(e, "text", None) == "Hi" and hasattr(e, "rank"))
    assert token.id == 13347  # from the choice's token_ids
    cache = [e for e in events if hasattr(e, "server_fill")][-1]
    assert cache.server_fill == 0.125 and cache.server_fill_source == "vllm:kv_cache_usage_perc"


def test_sglang(fake):
    url, sent = fake("sglang")
    session, events = chat(url)
    assert session.info.server.kind == "sglang"
    assert session.info.server.parallelism == "tensor parallel 8, data parallel 2"
    request = dict(sent)["/v1/chat/completions"]
    assert request["return_cached_tokens_details"] is True and request["top_k"] == -1
    cache = [e for e in events if hasattr(e, "server_fill")][-1]
    assert cache.server_fill == 0.5


def test_ollama(fake):
    url, sent = fake("ollama")
    session = connect(RemoteTarget(url), SamplingSettings(temperature=0, top_k=40))
    events = list(session.send("Hello"))
    assert (session.info.server.kind, session.info.server.version) == ("ollama", "0.12.3")
    request = dict(sent)["/v1/chat/completions"]
    assert "top_k" not in request and "min_p" not in request  # not sent to a server that does not take them
    notice = next(e for e in events if type(e).__name__ == "Notice")
    assert "top_k: not supported by this server (ollama)" in notice.message
    assert session.info.server.unsupported_settings == ("top_k", "min_p", "repetition_penalty")
