"""`llmchat ask`: answer prompts headless, each turn saved as in the app.

The steps, in order: check the flags, open a session (a model here, or a server), open the store,
answer each prompt (stdout the answer or JSON Lines, stderr a stats line per turn), save the KV
cache, and exit with the status README.md documents: 0, 1 for a cut answer, 2 for what no retry
can mend, 128+N for a signal (tui/cli/stops.py).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import typer

from engine import DEFAULT_MODEL
from tui.cli import remote
from tui.cli.checks import check_engine_flags, sampling_from, text_problem
from tui.cli.exits import FAILED, USAGE, fail, refuse
from tui.fmt import (
    count,
    decode_rate,
    gap_ms,
    model_sampling_note,
    prefill_rate,
    system_default_note,
    thinking_part,
    visible_controls,
)
from tui.options import system_or_default, thinking_wanted

ASK_DECODES = "ask runs the eager step: a one-shot command does not wait for a compile"
DIM, UNDIM = "\x1b[2m", "\x1b[22m"
"""How thought is shown on a terminal's stderr: faint, apart from the answer on stdout."""


@dataclass(frozen=True)
class AskFlags:
    """`ask`'s command line, as typer parsed it."""

    prompts: list[str]
    model: str | None
    precision: str | None
    device: str | None
    sampling: dict[str, Any]
    system: str | None
    context: int | None
    as_json: bool
    conversation: str | None
    no_save: bool
    speculative: str | None
    draft_tokens: int | None
    kv_cache: str | None
    raw: bool
    chat_template: str | None
    thinking: str | None
    server: str | None
    api_key_env: str | None
    read_timeout: float | None


def answer_prompts(flags: AskFlags) -> None:
    check(flags)
    from engine.saved.chat import SavedChat
    from tui.cli.stops import Stops

    stops = Stops()
    printer = Printer(flags.as_json, stops.write)
    session = open_session(flags, sampling_from(**flags.sampling), printer, stops)
    chat = SavedChat(session, None)
    resume(chat, flags, printer.emit)
    with stops:  # held to the end: a signal while the cache is saved is answered, not fatal
        failed = answer_all(chat, flags.prompts, stops, printer)
        save(chat, printer.emit)
        if stops.code is not None:
            stops.write(sys.stderr, f"llmchat: {stops.reason}\n")
            raise typer.Exit(stops.code)
    if failed:
        raise typer.Exit(failed)


def check(flags: AskFlags) -> None:
    """Everything that can be known wrong before a model loads or anything is saved."""
    if flags.conversation is not None and flags.system is not None:
        fail("--system cannot change a saved conversation; it keeps the system prompt it was started with")
    check_engine_flags(vars(flags))
    problem = text_problem(flags.system, flags.prompts)
    if problem:
        refuse(problem, flags.as_json)


@dataclass
class Printer:
    """Where each event goes: the answer to stdout (or every event as JSON Lines), the rest to stderr."""

    as_json: bool
    write: Callable[[Any, str], None]
    """Writes to a stream; a closed output stops the answer instead of failing it."""
    session: Any = None
    on_terminal: bool = field(default_factory=lambda: sys.stdout.isatty())
    thought_on_terminal: bool = field(default_factory=lambda: sys.stderr.isatty())
    thinking: bool = False
    """A thought is being written to stderr: its line is ended before anything else goes there."""

    def out(self, text: str) -> None:
        """Byte-exact into a file or a pipe; on a terminal the model's control characters are shown."""
        self.write(sys.stdout, visible_controls(text) if self.on_terminal else text)

    def say(self, line: str) -> None:
        self.end_thought()
        self.write(sys.stderr, line + "\n")

    def token(self, text: str, thinking: bool) -> None:
        """The answer to stdout; thought to stderr (faint on a terminal), so stdout holds the answer alone."""
        if not thinking:
            self.end_thought()
            self.out(text)
            return
        self.thinking = True
        shown = DIM + visible_controls(text) + UNDIM if self.thought_on_terminal else text
        self.write(sys.stderr, shown)

    def end_thought(self) -> None:
        if self.thinking:
            self.thinking = False
            self.write(sys.stderr, "\n")

    def emit(self, event) -> None:
        from engine.events import ModelReady, Notice, SamplingResolved, TokenSampled, TurnFinished, to_json

        if self.as_json:
            self.out(json.dumps(to_json(event), ensure_ascii=False) + "\n")
        elif isinstance(event, TokenSampled) and event.text:
            self.token(event.text, event.thinking)
        elif isinstance(event, TurnFinished):
            self.finished(event)
        elif isinstance(event, Notice):
            self.say(f"llmchat: {event.message}")
        elif isinstance(event, ModelReady) and event.info.server is not None:
            self.say(f"llmchat: {remote.server_line(event.info)}")
        elif isinstance(event, SamplingResolved) and event.from_model:
            self.say(f"llmchat: sampling {model_sampling_note(event)}")

    def finished(self, event) -> None:
        """A turn's end: its stats line, its speculation, and why it was cut, if it was."""
        self.out("\n")
        self.say(stats_line(event.stats))
        if self.session is not None and self.session.speculation is not None:
            self.say(speculation_line(self.session.speculation))
        if event.error:
            self.say(f"llmchat: {visible_controls(event.error, one_line=True)}")


