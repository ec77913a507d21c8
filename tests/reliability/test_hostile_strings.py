"""Hostile strings from outside (issue 31, "Injection"): a server's words, a file's, argv's.

Each place the app, a table or a line shows such a string is fed one that holds terminal
escape sequences (OSC 52 sets the clipboard, OSC 0 retitles the window, ESC c clears the
screen, C1 CSI \\x9b) and Rich/Textual markup (`[/]` ends a style that was never opened and
raised MarkupError; `[link=...]` made a hyperlink). Each is shown as text: the controls as
visible pictures (␛, ␇, \\u009b), the brackets as they are, and nothing crashes.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from rich.console import Console
from textual.widgets._toast import Toast

from engine.events import Failed, ModelReady, ServerInfo, ServerTimings, TurnFinished
from tests.reliability.hostile_server import chunk, json_reply, stream_reply
from tests.test_tui_model import Recorder
from tests.tui_fakes import INFO, FakeEngine, FakeFactory, fake_app
from tests.tui_screen import screen_text, wait_for, widget_text
from tui.widgets.chat_log import Answer, ChatLog
from tui.widgets.status_bar import StatusBar

PARTS = (
    "\x1b]52;c;cHduZWQ=\x07",
    "\x1b]0;pwned\x07",
    "\x1bc",
    "\x9b2J",
    "[/]",
    "[link=http://x]y[/link]",
    "[bold]b",
)
"""Set the clipboard, retitle the window, clear the screen (twice), then three kinds of markup."""
SHOWN = ("␛]52;c;cHduZWQ=␇", "␛]0;pwned␇", "␛c", "\\u009b2J", "[/]", "[link=http://x]y[/link]", "[bold]b")
HOSTILE = " ".join(PARTS)
"""Spaces between the parts, so a toast may wrap between them and each is still found whole."""
RAW = ("\x1b", "\x07", "\x9b")
WIDE = (400, 50)
"""Wide enough for the header to show every field of a long hostile line."""


def assert_visible(text: str, *shown: str) -> None:
    assert not any(ch in text for ch in RAW), repr(text)
    for part in shown:
        assert part in text, (part, text)


def run(scenario) -> None:
    asyncio.run(scenario())


# -- the app, on a fake engine that says it is a server ---------------------------------------------
SERVER = ServerInfo(url="http://127.0.0.1:1/v1", kind="llama.cpp", version="b1", model="fake")


class ServerEngine(FakeEngine):
    """The fake engine as a server's session: `connect` reports `info`, and each answer ends with the
    server's `fingerprint` and `error` (a server's error body) in its TurnFinished."""

    def __init__(self, emit, sampling, *, info, fingerprint=None, error="", **options):
        def server_emit(event) -> None:
            if isinstance(event, TurnFinished):
                stats = replace(event.stats, server=ServerTimings(fingerprint=fingerprint))
                event = replace(event, stats=stats, error=error)
            emit(event)

        super().__init__(server_emit, sampling, **options)
        self.server_info = info

    def connect(self, target) -> None:
        super().connect(target)
        self.emit(ModelReady(self.server_info))


class ServerFactory(FakeFactory):
    def __call__(self, emit, sampling, system, context) -> FakeEngine:
        self.engine = ServerEngine(emit, sampling, **self.options)
        return self.engine


def server_app(tmp_path, server: ServerInfo = SERVER, name: str = "fake", **options):
    info = replace(INFO, spec=name, name=name, server=server)
    return fake_app(ServerFactory(info=info, **options), tmp_path, server=server.url)


async def one_answer(pilot) -> None:
    app = pilot.app
    await wait_for(pilot, lambda: app.turns.ready, what="the server's model")
    await pilot.press(*"hi", "enter")
    await wait_for(pilot, lambda: len(app.query(Answer)) == 1 and not app.turns.busy, what="the answer")
    await pilot.pause(0.1)


def toasts(app) -> str:
    return "\n".join(widget_text(toast) for toast in app.screen.query(Toast))


def test_the_header_shows_a_hostile_fingerprint_visibly(tmp_path):
    async def scenario():
        app = server_app(tmp_path, fingerprint=HOSTILE)
        async with app.run_test(size=WIDE, notifications=True) as pilot:
            await one_answer(pilot)
            header = widget_text(app.query_one(StatusBar))
            assert "fingerprint" in header
            assert_visible(header, *SHOWN)
            assert_visible(screen_text(app))

    run(scenario)


def test_the_header_and_the_chat_show_hostile_server_fields_visibly(tmp_path):
    server = replace(
        SERVER, version="b1 " + PARTS[1], parallelism="2 slots " + PARTS[4], quantization=PARTS[2]
    )
    name = "m " + PARTS[0] + " " + PARTS[5]

    async def scenario():
        app = server_app(tmp_path, server, name=name)
        async with app.run_test(size=WIDE, notifications=True) as pilot:
            await wait_for(pilot, lambda: app.turns.ready, what="the server's model")
            await pilot.pause(0.1)
            assert_visible(widget_text(app.query_one(StatusBar)), *SHOWN[:3], SHOWN[4], SHOWN[5])
            assert_visible(widget_text(app.query_one(ChatLog)), SHOWN[0], SHOWN[1], SHOWN[5])

    run(scenario)


def test_settings_show_a_hostile_weight_format_visibly(tmp_path):
    from tui.screens.settings import SettingsScreen

    async def scenario():
        app = server_app(tmp_path, replace(SERVER, quantization=HOSTILE))
        async with app.run_test(size=WIDE, notifications=True) as pilot:
            await wait_for(pilot, lambda: app.turns.ready, what="the server's model")
            await pilot.press("ctrl+s")
            await wait_for(pilot, lambda: isinstance(app.screen, SettingsScreen), what="the settings")
            await pilot.pause(0.1)
            note = widget_text(app.screen.query_one("#precision-note"))
            assert "the server decides it (weights: " in note
            assert_visible(note, *SHOWN)

    run(scenario)


def test_settings_show_a_hostile_drafter_from_the_command_line_visibly(tmp_path):
    """`--speculative PATH`: a draft model's path, shown as the drafter chosen."""
    from tui.screens.settings import SettingsScreen

    async def scenario():
        app = fake_app(FakeFactory(), tmp_path, speculative="/tmp/d " + HOSTILE)
        async with app.run_test(size=WIDE, notifications=True) as pilot:
            await wait_for(pilot, lambda: app.turns.ready, what="the model")
            await pilot.press("ctrl+s")
            await wait_for(pilot, lambda: isinstance(app.screen, SettingsScreen), what="the settings")
            await pilot.pause(0.1)
            assert_visible(widget_text(app.screen.query_one("#speculative")), "draft model: /tmp/d", SHOWN[0])

    run(scenario)


