"""The wire: an OpenAI-compatible chat stream (the `openai` package) and the server's side
endpoints (/props, /slots, /metrics, /tokenize, /version, ...) over `httpx2`, the
httpx-compatible client `openai` 3 is itself built on: one HTTP stack. Plain httpx 0.28 would
not do here: importing it loads its command line, and with it Rich, whenever Rich is
installed, and engine/ stays free of UI libraries.

Every failure leaves this module as a `RemoteError` whose message is one line a user can act
on (unreachable, TLS, 401/403, 404, a timeout, a broken or malformed stream), never a traceback.
The API key is read from the environment variable the user names and is kept only inside the
two HTTP clients: never in a field, a message or a log line.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
from typing import Any, Iterator
from urllib.parse import urlsplit, urlunsplit

import httpx2
import openai
from openai.types.chat import ChatCompletionChunk

from engine.remote.cancel import OpenConnections
from engine.remote.target import RemoteTarget


class RemoteError(RuntimeError):
    """A failure talking to the server; the message is one line for the user."""


def base_url(url: str) -> str:
    """The /v1 base: `http://h:8000` and `http://h:8000/v1/` both become `http://h:8000/v1`."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise RemoteError(f"not a server URL: {shown_url(url)!r}; expected http(s)://host:port/v1")
    path = parts.path.rstrip("/")
    if not path:
        path = "/v1"
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def root_url(base: str) -> str:
    """Where the non-OpenAI endpoints live: the base without its trailing /v1."""
    parts = urlsplit(base)
    path = parts.path[: -len("/v1")] if parts.path.endswith("/v1") else parts.path
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def shown_url(url: str) -> str:
    """The URL as it may be shown and saved: no user:password, query or fragment."""
    parts = urlsplit(url.strip())
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))


def api_key(env: str | None) -> str | None:
    """The key from environment variable `env`; a named but empty or unset variable is an error."""
    if env is None:
        return None
    key = os.environ.get(env, "").strip()
    if not key:
        raise RemoteError(f"--api-key-env {env}: the environment variable {env} is not set")
    return key


class RemoteClient:
    """One server: its chat stream and its side endpoints, with one-line errors."""

    def __init__(self, target: RemoteTarget):
        self.base = base_url(target.url)
        self.root = root_url(self.base)
        self.shown = shown_url(self.base)
        self.key_env = target.api_key_env
        self.read_timeout_s = target.read_timeout_s
        self.connect_timeout_s = target.connect_timeout_s
        key = api_key(target.api_key_env)
        self.connections = OpenConnections()
        """Both clients' sockets: a stop cuts the call in flight on any of them (engine/remote/cancel.py)."""
        hooks = {"request": [self.connections.track]}
        self.openai = openai.OpenAI(
            base_url=self.base,
            api_key=key or "no-key",  # the package insists on one; servers without auth ignore it
            timeout=openai.Timeout(target.read_timeout_s, connect=target.connect_timeout_s),
            max_retries=0,  # a retry would resend the prompt behind the user's back
            http_client=openai.DefaultHttpxClient(event_hooks=hooks),
        )
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.http = httpx2.Client(
            timeout=httpx2.Timeout(target.read_timeout_s, connect=target.connect_timeout_s),
            headers=headers,
            event_hooks=hooks,
        )

    def close(self) -> None:
        self.http.close()
        self.openai.close()

    # -- side endpoints -----------------------------------------------------------------
    def get_json(self, path: str, v1: bool = False) -> Any:
        """GET a JSON document (path under the root, or under /v1 with `v1`)."""
        return self._json(self._request("GET", path, v1))

    def post_json(self, path: str, body: dict, v1: bool = False) -> Any:
        return self._json(self._request("POST", path, v1, body))

    def get_text(self, path: str) -> str:
        return self._request("GET", path, False).text

    def probe_json(self, path: str, method: str = "GET", body: dict | None = None) -> Any | None:
        """A side endpoint this server may not have: its JSON, or None on any failure."""
        try:
            return self._json(self._request(method, path, False, body))
        except RemoteError:
            return None

    def _request(self, method: str, path: str, v1: bool, body: dict | None = None) -> httpx2.Response:
        url = (self.base if v1 else self.root) + path
        try:
            response = self.http.request(method, url, json=body)
            response.raise_for_status()
        except (httpx2.HTTPError, ssl.SSLError, OSError) as e:
            raise RemoteError(self.describe(e, path)) from None
        return response

    def _json(self, response: httpx2.Response) -> Any:
        try:
            return response.json()
        except ValueError:
            raise RemoteError(f"{self.shown}: {response.url.path} did not answer JSON") from None

    # -- the chat stream ------------------------------------------------------------------
    def stream(self, request: dict) -> ChatStream:
        """Open a streamed chat completion; errors before the first byte become RemoteError."""
        try:
            return ChatStream(self.openai.chat.completions.create(**request), self)
        except (openai.OpenAIError, httpx2.HTTPError, OSError) as e:
            raise RemoteError(self.describe(e, "/chat/completions")) from None

    # -- errors as one line -------------------------------------------------------------------
    def describe(self, error: BaseException, path: str = "", streaming: bool = False) -> str:
        """What went wrong, in one line, with what to do about it where that is clear
        (`streaming`: the answer had begun, so the server was reached and then lost)."""
        status, detail = _status(error)
        where = self.shown
        if status in (401, 403):
            hint = (
                f"check the key in ${self.key_env}"
                if self.key_env
                else "pass --api-key-env VAR naming the variable that holds the key"
            )
            return f"{where} refused the request ({status}{': ' + detail if detail else ''}); {hint}"
        if status == 404:
            return f"{where}{path}: not found (404); is {where} the server's OpenAI base (usually …/v1)?"
        if status is not None:
            return f"{where} answered {status}: {detail or 'no detail'}"[:300]
        cause = _root_cause(error)
        if _caused_by(error, httpx2.ConnectTimeout):
            tls = " (a TLS handshake unanswered: does it speak https?)" if where.startswith("https") else ""
            return f"no answer from {where} within {self.connect_timeout_s:g} s while connecting{tls}"
        if isinstance(error, (openai.APITimeoutError, httpx2.TimeoutException, socket.timeout)):
            return (
                f"{where} sent nothing for {self.read_timeout_s:g} s (read timeout; "
                "--read-timeout changes it)"
            )
        if isinstance(cause, ssl.SSLError):
            return f"TLS error talking to {where}: {_first_line(cause)}"
        if isinstance(error, (json.JSONDecodeError, ValueError)) and not isinstance(cause, OSError):
            return f"{where} sent a malformed event stream: {_first_line(error)}"
        reason = _first_line(cause) or type(cause).__name__
        if streaming:
            return f"the connection to {where} broke mid-answer: {reason}"[:300]
        return f"cannot reach {where}: {reason}"[:300]


