"""A conversation with a model on a server: the second kind of session.

`RemoteSession` takes the same calls as `ChatSession` (send, regenerate, edit, reset,
messages, cancel, sampling) and yields the same events, filled from the server's
OpenAI-compatible stream; whatever the server does not report stays None and the panels say
so. There are no weights and no KV cache here: the server keeps its own prefix cache, and a
turn's "reused" figure is the server's count of prompt tokens it served from it.

A turn that fails (the server dies, stalls, sends garbage) ends like any other, with
TurnFinished: stop 'error', the one-line reason, and the partial answer kept in the
conversation, so Ctrl+R can retry once the server is back.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Generator, Iterator

from engine.capabilities import ON_SERVER
from engine.errors import one_line
from engine.events import (
    CacheChanged,
    ContextTrimmed,
    Event,
    Failed,
    ModelInfo,
    Notice,
    PhaseChanged,
    TurnFinished,
)
from engine.instruments.trace import AnswerTrace
from engine.prompt_format import CHAT_TEMPLATE
from engine.remote import prompt as prompts
from engine.remote.cancel import CancelEvent
from engine.remote.chunks import parse
from engine.remote.client import ChatStream, RemoteClient, RemoteError
from engine.remote.metrics import cache_fill
from engine.remote.request import chat_request, unsupported
from engine.remote.server import Server, reach
from engine.remote.target import RemoteTarget
from engine.remote.token_bytes import SeenTokens
from engine.remote.tokenizer import ServerTokenizer
from engine.remote.turn import Prompt, RemoteTurn
from engine.sampling import SamplingSettings
from engine.session import Message, Turns

NEEDS_LOCAL = "needs the local engine (the server keeps the weights and the KV cache)"


def connect(
    target: RemoteTarget,
    sampling: SamplingSettings | None = None,
    system_prompt: str | None = None,
    context: int | None = None,
    stop: CancelEvent | None = None,
) -> RemoteSession:
    """Reach the server, find out what it is, and open a session; RemoteError says why not
    (setting `stop` cuts the asking short: a quit while a server keeps silent)."""
    started = time.perf_counter()
    client, server = reach(target, stop)
    info = model_info(server, time.perf_counter() - started)
    return RemoteSession(client, server, info, sampling, system_prompt, context)


def model_info(server: Server, connect_s: float) -> ModelInfo:
    """ModelReady's payload: what the server says, None for what it does not."""
    shape = server.shape
    return ModelInfo(
        spec=f"{server.info.model} @ {server.info.url}",
        name=server.info.model.rsplit("/", 1)[-1],
        precision="server",
        device="server",
        compute_dtype=server.info.quantization or "server",
        cache_dtype="f16 (llama-server's default; assumed, not reported)"
        if server.cache_element_bytes
        else "not reported",
        parameters=server.parameters,
        weight_bytes=server.weight_bytes,
        layers=shape.layers if shape else None,
        heads=shape.heads if shape else None,
        kv_heads=shape.kv_heads if shape else None,
        head_dim=shape.head_dim if shape else None,
        hidden_size=shape.hidden_size if shape else None,
        vocab_size=shape.vocab_size if shape else None,
        context=server.context,
        cache_element_bytes=server.cache_element_bytes,
        load_s=connect_s,
        server=server.info,
    )