def test_a_server_error_with_markup_is_a_toast_and_a_note_of_plain_text(tmp_path):
    async def scenario():
        app = server_app(tmp_path, error="HTTP 500: " + HOSTILE)
        async with app.run_test(size=WIDE, notifications=True) as pilot:
            await one_answer(pilot)
            assert_visible(toasts(app), "HTTP 500:", *SHOWN)
            assert_visible(widget_text(app.query_one(Answer)), *SHOWN)
            assert_visible(screen_text(app))
            assert app.is_running and app.return_code is None

    run(scenario)


def test_a_failed_load_with_markup_in_its_message_leaves_the_app_open(tmp_path):
    message = "no model at '/tmp/x[/]y' " + HOSTILE

    async def scenario():
        app = fake_app(FakeFactory(fail_load=message), tmp_path)
        async with app.run_test(size=WIDE, notifications=True) as pilot:
            await wait_for(pilot, lambda: app.query(Toast), what="the toast")
            await pilot.pause(0.1)
            assert_visible(toasts(app), "no model at '/tmp/x[/]y'", *SHOWN)
            assert_visible(widget_text(app.query_one(StatusBar)), "✖ no model at '/tmp/x[/]y'", *SHOWN)
            assert app.is_running and app.return_code is None

    run(scenario)


