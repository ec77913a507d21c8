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
from typing import Any, Callable, Iterator
from urllib.parse import urlsplit, urlunsplit

import httpx2
import openai
from openai.types.chat import ChatCompletionChunk

from engine.remote.cancel import OpenConnections
from engine.remote.target import RemoteTarget, shown_url, url_problem

MAX_BODY = 16 * 2**20
"""The most a side endpoint's reply may hold once decompressed, and the longest line of a stream:
more is no answer of any server (a 3 MB gzip once inflated to 3.4 GB on /v1/models)."""


class RemoteError(RuntimeError):
    """A failure talking to the server; the message is one line for the user, `status` the
    HTTP status where the server answered one."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status

    @property
    def refused(self) -> bool:
        """401/403: the key or the server's permissions; trying the turn again cannot help."""
        return self.status in (401, 403)


def base_url(url: str) -> str:
    """The /v1 base: `http://h:8000` and `http://h:8000/v1/` both become `http://h:8000/v1`
    (a URL no client can use, or one with a query that may hold a key, is refused)."""
    problem = url_problem(url)
    if problem:
        raise RemoteError(f"not a server URL: {problem}")
    parts = urlsplit(url.strip())
    path = parts.path.rstrip("/")
    if not path:
        path = "/v1"
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def root_url(base: str) -> str:
    """Where the non-OpenAI endpoints live: the base without its trailing /v1."""
    parts = urlsplit(base)
    path = parts.path[: -len("/v1")] if parts.path.endswith("/v1") else parts.path
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def api_key(env: str | None) -> str | None:
    """The key from environment variable `env`; a named but empty or unset variable is an error,
    and so is a key no HTTP header can carry (the error names what is wrong, never the key)."""
    if env is None:
        return None
    key = os.environ.get(env, "").strip()
    if not key:
        raise RemoteError(f"--api-key-env {env}: the environment variable {env} is not set")
    problem = _key_problem(key)
    if problem:
        raise RemoteError(f"--api-key-env {env}: the key in ${env} holds {problem}; an API key is one word")
    return key


