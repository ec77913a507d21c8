"""A misbehaving OpenAI-compatible server on 127.0.0.1, scripted per test: the faults no real
server sends on purpose (hostile text, absurd numbers, malformed JSON, cut or endless streams,
redirects, silence). The main path is proven against a real llama.cpp server in tests/remote/.

A test gives routes: `{("GET", "/v1/models"): reply, ...}`; a reply is a `Reply` (status,
headers, body parts sent one flush each, pauses) or a callable taking the request handler and
sending what it likes. Routes not given answer as a plain OpenAI server with one model, "fake",
whose chat stream says "Hello" in two tokens; `requests` records what the server was sent.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable


@dataclass
class Reply:
    status: int = 200
    parts: list[bytes] = field(default_factory=list)
    """The body, sent one part at a time with a flush (and `pause_s`) between parts."""
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)
    pause_s: float = 0.0
    length: bool = True
    """Send Content-Length (the parts' total); off for a stream cut short or never ended."""
    hang_s: float = 0.0
    """Stay silent this long after the last part, the connection open."""


def json_reply(value: Any, status: int = 200, **kw) -> Reply:
    return Reply(status, [json.dumps(value, allow_nan=True).encode()], **kw)


def raw_json_reply(text: str, status: int = 200) -> Reply:
    """A body written by hand: JSON the stdlib would not write (NaN, 1e999, huge ints)."""
    return Reply(status, [text.encode()])


def chunk(content: str | None = "", finish: str | None = None, **extra: Any) -> dict:
    """One chat.completion.chunk; `extra` merges into the top level (timings, usage, ...);
    `choice=` merges into the one choice (logprobs, token_ids, ...)."""
    choice: dict[str, Any] = {"index": 0, "delta": {"content": content}, "finish_reason": finish}
    choice.update(extra.pop("choice", {}))
    body = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "fake", "choices": [choice]}
    body.update(extra)
    return body


def sse(*events: dict | str | bytes) -> list[bytes]:
    """Server-sent events: dicts as JSON, str as written after `data: `, bytes as they are."""
    out = []
    for event in events:
        if isinstance(event, bytes):
            out.append(event)
        else:
            text = event if isinstance(event, str) else json.dumps(event, allow_nan=True)
            out.append(f"data: {text}\n\n".encode())
    return out


def stream_reply(*events: dict | str | bytes, done: bool = True, **kw) -> Reply:
    """A chat stream of `events`, ended by `[DONE]` unless `done` is False."""
    parts = sse(*events, *(["[DONE]"] if done else []))
    kw.setdefault("length", False)
    return Reply(200, parts, content_type="text/event-stream", **kw)


HELLO = stream_reply(chunk("Hel"), chunk("lo"), chunk("", finish="stop"))
DEFAULTS: dict[tuple[str, str], Reply] = {
    ("GET", "/v1/models"): json_reply({"object": "list", "data": [{"id": "fake", "object": "model"}]}),
    ("POST", "/v1/chat/completions"): HELLO,
}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "_Server"

    def do_GET(self) -> None:
        self._answer("GET")

    def do_POST(self) -> None:
        self._answer("POST")

    def _answer(self, method: str) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        path = self.path.split("?")[0]
        self.server.requests.append((method, self.path, dict(self.headers), body))
        route = self.server.routes.get((method, path)) or DEFAULTS.get((method, path))
        if route is None:
            route = json_reply({"error": {"message": "no such endpoint"}}, status=404)
        if callable(route):
            route(self)
        else:
            send(self, route)

    def log_message(self, *args: Any) -> None:
        pass


def send(handler: BaseHTTPRequestHandler, reply: Reply) -> None:
    """Write `reply` to the client (also for callables that decide first, then send)."""
    try:
        handler.send_response(reply.status)
        handler.send_header("Content-Type", reply.content_type)
        if reply.length:
            handler.send_header("Content-Length", str(sum(len(p) for p in reply.parts)))
        else:
            handler.send_header("Connection", "close")
        for name, value in reply.headers.items():
            handler.send_header(name, value)
        handler.end_headers()
        for part in reply.parts:
            handler.wfile.write(part)
            handler.wfile.flush()
            if reply.pause_s:
                time.sleep(reply.pause_s)
        if reply.hang_s:
            time.sleep(reply.hang_s)
        if not reply.length:
            handler.close_connection = True
    except (BrokenPipeError, ConnectionResetError):
        pass  # the client left: what a hostile server sees when the app stops it


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a hanging handler does not hold up the test's end
    routes: dict
    requests: list


class HostileServer:
    """One scripted server; `url` is its /v1 base. Use as a context manager or call `stop()`."""

    def __init__(self, routes: dict[tuple[str, str], Any] | None = None):
        self.server = _Server(("127.0.0.1", 0), _Handler)
        self.server.routes = dict(routes or {})
        self.server.requests = []
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def requests(self) -> list[tuple[str, str, dict, bytes]]:
        return self.server.requests

    def route(self, method: str, path: str, reply: Any) -> None:
        self.server.routes[(method, path)] = reply

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> "HostileServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def late(reply: Reply, delay_s: float) -> Callable[[BaseHTTPRequestHandler], None]:
    """A route silent for `delay_s` before its status line, then `reply`: a server busy rendering
    a template, or one that took the request and never answers within the test."""

    def answer(handler: BaseHTTPRequestHandler) -> None:
        time.sleep(delay_s)
        send(handler, reply)

    return answer


def models_of(owner: str) -> Reply:
    """/v1/models naming the server's kind the way llama.cpp ("llamacpp") and vLLM ("vllm") do."""
    return json_reply({"object": "list", "data": [{"id": "fake", "object": "model", "owned_by": owner}]})