def test_a_model_path_with_markup_is_one_error_line_in_the_app(tmp_path):
    """`llmchat --model '/tmp/x[/]y'` on the real engine: the load fails with its one line; the app stays."""
    recorder = Recorder()

    async def scenario():
        app = fake_app(recorder.factory, tmp_path, model="/tmp/x[/]y", device="cpu")
        async with app.run_test(size=WIDE, notifications=True) as pilot:
            await wait_for(pilot, lambda: recorder.of(Failed), timeout=120, what="the load to fail")
            await wait_for(pilot, lambda: app.query(Toast), what="the toast")
            await pilot.pause(0.1)
            (failed,) = recorder.of(Failed)
            assert failed.message.startswith("no model at '/tmp/x[/]y'") and "\n" not in failed.message
            assert "no model at '/tmp/x[/]y'" in toasts(app)
            assert "Traceback" not in screen_text(app)
            assert app.is_running and app.return_code is None

    run(scenario)


# -- the real worker against a hostile server --------------------------------------------------------
def llama_like(**props) -> dict:
    """Routes of a llama.cpp-like server whose /props says `props`."""
    return {
        ("GET", "/v1/models"): json_reply(
            {"object": "list", "data": [{"id": "fake", "owned_by": "llamacpp"}]}
        ),
        ("GET", "/props"): json_reply({"build_info": "b1", "total_slots": 1, **props}),
    }


def test_a_hostile_server_drives_nothing_through_the_header_settings_or_toasts(hostile, tmp_path):
    """The whole way: the stream's system_fingerprint, /props model_ftype, an error body."""
    from tui.screens.settings import SettingsScreen

    routes = llama_like(model_ftype=HOSTILE)
    routes[("POST", "/v1/chat/completions")] = stream_reply(
        chunk("Hel", system_fingerprint=HOSTILE), chunk("lo", system_fingerprint=HOSTILE), chunk("", "stop")
    )
    server = hostile(routes)
    recorder = Recorder()

    async def scenario():
        app = fake_app(recorder.factory, tmp_path, server=server.url, sampling={"max_new_tokens": 8})
        async with app.run_test(size=WIDE, notifications=True) as pilot:
            await wait_for(pilot, lambda: app.turns.ready, timeout=120, what="the server")
            await one_answer(pilot)
            assert_visible(widget_text(app.query_one(StatusBar)), "fingerprint", *SHOWN)
            await pilot.press("ctrl+s")
            await wait_for(pilot, lambda: isinstance(app.screen, SettingsScreen), what="the settings")
            await pilot.pause(0.1)
            assert_visible(widget_text(app.screen.query_one("#precision-note")), *SHOWN)
            await pilot.press("escape")
            await wait_for(pilot, lambda: not isinstance(app.screen, SettingsScreen), what="the chat")
            server.server.routes[("POST", "/v1/chat/completions")] = json_reply(
                {"error": {"message": HOSTILE}}, status=500
            )
            await pilot.press(*"again", "enter")
            await wait_for(
                pilot, lambda: len(app.query(Answer)) == 2 and not app.turns.busy, what="the error"
            )
            await wait_for(pilot, lambda: app.query(Toast), what="the toast")
            await pilot.pause(0.1)
            assert_visible(toasts(app), *SHOWN)
            assert_visible(screen_text(app))
            assert app.is_running and app.return_code is None

    run(scenario)


def test_the_inspector_shows_the_bytes_a_server_sent_without_ids(hostile, tmp_path):
    """A server that sends each token's bytes but no ids (OpenAI, vLLM without return_token_ids)."""
    from tui.screens.inspector import InspectorScreen

    def token(text: str) -> dict:
        entry = {"token": text, "bytes": list(text.encode()), "logprob": -0.1, "top_logprobs": []}
        return chunk(text, choice={"logprobs": {"content": [entry]}})

    server = hostile(
        {("POST", "/v1/chat/completions"): stream_reply(token("Hé"), token("llo"), chunk("", "stop"))}
    )
    recorder = Recorder()

    async def scenario():
        app = fake_app(recorder.factory, tmp_path, server=server.url, sampling={"max_new_tokens": 8})
        async with app.run_test(size=WIDE, notifications=True) as pilot:
            await wait_for(pilot, lambda: app.turns.ready, timeout=120, what="the server")
            await one_answer(pilot)
            await pilot.press("f2")
            await wait_for(pilot, lambda: isinstance(app.screen, InspectorScreen), what="the inspector")
            await pilot.press("home")
            await pilot.pause(0.1)
            record = widget_text(app.screen.query_one("#record"))
            assert "48 c3 a9  (3 bytes)" in record, record
            assert "special token" not in record

    run(scenario)