def _key_problem(key: str) -> str | None:
    """What in `key` cannot go into an Authorization header: a space, a control or non-ASCII character."""
    for c in key:
        if c == " ":
            return "a space"
        if c in "\r\n":
            return "a line break"
        if not c.isascii():
            return "a non-ASCII character"
        if not c.isprintable() or c.isspace():
            return "a control character"
    return None


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
        self._unkeyed = _without(key)
        """Blanks the key out of a message (a server may echo the header it refused)."""
        self.connections = OpenConnections()
        """Both clients' sockets: a stop cuts the call in flight on any of them (engine/remote/cancel.py)."""
        hooks = {"request": [self.connections.track], "response": [_cap_lines]}
        self.openai = openai.OpenAI(
            base_url=self.base,
            api_key=key or "no-key",  # the package insists on one; servers without auth ignore it
            timeout=openai.Timeout(target.read_timeout_s, connect=target.connect_timeout_s),
            max_retries=0,  # a retry would resend the prompt behind the user's back
            # A redirect would take the conversation where --server does not point (a 302 even
            # turns the POST into a GET); `describe` says where it pointed instead.
            http_client=openai.DefaultHttpxClient(event_hooks=hooks, follow_redirects=False),
        )
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.http = httpx2.Client(
            timeout=httpx2.Timeout(target.read_timeout_s, connect=target.connect_timeout_s),
            headers=headers,
            event_hooks=hooks,
            follow_redirects=False,
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
        return self.read_body(self._request("GET", path, False)).decode("utf-8", "replace")

    def probe_json(self, path: str, method: str = "GET", body: dict | None = None) -> Any | None:
        """A side endpoint this server may not have: its JSON, or None on any failure."""
        try:
            return self._json(self._request(method, path, False, body))
        except RemoteError:
            return None

    def _request(self, method: str, path: str, v1: bool, body: dict | None = None) -> httpx2.Response:
        url = (self.base if v1 else self.root) + path
        try:  # streamed, so that no reply is read whole before its size is known
            response = self.http.send(self.http.build_request(method, url, json=body), stream=True)
            if not response.is_success:
                raise _ErrorReply(response, self.read_body(response))
        except (httpx2.HTTPError, ssl.SSLError, OSError, _ErrorReply) as e:
            raise RemoteError(self.describe(e, path), _status(e)[0]) from None
        return response

    def _json(self, response: httpx2.Response) -> Any:
        try:
            return json.loads(self.read_body(response))
        except ValueError:
            raise RemoteError(f"{self.shown}: {response.url.path} did not answer JSON") from None

    def read_body(self, response: httpx2.Response) -> bytes:
        """The reply's bytes, decompressed, refused past MAX_BODY (read as they inflate, so a
        small compressed reply cannot fill memory)."""
        body = bytearray()
        try:
            for part in response.iter_bytes():
                body += part
                if len(body) > MAX_BODY:
                    raise RemoteError(
                        f"{self.shown}: {response.url.path} answered more than {MAX_BODY // 2**20} MiB; "
                        "no server's reply is that long"
                    )
        except (httpx2.HTTPError, OSError) as e:
            raise RemoteError(self.describe(e, response.url.path)) from None
        finally:
            response.close()
        return bytes(body)

    # -- the chat stream ------------------------------------------------------------------
    def stream(self, request: dict) -> ChatStream:
        """Open a streamed chat completion; errors before the first byte become RemoteError."""
        try:
            return ChatStream(self.openai.chat.completions.create(**request), self)
        except (openai.OpenAIError, httpx2.HTTPError, OSError) as e:
            raise RemoteError(self.describe(e, "/chat/completions"), _status(e)[0]) from None

    # -- errors as one line -------------------------------------------------------------------
    def describe(self, error: BaseException, path: str = "", streaming: bool = False) -> str:
        """What went wrong, in one line, with what to do about it where that is clear
        (`streaming`: the answer had begun, so the server was reached and then lost)."""
        return self._unkeyed(self._described(error, path, streaming))

    def _described(self, error: BaseException, path: str, streaming: bool) -> str:
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
        if status is not None and 300 <= status < 400:
            return _redirected(error, status)
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
        """The chunks as they arrive; a broken, stalled or malformed stream raises RemoteError.
        A server that answers with one JSON completion instead of a stream gives it as one chunk."""
        begun = False
        whole = "json" in self._stream.response.headers.get("content-type", "")
        try:
            for chunk in self._whole() if whole else self._stream:
                begun = True
                yield chunk
        except (openai.OpenAIError, httpx2.HTTPError, OSError, ValueError) as e:
            raise RemoteError(self._client.describe(e, streaming=begun)) from None
        finally:
            self.close()

    def _whole(self) -> Iterator[ChatCompletionChunk]:
        """A `chat.completion` object read as the chunk that would have streamed it."""
        reply = json.loads(self._client.read_body(self._stream.response))
        if not isinstance(reply, dict) or not isinstance(reply.get("choices"), list):
            message = _server_message(reply) if isinstance(reply, dict) else ""
            raise ValueError(f"a JSON reply that is no completion{': ' + message if message else ''}")
        for choice in reply["choices"]:
            if isinstance(choice, dict):
                choice["delta"] = choice.pop("message", None)
        yield ChatCompletionChunk.construct(**reply)

    def close(self) -> None:
        try:
            self._stream.close()
        except Exception:  # closing a broken connection can fail in many ways; it is closed either way
            pass


def _status(error: BaseException) -> tuple[int | None, str]:
    """The HTTP status of an error response and the server's message, if any."""
    if isinstance(error, openai.APIStatusError):
        return error.status_code, _server_message(error.body) or _first_line(error)
    if isinstance(error, _ErrorReply):
        try:
            body = json.loads(error.body)
        except ValueError:
            body = error.body.decode("utf-8", "replace")
        return error.response.status_code, _server_message(body)
    return None, ""


class _ErrorReply(Exception):
    """A side endpoint's answer outside 2xx, with its body (read within MAX_BODY)."""

    def __init__(self, response: httpx2.Response, body: bytes):
        super().__init__(f"{response.status_code}")
        self.response = response
        self.body = body


def _redirected(error: openai.APIStatusError | _ErrorReply, status: int) -> str:
    """A redirect, which is never followed: what was asked, where it pointed (both shown without
    a query), and what to do."""
    response = error.response
    location = response.headers.get("location", "")
    try:
        pointed = shown_url(str(response.url.join(location))) if location else "nowhere (no Location)"
    except Exception:  # a Location no URL parser takes is still a redirect; say so
        pointed = "an address that is not a URL"
    return (
        f"{shown_url(str(response.url))} redirected ({status}) to {pointed}; llmchat follows no redirect: "
        "give --server the address the server names, if you trust it"
    )[:300]


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


def _without(key: str | None) -> Callable[[str], str]:
    """A function that blanks `key` out of a message."""
    if not key:
        return lambda message: message
    return lambda message: message.replace(key, "[the key]")


def _cap_lines(response: httpx2.Response) -> None:
    """Refuse a stream line longer than MAX_BODY while it arrives (a server sending megabytes
    without a newline would otherwise fill memory inside the event-stream reader)."""
    response.stream = _LineCapped(response.stream)


class _LineCapped(httpx2.SyncByteStream):
    def __init__(self, stream: Any):
        self.stream = stream

    def __iter__(self) -> Iterator[bytes]:
        run = 0
        for part in self.stream:
            newline = part.rfind(b"\n")
            run = len(part) - newline - 1 if newline >= 0 else run + len(part)
            if run > MAX_BODY:
                raise httpx2.ReadError(f"a line ran past {MAX_BODY // 2**20} MiB without its end")
            yield part

    def close(self) -> None:
        self.stream.close()