class RemoteSession(Turns):
    """Messages here, the model and its cache on the server."""

    capabilities = ON_SERVER
    """The server keeps the weights, the KV cache (no cache file) and the decode loop."""
    speculation = None
    """Never speculative here: the server decides how it decodes."""
    prompt_format = CHAT_TEMPLATE
    """The server applies its own chat template."""

    def __init__(
        self,
        client: RemoteClient,
        server: Server,
        info: ModelInfo,
        sampling: SamplingSettings | None = None,
        system_prompt: str | None = None,
        context: int | None = None,
        show_top_k: int = 10,
    ):
        self.client = client
        self.server = server
        self.sampling = sampling or SamplingSettings()
        """Swapped whole, read when a request is built: a change applies from the next answer."""
        self.system_prompt = system_prompt
        self.messages: list[Message] = []
        self.cancel: threading.Event = CancelEvent()
        self.show_top_k = show_top_k
        self.trace: AnswerTrace | None = None
        """The steps of the answer in progress, or of the last one (the token inspector reads them)."""
        self.namer = SeenTokens()
        """Ids to bytes as the server showed them (its tokenizer is not here)."""
        self.server_tokenizer = ServerTokenizer(client, server.dialect, server.info.model, self.namer)
        """The server's own tokenizer, over HTTP (the tokenizer view asks it, off the UI thread)."""
        limits = [c for c in (context, server.context) if c]
        self.context = min(limits) if limits else None
        """The window a conversation must fit: the server's, or less if the user asked (--context)."""
        self.info = info.limited_to(self.context)
        self._noted_unsupported: tuple[str, ...] = ()
        self.request_extra: dict[str, Any] = {}
        """More request fields for this server (the benchmark's `ignore_eos`)."""

    # -- conversation: send, regenerate and edit come from Turns (engine/session.py) -------------
    def fork(self, step: int, token_id: int, answer: int | None = None) -> Iterator[Event]:
        yield Failed(f"forking from a token {NEEDS_LOCAL}")

    def reset(self, system_prompt: str | None = None) -> None:
        self.messages.clear()
        self.system_prompt = system_prompt

    def chat(self, messages: list[Message] | None = None) -> list[dict[str, str]]:
        """The conversation in the OpenAI form; the server applies its own chat template."""
        chat = [
            {"role": m.role, "content": m.content} for m in (self.messages if messages is None else messages)
        ]
        if self.system_prompt:
            chat.insert(0, {"role": "system", "content": self.system_prompt})
        return chat

    def _tokenize(self, messages: list[Message]) -> Prompt:
        """The prompt as the server's tokenizer sees it; unknown once stopped (nothing more is asked)."""
        if self.cancel.is_set():
            return prompts.UNKNOWN
        try:
            return prompts.tokenize(
                self.client, self.server.dialect.tokenize, self.server.info.model, self.chat(messages)
            )
        except Exception:  # a reply no check foresaw: the ids only feed the token panel, the turn goes on
            return prompts.UNKNOWN

    def _fit(self) -> tuple[Prompt | None, ContextTrimmed | None]:
        """Tokenize the conversation, dropping the oldest turns until it fits the server's window
        (as ChatSession does); (None, None) when even the last message alone does not fit.
        Where the server cannot tokenize, the conversation goes as it is and the server decides."""
        messages = list(self.messages)  # trimmed only once the rest is known to fit
        prompt = self._tokenize(messages)
        if not prompt.known or not self.context:
            return prompt, None
        reserve = min(self.sampling.max_new_tokens, self.context // 4)
        before = len(prompt.ids)
        while len(prompt.ids) + reserve > self.context and len(messages) > 1:
            cut = 2 if len(messages) > 2 and messages[1].role == "assistant" else 1
            del messages[:cut]
            prompt = self._tokenize(messages)
        if not prompt.known:  # stopped, or the server stopped tokenizing, midway: nothing is trimmed
            return prompt, None
        if len(prompt.ids) + 1 > self.context:
            return None, None
        dropped = len(self.messages) - len(messages)
        self.messages[:] = messages
        trimmed = ContextTrimmed(dropped, before, len(prompt.ids), self.context) if dropped else None
        return prompt, trimmed

    # -- one turn --------------------------------------------------------------------------------
    def answer(self) -> Iterator[Event]:
        """Stream an answer to the conversation; the partial answer stays whatever happens.

        A stop (Esc, Ctrl+Q, a signal) cuts whatever HTTP call is in flight, the prompt's
        tokenizing included: the turn ends 'cancelled' at once and nothing more is asked."""
        self.cancel.clear()
        with self.client.connections.cut_on(self.cancel):
            yield from self._answer()

    def _answer(self) -> Iterator[Event]:
        prompt, trimmed = self._fit()
        if prompt is None:  # refused before any other event, so SavedChat saves nothing
            yield self._refuse()
            return
        waits = "return_progress" in self.server.dialect.reporting
        turn = RemoteTurn(prompt, time.perf_counter(), waits, self.namer)
        self.trace = AnswerTrace(prompt.ids, None, turn.steps)
        stream, error = None, ""
        try:
            if not self.cancel.is_set():  # stopped while the prompt was prepared: nothing to ask
                stream = self._open(turn)
        except Exception as e:
            if isinstance(e, RemoteError) and e.refused:  # before any other event: nothing is saved
                self.messages.pop()
                yield Failed(str(e), lasting=True)
                return
            error = "" if self.cancel.is_set() else failure(e)
        yield from self._note_unsupported()
        if trimmed:
            yield trimmed
        if stream is not None:
            error = yield from self._read(stream, turn)
        yield from self._finish(turn, error)

    def _refuse(self) -> Failed:
        """The last message alone does not fit the window: take it back, as ChatSession does."""
        size = len(self._tokenize(self.messages[-1:]).ids)
        self.messages.pop()
        return Failed(
            f"the message is {size} tokens; the server's context window is {self.context}: shorten it"
        )

    def _finish(self, turn: RemoteTurn, error: str) -> Iterator[Event]:
        """Keep the answer (partial or not) and end the turn the way every turn ends."""
        if not turn.announced:  # it failed before the server said anything: the phases stay in order
            yield from turn.announce()
        yield from turn.flush()
        text = turn.text()
        stats = turn.stats(turn.stop(self.cancel.is_set(), bool(error), self.context))
        self.trace.reused = turn.reused_tokens()
        self.messages.append(Message("assistant", text, self.trace))
        yield self._cache_event(None if error else turn.context_tokens(), fill=True)
        yield PhaseChanged("idle")
        yield TurnFinished(stats, text, error)

    def _open(self, turn: RemoteTurn) -> ChatStream:
        """Send the chat request; RemoteError if the server will not stream an answer."""
        request = chat_request(
            self.server.info.model, self.chat(), self.sampling, self.server.dialect, self.show_top_k
        )
        if self.request_extra:
            request["extra_body"] = {**request.get("extra_body", {}), **self.request_extra}
        turn.sent()
        return self.client.stream(request)

    def _read(self, stream: ChatStream, turn: RemoteTurn) -> Generator[Event, None, str]:
        """The answer's events as its chunks arrive; returns why it failed ("" if it did not)."""
        try:
            yield from self._stream(stream, turn)
        except Exception as e:  # a failed turn ends like any other, its partial answer kept
            if not self.cancel.is_set():  # a cut we made ourselves is a stop, not an error
                return failure(e)
        return ""

    def _stream(self, stream: ChatStream, turn: RemoteTurn) -> Iterator[Event]:
        yield from turn.opened()
        for chunk in stream.chunks():
            had_tokens, read = turn.entries, parse(chunk)
            if read.entries and had_tokens >= self.sampling.max_new_tokens:
                turn.finish = "length"  # a server that ignores max_tokens would stream on for good
                break
            yield from turn.add(read)
            if turn.entries > had_tokens and turn.context_tokens() is not None:
                yield self._cache_event(turn.context_tokens())
            if self.cancel.is_set():
                break
        stream.close()
        if turn.finish is None and not self.cancel.is_set():
            raise RemoteError(f"the stream from {self.client.shown} ended without its end (no finish_reason)")

    def _note_unsupported(self) -> Iterator[Event]:
        """Say once per change which settings in use this server does not accept."""
        names = tuple(unsupported(self.sampling, self.server.dialect))
        if names and names != self._noted_unsupported:
            kind = self.server.info.kind
            yield Notice(f"{', '.join(names)}: not supported by this server ({kind}); not applied")
        self._noted_unsupported = names

    def sampled_ids(self, message: Message) -> list[int] | None:
        """None: a server's answer goes back to it as text (its prefix cache matches its own ids)."""
        return None

    def cache_event(self) -> CacheChanged:
        """This chat's share is not known until a turn; the server-wide fill is asked now."""
        return self._cache_event(None, fill=True)

    def _cache_event(self, tokens: int | None, fill: bool = False) -> CacheChanged:
        server_fill, source = cache_fill(self.client, self.server.dialect) if fill else (None, "")
        return CacheChanged(
            tokens=tokens,
            bytes=None,
            bytes_per_token=self.info.kv_bytes_per_token,
            capacity=self.context,
            server_fill=server_fill,
            server_fill_source=source,
        )

    def close(self) -> None:
        self.client.close()


def failure(error: Exception) -> str:
    """Why a turn failed, in one line: a RemoteError says it already; anything else is a reply no
    check foresaw, named by its type."""
    return str(error) if isinstance(error, RemoteError) else one_line(error, named=True)