def test_the_tokenizer_views_template_shows_hostile_text_visibly():
    """F5's rendered template: a server's (/apply-template) or the conversation's words, as they are."""
    from engine.instruments.tokview import TokenizerView
    from tui.screens.tokenizer import template_content

    template = "<|im_start|>user\n" + HOSTILE + "<|im_end|>\n"
    view = TokenizerView((), reused=0, prompt_tokens=0, spans=(), template=template, template_cached="")
    shown = template_content(view, ["<|im_start|>", "<|im_end|>"])
    assert_visible(shown.plain, "<|im_start|>user\n", *SHOWN)


# -- the command line's one-line errors --------------------------------------------------------------
@pytest.mark.parametrize("command", [["ask"], ["bench"], ["lab", "batching"]])
def test_a_hostile_model_path_is_one_visible_error_line(tmp_path, command):
    """A directory whose name holds escapes and markup (a path from argv): said, never obeyed."""
    from typer.testing import CliRunner

    from tui.cli import app

    model = tmp_path / "x \x1b]0;pwned\x07 \x1bc [bold]b"
    model.mkdir()
    args = [*command, "-m", str(model), *(["hi"] if command == ["ask"] else [])]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert_visible(result.stderr, "x ␛]0;pwned␇ ␛c [bold]b is a directory without config.json")
    assert result.stderr.splitlines()[-1].startswith("llmchat: ")


# -- the crash screen -------------------------------------------------------------------------------
def test_a_crash_shows_no_local_variables(tmp_path, capsys):
    """Were the app to crash, Textual's report printed the frames' locals (a key, a conversation)."""

    async def scenario():
        app = fake_app(FakeFactory(), tmp_path)
        with pytest.raises(ZeroDivisionError):
            async with app.run_test(size=WIDE, notifications=True) as pilot:
                await wait_for(pilot, lambda: app.turns.ready)

                def crash() -> None:
                    secret = "-".join(["sk", "SECRET", "local"])  # noqa: F841 (the source line shows, not its value)
                    1 / 0

                app.call_later(crash)
                await pilot.pause(0.2)

    run(scenario)
    report = capsys.readouterr().err
    assert "ZeroDivisionError" in report and "in crash" in report
    assert "sk-SECRET-local" not in report


# -- the tables of `bench` and `lab` ----------------------------------------------------------------
def remote_bench_result() -> dict:
    server = {"url": "http://h/v1", "kind": "llama.cpp", "version": HOSTILE, "parallelism": HOSTILE}
    return {
        "server": server,
        "model": HOSTILE,
        "context": 4096,
        "forces_length": True,
        "prefill": [],
        "decode": {"tokens": 8, "tok_s": 1.0, "itl_ms_p50": 1.0, "itl_ms_p90": 1.0, "server_itl_ms": None},
        "turns": {
            "turn": 2,
            "prompt_tokens": 9,
            "reused_tokens": None,
            "ttft_ms_reused": None,
            "ttft_ms_fresh": None,
            "speedup": None,
        },
        "concurrency": [],
    }


def test_bench_server_prints_a_hostile_model_name_and_build_as_text(capsys):
    from tui.cli.remote_bench_table import print_remote_tables

    print_remote_tables(remote_bench_result())
    out = capsys.readouterr().out
    assert_visible(out, "llama.cpp", *SHOWN)
    assert out.count("[link=http://x]y[/link]") == 3  # the build, the model and the parallelism


def test_bench_and_lab_print_a_hostile_model_name_as_text(capsys):
    from tui.cli.bench_table import print_tables
    from tui.cli.lab_table import pool_line

    print_tables({"model": HOSTILE, "device": "cpu", "random_weights": False, "bandwidth_gb_s": 1.0,
                  "torch_threads": 2, "results": []})  # fmt: skip
    assert_visible(capsys.readouterr().out.splitlines()[0], *SHOWN)
    pool = {"blocks": 1, "block_size": 16, "tensor_bytes": 1, "formula": "f", "formula_bytes": 1}
    console = Console(record=True, width=400)
    console.print(pool_line({"model": HOSTILE, "precision": "fp32", "pool": pool}))
    assert_visible(console.export_text(), *SHOWN)