def open_session(flags: AskFlags, sampling, printer: Printer, stops):
    """The session `ask` answers with, announced (ModelReady); exits with why where there is none."""
    from engine.events import ModelReady

    refused = lambda message: refuse(message, flags.as_json)  # noqa: E731
    if flags.server is not None:
        where = remote.target(flags.server, flags.model, flags.api_key_env, flags.read_timeout, refused)
        session = remote.connect_or_fail(where, sampling, flags.system, flags.context, refused)
        stops.on_stop = session.cancel.set  # a silent server would hold the stop until it spoke
    else:
        session = local_session(flags, sampling, printer.emit)
    printer.session = session
    printer.emit(ModelReady(session.info))
    if flags.server is None and flags.as_json:
        from engine.fast.step_path import decode_step

        printer.emit(decode_step(session, off=ASK_DECODES))
    if flags.speculative is not None:
        if flags.server is not None:
            refused("--speculative needs the local engine: a server decides how it decodes")
        k = 4 if flags.draft_tokens is None else flags.draft_tokens
        session.speculation = speculation_for(flags.speculative, k, session.loaded, flags.as_json)
    return session


def local_session(flags: AskFlags, sampling, emit):
    """Load the model here (loading progress as events with --json); exits with the reason if it
    cannot. Without --speculative nothing but the fast path runs, so transformers may be skipped."""
    from engine import models
    from engine.chat_templates import template_text
    from engine.events import ModelLoading, Notice
    from engine.model_sampling import chosen_fields, resolved
    from engine.quant.precision import PrecisionError
    from engine.session import ChatSession

    try:
        loaded = models.load(
            flags.model or DEFAULT_MODEL,
            flags.precision or "fp32",
            flags.device or "auto",
            progress=lambda s, f: emit(ModelLoading(s, f)) if flags.as_json else None,
            fast_only=flags.speculative is None,  # a draft model and the verify pass may need the HF forward
            chat=not flags.raw,
            chat_template=None if flags.chat_template is None else template_text(flags.chat_template),
        )
    except (models.ModelError, PrecisionError) as e:
        refuse(str(e), flags.as_json)
    check_cache_precision(flags, loaded)
    system, default_system = system_or_default(
        flags.system, flags.model or DEFAULT_MODEL, local_chat=not flags.raw and flags.chat_template is None
    )
    try:
        session = ChatSession(
            loaded,
            sampling,
            system,
            flags.context,
            kv_cache=flags.kv_cache,
            raw=flags.raw,
            thinking=thinking_wanted(flags.thinking),
        )
    except models.ModelError as e:  # its fast path did not fit, or --thinking found no switch
        refuse(str(e), flags.as_json)
    chosen = [*flags.sampling, *chosen_fields(sampling)]
    session.sampling, sampling_event = resolved(flags.model or DEFAULT_MODEL, sampling, chosen)
    emit(sampling_event)
    if default_system and flags.conversation is None:  # a saved conversation keeps its own
        emit(Notice(f"system prompt {system_default_note(system)}; --system changes it"))
    if session.device.type == "cpu" and os.environ.get("LLMCHAT_COMPILE", "1") != "0":
        from engine.fast import kernels

        for name in kernels.KERNELS:  # built by an earlier run of the app: loaded in a millisecond
            kernels.load_built(name)
    return session


def check_cache_precision(flags: AskFlags, loaded) -> None:
    """--kv-cache is one this device can hold (known once the model says where it runs)."""
    if flags.kv_cache is None:
        return
    from engine.kvcache import cache_precision_problem

    problem = cache_precision_problem(flags.kv_cache, loaded.info.device)
    if problem:
        refuse(f"--kv-cache {flags.kv_cache}: {problem}", flags.as_json)


def speculation_for(choice: str, k: int, loaded, as_json: bool):
    """The Speculation for --speculative; a draft that cannot be used refuses."""
    from engine.models import ModelError
    from engine.quant.precision import PrecisionError
    from engine.speculative.loop import make_speculation

    try:
        return make_speculation(choice, k, loaded)
    except (ValueError, ModelError, PrecisionError) as e:
        refuse(f"--speculative {choice}: {e}", as_json)


