"""Rare faults a real server will not produce on demand, from a small fake one: a malformed
event stream and a server that stalls mid-answer. (The main path is proven against a real
llama.cpp server in test_llama_server.py; a wrong key is too, there.)"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from engine.events import TokenSampled, TurnFinished
from engine.remote.client import RemoteError
from engine.remote.session import connect
from engine.remote.target import RemoteTarget
from engine.sampling import SamplingSettings


def sse(content: str) -> bytes:
    chunk = {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "fake",
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}],
    }
    return f"data: {json.dumps(chunk)}\n\n".encode()


class FakeServer(BaseHTTPRequestHandler):
    """GET /v1/models lists one model; the chat stream sends two tokens, then the fault."""

    fault = "malformed"

    def do_GET(self):
        if self.path == "/v1/models":
            self._send(
                200, "application/json", json.dumps({"data": [{"id": "fake", "owned_by": "me"}]}).encode()
            )
        else:
            self._send(404, "application/json", b'{"error": {"message": "no such endpoint"}}')

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(sse("Hel") + sse("lo"))
        self.wfile.flush()
        if self.fault == "malformed":
            self.wfile.write(b'data: {"choices": [{"delta": {"content": "!"\n\n')
        else:  # stall: silent while the client waits
            time.sleep(3)
        self.wfile.flush()

    def _send(self, status, kind, body):
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_server():
    def start(fault: str) -> str:
        handler = type("Handler", (FakeServer,), {"fault": fault})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True  # a stalled handler does not hold up the test's end
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/v1"

    servers = []
    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def answer(url: str, **target) -> tuple[list, TurnFinished]:
    session = connect(RemoteTarget(url, **target), SamplingSettings(temperature=0))
    events = list(session.send("Hi"))
    assert session.messages[-1].content == events[-1].text  # the partial answer stays
    return events, events[-1]


def test_a_malformed_stream_ends_the_turn_with_one_line(fake_server):
    events, finished = answer(fake_server("malformed"))
    assert finished.stats.stop == "error" and "malformed event stream" in finished.error
    assert "\n" not in finished.error
    assert finished.text == "Hello" and len([e for e in events if isinstance(e, TokenSampled)]) == 2


def test_a_stalled_server_hits_the_read_timeout(fake_server):
    _, finished = answer(fake_server("stall"), read_timeout_s=0.5)
    assert finished.stats.stop == "error" and "sent nothing for 0.5 s" in finished.error
    assert finished.text == "Hello"


def test_a_plain_openai_server_is_detected_as_such(fake_server):
    session = connect(RemoteTarget(fake_server("malformed")))
    assert session.info.server.kind == "openai-compatible"
    assert session.info.kv_bytes_per_token is None and session.info.context is None


def test_a_tls_error_is_one_line():
    """A server that answers a TLS hello with plain HTTP."""
    listener = socket.create_server(("127.0.0.1", 0))

    def answer_in_plain_http():
        conn, _ = listener.accept()
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
        conn.close()

    threading.Thread(target=answer_in_plain_http, daemon=True).start()
    try:
        with pytest.raises(RemoteError, match=r"^TLS error talking to https://127.0.0.1:\d+/v1: "):
            connect(RemoteTarget(f"https://127.0.0.1:{listener.getsockname()[1]}/v1"))
    finally:
        listener.close()


def test_a_wrong_path_says_where_it_looked(fake_server):
    url = fake_server("malformed").replace("/v1", "/api")
    with pytest.raises(RemoteError, match=r"/api/models: not found \(404\)"):
        connect(RemoteTarget(url))
