"""The inference thread: it alone owns the model and the cache.

Callers talk to it through a command queue and hear back only through events passed to
`emit` (from the worker thread; the TUI turns them into thread-safe messages). Cancel and
sampling changes bypass the queue so they reach an answer in progress at the next token.
"""

from __future__ import annotations

import gc
import queue
import threading
import traceback
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable, Iterator, TypeVar

import torch

from engine import models
from engine.errors import one_line
from engine.events import (
    CachePrecisionChanged,
    Event,
    Failed,
    ModelLoading,
    ModelReady,
    Notice,
    PhaseChanged,
    SamplingResolved,
)
from engine.fast.compiled import start_early
from engine.fast.step_path import decode_step
from engine.kvcache import CACHE_DTYPES, cache_precision_of, cache_precision_problem
from engine.model_sampling import chosen_fields, resolved
from engine.quant.precision import KINDS, PrecisionError, cpu_note, precision_for, resolve_device
from engine.remote.cancel import CancelEvent  # plain threading: the openai package loads only for a server
from engine.sampling import SamplingSettings
from engine.saved.chat import SavedChat
from engine.saved.store import Store
from engine.session import ChatSession
from engine.session_protocol import Session

if TYPE_CHECKING:
    from engine.remote.target import RemoteTarget

T = TypeVar("T")

NO_MODEL = "no model is loaded; load one first"


@dataclass(frozen=True)
class Load:
    spec: str
    precision: str
    device: str
    raw: bool = False
    """The model continues raw text (no chat template: a base model may be loaded)."""
    chat_template: str | None = None
    """A template to use instead of the model's own (its text, engine/chat_templates.py)."""
    thinking: bool | None = None
    """`--thinking on|off`: the template's `enable_thinking`; None leaves its default."""


@dataclass(frozen=True)
class Connect:
    """Talk to a model on a server instead (engine/remote/); the conversation starts anew."""

    target: "RemoteTarget"


@dataclass(frozen=True)
class Send:
    text: str


@dataclass(frozen=True)
class SetSpeculation:
    choice: str | None
    """`lookup`, a draft MODEL[@PRECISION], or None (off: the plain loop)."""
    k: int = 4


@dataclass(frozen=True)
class SetCachePrecision:
    precision: str
    """One of engine/kvcache.py CACHE_PRECISIONS."""


@dataclass(frozen=True)
class Regenerate:
    pass


@dataclass(frozen=True)
class Edit:
    index: int
    text: str


@dataclass(frozen=True)
class NewChat:
    system_prompt: str | None = None


@dataclass(frozen=True)
class Resume:
    ref: int | str
    """A conversation id, or 'last'."""
    use_cache: bool = True


@dataclass(frozen=True)
class StepVersion:
    index: int
    step: int
    """-1 for the previous version of message `index`, +1 for the next."""


@dataclass(frozen=True)
class SaveCache:
    pass


@dataclass(frozen=True)
class Fork:
    step: int
    """Answer step to replace (0 is the answer's first token)."""
    token_id: int
    answer: int | None = None
    """Index of the assistant message in session.messages; None is the last answer."""


@dataclass(frozen=True)
class Call:
    """Run `fn(session)` on the inference thread (instruments that touch the model or cache)."""

    fn: Callable[[Session], Any]
    future: Future


@dataclass(frozen=True)
class _Stop:
    pass


Command = (
    Load
    | Connect
    | Send
    | SetSpeculation
    | SetCachePrecision
    | Regenerate
    | Edit
    | NewChat
    | Resume
    | StepVersion
    | SaveCache
    | Fork
    | Call
    | _Stop
)