class ChatStream:
    """An open chat completion stream and its chunks (a stop cuts it through `RemoteClient.connections`)."""

    def __init__(self, stream: openai.Stream, client: RemoteClient):
        self._stream = stream
        self._client = client

    def chunks(self) -> Iterator[ChatCompletionChunk]:
        """The chunks as they arrive; a broken, stalled or malformed stream raises RemoteError."""
        begun = False
        try:
            for chunk in self._stream:
                begun = True
                yield chunk
        except (openai.OpenAIError, httpx2.HTTPError, OSError, ValueError) as e:
            raise RemoteError(self._client.describe(e, streaming=begun)) from None
        finally:
            self.close()

    def close(self) -> None:
        try:
            self._stream.close()
        except Exception:  # closing a broken connection can fail in many ways; it is closed either way
            pass


def _status(error: BaseException) -> tuple[int | None, str]:
    """The HTTP status of an error response and the server's message, if any."""
    if isinstance(error, openai.APIStatusError):
        return error.status_code, _server_message(error.body) or _first_line(error)
    if isinstance(error, httpx2.HTTPStatusError):
        try:
            body = error.response.json()
        except ValueError:
            body = error.response.text
        return error.response.status_code, _server_message(body)
    return None, ""


def _server_message(body: Any) -> str:
    """The message inside an OpenAI-style error body ({"error": {"message": ...}}) or a plain one."""
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict):
            return _first_line(inner.get("message") or inner.get("detail") or "")
        return _first_line(inner)
    return _first_line(body or "")


def _chain(error: BaseException) -> list[BaseException]:
    """The error and what caused it, outermost first."""
    chain = [error]
    while True:
        nxt = chain[-1].__cause__ or chain[-1].__context__
        if nxt is None or any(nxt is seen for seen in chain):
            return chain
        chain.append(nxt)


def _root_cause(error: BaseException) -> BaseException:
    """The innermost exception: 'Connection refused' rather than 'Connection error.'"""
    return _chain(error)[-1]


def _caused_by(error: BaseException, kind: type) -> bool:
    return any(isinstance(e, kind) for e in _chain(error))


def _first_line(value: Any) -> str:
    lines = str(value).strip().splitlines()
    return lines[0][:240] if lines else ""