def resume(chat, flags: AskFlags, emit) -> None:
    """Give `chat` its store and, with --conversation, the saved conversation to continue."""
    from engine.events import Failed

    store, read_only = open_store(flags, emit)
    chat.store = store
    if flags.conversation is None:
        return
    for event in chat.resume(flags.conversation):
        emit(event)
        if isinstance(event, Failed):
            fail(event.message)
    if flags.no_save or read_only:
        chat.store = None


def open_store(flags: AskFlags, emit):
    """The store to save in (None with --no-save, or where it cannot open), and whether it is
    damaged: then it is only read, to resume from, never written."""
    from engine.events import Notice
    from engine.saved.store import Store, StoreError

    if flags.conversation is None and flags.no_save:
        return None, False
    try:
        store = Store()
    except StoreError as e:
        if flags.conversation is not None:
            fail(str(e))
        emit(Notice(f"not saving this conversation: {e}"))
        return None, False
    if store.damaged is None:
        return store, False
    emit(Notice(f"not saving this conversation: {store.damaged}"))
    if flags.conversation is None:
        store.close()
        return None, True
    return store, True


def answer_all(chat, prompts: list[str], stops, printer: Printer) -> int:
    """Answer each prompt as a turn; the exit status the failures ask for (0 where none)."""
    failed = 0
    try:
        for prompt in prompts:
            if stops.code is not None:
                break
            failed = max(failed, answer(chat, prompt, stops, printer))
            if chat.refused or failed == USAGE:  # follow-ups make no sense
                break
    except KeyboardInterrupt:
        printer.write(sys.stderr, "\nllmchat: interrupted\n")
        raise typer.Exit(130)
    return failed


def answer(chat, prompt: str, stops, printer: Printer) -> int:
    """One turn; FAILED where it was cut or refused (its part so far is saved), USAGE where no
    retry can help (a server refused the key)."""
    from engine.events import Failed, TurnFinished

    failed = 0
    for event in chat.send(prompt):
        printer.emit(event)
        if isinstance(event, Failed):
            failed = max(failed, USAGE if event.lasting else FAILED)
            if not printer.as_json:
                printer.say(f"llmchat: {event.message}")
        elif isinstance(event, TurnFinished) and event.error:
            failed = max(failed, FAILED)
        if stops.code is not None:
            chat.session.cancel.set()  # the answer stops after this token; its part so far is saved
    return failed


def save(chat, emit) -> None:
    """Save the KV cache beside the conversation and say how to continue it."""
    from engine.events import Notice

    if chat.store is None or chat.conversation_id is None or chat.refused:
        return
    saved = chat.save_cache()
    if saved is not None:
        emit(saved)
    ref = chat.conversation_id
    emit(Notice(f"saved as conversation {ref}; continue it with --conversation {ref}"))


def counted(value: int | None, what: str) -> str:
    """'12 reused', or 'reused: not reported' where a server did not say."""
    return f"{value} {what}" if value is not None else f"{what}: not reported"


def speculation_line(speculation) -> str:
    """The turn's speculative rounds, on one line."""
    s = speculation.stats
    return (
        f"[speculative {speculation.drafter.name}, K={speculation.k} | {s.accepted}/{s.drafted} drafts kept "
        f"({s.acceptance:.0%}) | {s.tokens_per_forward:.2f} tokens per forward | {s.rounds} rounds]"
    )


def stats_line(stats) -> str:
    """The client's figures for a turn, then a server's own where it reports them."""
    return (
        f"[{counted(stats.prompt_tokens, 'prompt tokens')}, {counted(stats.reused_tokens, 'reused')}, "
        f"{counted(stats.prefilled_tokens, 'prefilled')} | "
        f"TTFT {stats.ttft_s * 1000:.0f} ms | "
        f"ITL p50 {gap_ms(stats.itl_p50_s)} p90 {gap_ms(stats.itl_p90_s)} | "
        f"prefill {prefill_rate(stats)} | decode {decode_rate(stats.decode_tok_s)} | "
        f"{count(stats.generated_tokens, 'token')}{thought_part(stats)} | stop: {stats.stop}"
        f"{remote.server_figures(stats.server)}{contention_part(stats.contention)}]"
    )


def thought_part(stats) -> str:
    """' | thought 212 tok, first thought 118 ms, first answer 3412 ms' for an answer that thought."""
    part = thinking_part(stats)
    return f" | {part}" if part else ""


def contention_part(contention) -> str:
    """' | CPU share 97%, load 0.9 on 2 cores', or the busy-machine warning; '' where not measured."""
    return "" if contention is None else f" | {contention.describe()}"