class InferenceWorker:
    """Runs commands one at a time on a daemon thread and emits events."""

    def __init__(
        self,
        emit: Callable[[Event], None],
        sampling: SamplingSettings | None = None,
        system_prompt: str | None = None,
        context: int | None = None,
        store: Store | None = None,
        compile: bool = False,
    ):
        self.emit = emit
        self.compile = compile
        """Compile the decode step in the background after each load (engine/fast/compiled.py)."""
        self.store = store
        """Where turns are saved as they finish; None runs without saving."""
        self.chat: SavedChat | None = None
        self.sampling = sampling or SamplingSettings()
        self.chosen: set[str] = set(chosen_fields(self.sampling))
        """The sampling fields the user set (flags, config.json, Settings; any given here that is
        not llmchat's default): a model's own defaults never replace them
        (engine/model_sampling.py)."""
        self.system_prompt = system_prompt
        self.context = context
        self.kv_cache: str | None = None
        """The KV cache precision asked for (None: the model precision's own); kept across loads."""
        self.session: Session | None = None
        self.quitting = CancelEvent()
        """Set by `shutdown`: a server being connected to is not waited for."""
        self.commands: queue.Queue[Command] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="llmchat-inference", daemon=True)
        self._thread.start()

    # -- the calls the UI makes (any thread) -------------------------------------
    def load(
        self,
        spec: str,
        precision: str = "fp32",
        device: str = "auto",
        raw: bool = False,
        chat_template: str | None = None,
        thinking: bool | None = None,
    ) -> None:
        self.commands.put(Load(spec, precision, device, raw, chat_template, thinking))

    def connect(self, target: "RemoteTarget") -> None:
        """Chat with a model on a server: ModelReady (with its ServerInfo) once it answered."""
        self.commands.put(Connect(target))

    def send(self, text: str) -> None:
        self.commands.put(Send(text))

    def set_speculation(self, choice: str | None, k: int = 4) -> None:
        """Speculative decoding from the next answer on (engine/speculative/); None turns it off."""
        self.commands.put(SetSpeculation(choice, k))

    def set_cache_precision(self, precision: str) -> None:
        """The KV cache's precision from the next turn (engine/kvcache.py); one the device cannot
        hold is refused with the reason, and the previous one stays."""
        self.commands.put(SetCachePrecision(precision))

    def regenerate(self) -> None:
        self.commands.put(Regenerate())

    def edit(self, index: int, text: str) -> None:
        self.commands.put(Edit(index, text))

    def new_chat(self, system_prompt: str | None = None) -> None:
        self.commands.put(NewChat(system_prompt))

    def resume(self, ref: int | str, use_cache: bool = True) -> None:
        """Continue a saved conversation: ConversationLoaded, then its KV cache file if it matches."""
        self.commands.put(Resume(ref, use_cache))

    def step_version(self, index: int, step: int) -> None:
        """Show another version of message `index` (ConversationLoaded follows)."""
        self.commands.put(StepVersion(index, step))

    def save_cache(self) -> None:
        """Write the conversation's KV cache file so a later resume needs no prefill."""
        self.commands.put(SaveCache())

    def fork(self, step: int, token_id: int, answer: int | None = None) -> None:
        """Continue an answer from step `step` with `token_id` instead; the old answer stays a branch."""
        self.commands.put(Fork(step, token_id, answer))

    def call(self, fn: Callable[[Session], T]) -> Future[T]:
        """Queue `fn(session)` for the inference thread; the future holds its result or error."""
        future: Future[T] = Future()
        self.commands.put(Call(fn, future))
        return future

    def call_at_gate(self, fn: Callable[[Session], T]) -> T:
        """Run `fn(session)` now, on the caller's thread, while a step waits at the step gate.

        The inference thread is then blocked between two forward passes (a queued `call`
        would wait for the answer to end), so the model is the caller's until it answers the
        step. RuntimeError when no step waits.
        """
        session = self.session
        if session is None or not session.capabilities.can_step or session.step_gate.pending is None:
            raise RuntimeError("no step is waiting at the gate")
        return fn(self.session)

    def cancel(self) -> None:
        """Stop the answer in progress after the current token; the partial answer stays."""
        if self.session is not None:
            self.session.cancel.set()

    def set_sampling(self, settings: SamplingSettings, chosen: Iterable[str] = ()) -> None:
        """Takes effect at the next token, also in the middle of an answer; `chosen` names the
        fields the user set (kept when a model with defaults of its own loads)."""
        self.chosen |= set(chosen)
        self.sampling = settings
        if self.session is not None:
            self.session.sampling = settings

    def update_sampling(self, **changes) -> SamplingSettings:
        """Validate and apply changed fields; raises ValueError with the allowed range."""
        settings = replace(self.sampling, **changes)
        self.set_sampling(settings, chosen=changes)
        return settings

    def shutdown(self, timeout: float = 5.0) -> None:
        self.cancel()
        self._give_up_server()
        self.commands.put(SaveCache())
        self.commands.put(_Stop())
        self._thread.join(timeout)

    def _give_up_server(self) -> None:
        """Quitting waits for no server: a connect in progress, and any call the session has in
        flight or makes from now on (a slow /slots after connecting), are cut."""
        self.quitting.set()
        if self.session is not None and self.session.capabilities.on_server:
            self.session.client.connections.close()

    # -- the thread -----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            command = self.commands.get()
            if isinstance(command, _Stop):
                return
            try:
                for event in self._execute(command):
                    self.emit(event)
            except Exception as e:  # keep the thread alive whatever happens
                traceback.print_exc()
                self.emit(Failed(one_line(e, named=True)))
                self.emit(PhaseChanged("idle"))

    def _execute(self, command: Command) -> Iterator[Event]:
        """The worker's own commands by their handler; the rest are the saved chat's."""
        handler = self._HANDLERS.get(type(command))
        if handler is not None:
            return handler(self, command)
        return self._on_chat(command)

    def _on_chat(self, command: Command) -> Iterator[Event]:
        if self.chat is None:
            if not isinstance(command, SaveCache):  # at quit with no model there is nothing to save
                yield Failed(NO_MODEL)
            return
        yield from _CHAT_COMMANDS[type(command)](self.chat, command)

    def _new_chat(self, command: NewChat) -> Iterator[Event]:
        self.system_prompt = command.system_prompt
        if self.chat is not None:
            yield from save_cache(self.chat)
            self.chat.new(command.system_prompt)

    def _set_speculation(self, command: SetSpeculation) -> Iterator[Event]:
        """A setting that cannot be used says why; the previous one stays."""
        from engine.speculative.loop import make_speculation

        if self.session is None:
            yield Failed(NO_MODEL)
            return
        if not self.session.capabilities.can_speculate:  # a server decides how it decodes
            yield Failed("speculative decoding needs the local engine, not a server")
            return
        if command.choice is None:
            self.session.speculation = None
            yield Notice("speculative decoding off")
            return
        try:
            compile = self.session.compile_wanted  # a draft model's steps compiled as the model's are
            speculation = make_speculation(command.choice, command.k, self.session.loaded, compile=compile)
        except (models.ModelError, PrecisionError, ValueError) as e:
            yield Failed(f"speculative decoding ({command.choice}): {e}")
            return
        self.session.speculation = speculation
        self.session.want_compiled_verify()  # its build starts now, not at the first answer
        yield Notice(f"speculative decoding on: {speculation.drafter.name} drafts {command.k} tokens a round")

    def _set_cache_precision(self, command: SetCachePrecision) -> Iterator[Event]:
        """Before a model is loaded the choice is kept for it; after, the session switches (and
        the next turn prefills again) or says why it cannot, keeping the cache it has."""
        session, precision = self.session, command.precision
        if session is not None and not session.capabilities.has_weights:
            yield Failed("a server keeps its own KV cache: --kv-cache needs the local engine")
            return
        if session is None:
            problem = cache_precision_problem(precision, "cpu")
            if problem:
                yield Failed(f"--kv-cache {precision}: {problem}")
                return
            self.kv_cache = precision
            return
        before = cache_precision_of(session.info.cache_dtype)
        try:
            notice = session.set_cache_precision(precision)
        except ValueError as e:
            yield Failed(f"KV cache {precision}: {e}; it stays {before}")
            return
        self.kv_cache = precision
        yield CachePrecisionChanged(session.info)
        yield decode_step(session)  # a compiled step serves only the cache it was built for
        yield Notice(notice)
        yield from self._follow_compile(session)

    def _call(self, command: Call) -> Iterator[Event]:
        """Emits nothing: the caller hears through the future."""
        yield from ()
        if not command.future.set_running_or_notify_cancel():
            return
        if self.session is None:
            command.future.set_exception(RuntimeError("no model is loaded"))
            return
        try:
            command.future.set_result(command.fn(self.session))
        except Exception as e:  # the caller sees it through the future
            command.future.set_exception(e)

    def _connect(self, command: Connect) -> Iterator[Event]:
        from engine.remote.client import RemoteError  # the openai package loads only for a server
        from engine.remote.session import connect
        from engine.remote.target import shown_url

        target = command.target
        yield ModelLoading(f"connecting to {shown_url(target.url)}", 0.0)  # a query may hold a key
        try:
            session = connect(target, self.sampling, self.system_prompt, self.context, stop=self.quitting)
        except RemoteError as e:
            yield Failed(str(e))
            return
        left = self.session
        if left is not None and left.capabilities.has_weights and left.compiled is not None:
            left.compiled.stop()  # the local model's compile is of no use to a server
        yield from save_cache(self.chat)
        self.session = session
        self.chat = SavedChat(session, self.store)
        if self.quitting.is_set():  # the app is closing; `shutdown` may have looked before this session
            self._give_up_server()
            return
        yield ModelReady(session.info)
        yield session.cache_event()  # the server-wide cache fill, before the first turn

    def _compile_early(self, command: Load) -> None:
        """Start compiling the model's decode step while it loads (engine/fast/compiled.py
        `start_early`), where the session will want it: on a CPU, at a precision whose weights the
        child reads alone (fp32, 16-bit, w8, w4: those whose step compiles), over the precision's
        own KV cache or the one chosen. A spec or precision the load refuses is left to it to say so."""
        if not self.compile:
            return
        try:
            if resolve_device(command.device) != "cpu":
                return
            precision = precision_for(command.precision, "cpu")
        except (PrecisionError, ValueError):
            return
        if not KINDS[precision.name].reads_checkpoint:  # w8a8, bitsandbytes: no compiled step here
            return
        cache_dtype = CACHE_DTYPES[self.kv_cache] if self.kv_cache else precision.cache_dtype
        start_early(command.spec, precision.name, cache_dtype)

    def _read_model(self, command: Load) -> models.LoadedModel:
        """`command`'s model, its decode step compiling meanwhile (`_compile_early`)."""
        self._compile_early(command)
        return models.load(
            command.spec,
            command.precision,
            command.device,
            # Loading runs on this thread, so progress can go straight out.
            progress=lambda stage, fraction: self.emit(ModelLoading(stage, fraction)),
            chat=not command.raw,
            chat_template=command.chat_template,
        )

    def _load(self, command: Load) -> Iterator[Event]:
        if self.session is not None and not self.session.capabilities.has_weights:
            yield Failed("the server decides the model's precision; restart without --server to run one here")
            return
        try:
            loaded = self._read_model(command)
        except (models.ModelError, PrecisionError, ValueError) as e:
            yield Failed(str(e))
            return
        except torch.OutOfMemoryError:
            yield Failed(f"out of memory loading {command.spec} at {command.precision}; try int8 or nf4")
            return
        if self.session is None:
            try:
                self.session = ChatSession(
                    loaded,
                    self.sampling,
                    self.system_prompt,
                    self.context,
                    compile=self.compile,
                    kv_cache=self.kv_cache,
                    raw=command.raw,
                    thinking=command.thinking,
                )
            except models.ModelError as e:  # its fast path did not fit, or --thinking found no switch
                yield Failed(str(e))
                return
            self.chat = SavedChat(self.session, self.store)
        else:
            if self.session.compiled is not None:
                # A compile for the old model would only compete for the cores and memory
                # (a child process of ~0.9 GB each): fp32 -> bf16 -> w8 -> fp32 left four running.
                self.session.compiled.stop()
            yield from save_cache(self.chat)  # the cache belongs to the old model: keep it on disk first
            old = self.session.loaded
            self.session.use_model(loaded)
            del old
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        yield ModelReady(self.session.info)
        yield self._model_sampling(command.spec)
        if not self.session.info.cache_is_default:
            yield Notice(
                f"KV cache {cache_precision_of(self.session.info.cache_dtype)}: {self.session.decode_path()}"
            )
        if loaded.info.device == "cpu":
            note = cpu_note(loaded.info.precision)
            if note:
                yield Notice(note)
        yield decode_step(self.session)
        yield from self._follow_compile(self.session)

    def _model_sampling(self, spec: str) -> SamplingResolved:
        """Answer with the model's own sampling defaults where the user set none."""
        settings, event = resolved(spec, self.sampling, self.chosen)
        self.set_sampling(settings)
        return event

    def _follow_compile(self, session: ChatSession) -> Iterator[Event]:
        """Say that the decode step compiles, where it does, and what decodes once it is built."""
        compiled = session.compiled
        if compiled is None:
            return
        if not compiled.done:
            yield Notice(
                "compiling the decode step in the background (about 10 s the first time, longer "
                "while an answer runs, then a faster whole-model step; 1-3 s once saved); the "
                "eager fast path answers meanwhile"
            )
        # Reported from the compiling thread: the UI's inbox takes events from any thread.
        compiled.when_done(lambda c: self._compile_done(session, c))
        compiled.when_upgraded(lambda c: self._compile_done(session, c))
        compiled.when_verify_built(lambda c: self._verify_built(session, c))
        compiled.when_failed(lambda c: self._compile_done(session, c))

    def _compile_done(self, session: ChatSession, build) -> None:
        """From the compiling thread: say what decodes now, once ready and again when the whole
        step takes over (a stopped build says nothing); from the decoding thread, that a step
        failed while serving and the eager path took over."""
        if session.compiled is build and build.state != "stopped":
            self.emit(decode_step(session))
            self.emit(Notice(build.describe()))

    def _verify_built(self, session: ChatSession, build) -> None:
        """From the compiling thread: say what a speculative verify runs, once its step is built."""
        if session.compiled is build:
            self.emit(Notice(build.describe_verify()))

    _HANDLERS: ClassVar[dict[type, Callable[[InferenceWorker, Any], Iterator[Event]]]] = {
        Load: _load,
        Connect: _connect,
        NewChat: _new_chat,
        Call: _call,
        SetSpeculation: _set_speculation,
        SetCachePrecision: _set_cache_precision,
    }
    """The commands the worker answers itself, whether or not a model is loaded."""


_CHAT_COMMANDS: dict[type, Callable[[SavedChat, Any], Iterator[Event]]] = {
    Send: lambda chat, c: chat.send(c.text),
    Regenerate: lambda chat, c: chat.regenerate(),
    Edit: lambda chat, c: chat.edit(c.index, c.text),
    Fork: lambda chat, c: chat.fork(c.step, c.token_id, c.answer),
    Resume: lambda chat, c: chat.resume(c.ref, c.use_cache),
    StepVersion: lambda chat, c: chat.step_version(c.index, c.step),
    SaveCache: lambda chat, c: save_cache(chat),
}
"""The conversation's commands, answered by the saved chat once a model is loaded."""


def save_cache(chat: SavedChat | None) -> Iterator[Event]:
    """Keep the conversation's KV cache on disk (a conversation being left resumes fast later)."""
    notice = None if chat is None else chat.save_cache()
    if notice is not None:
        yield notice
