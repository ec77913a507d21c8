"""Issue 31, "The key": the API key never shows, and the conversation goes only where --server says.

A key with a line break inside reached the terminal whole, in `Illegal header value b'Bearer
sk-…'` (stderr, the `--json` error event, bench, the app's header, chat and toast); a non-ASCII
key was a UnicodeEncodeError traceback. Chat POSTs followed 307/308 to another port or host name
(the whole conversation went there while the header named the first URL), and a 302 became a
GET whose 404 was blamed on --server. Now a key is checked when it is read and named by its
variable only, and no redirect is followed: the one-line error says where it pointed.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from typer.testing import CliRunner

from tests.reliability.hostile_server import Reply, json_reply
from tests.tui_fakes import fake_app
from tests.tui_screen import screen_text, wait_for
from tui.cli import app
from tui.engine_link import inference_worker

SECRET = "SECRET"
BAD_KEYS = [  # (what the error says is wrong, the key)
    ("a line break", f"sk-{SECRET}\nx"),
    ("a line break", f"sk-{SECRET}\rx"),
    ("a control character", f"sk-{SECRET}\x01x"),
    ("a control character", f"sk-{SECRET}\tx"),
    ("a space", f"sk-{SECRET} x"),
    ("a non-ASCII character", f"sk-{SECRET}É"),
]
BENCH = (
    "--repeats",
    "1",
    "--turns",
    "1",
    "--concurrency",
    "1",
    "--prompt-lengths",
    "8",
    "--decode-tokens",
    "2",
)


def run(*args: str):
    return CliRunner().invoke(app, list(args))


def assert_key_unshown(result, why: str) -> None:
    """Exit 2 (usage: README), one line naming the variable and what is wrong, the key nowhere."""
    assert result.exit_code == 2, (result.output, result.exception)
    assert SECRET not in result.output, result.output
    assert "$LLMCHAT_TEST_KEY" in result.stderr and why in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr


@pytest.mark.parametrize("why, key", BAD_KEYS, ids=["LF", "CR", "SOH", "tab", "space", "non-ASCII"])
@pytest.mark.parametrize(
    "command",
    [("ask", "hi"), ("ask", "--json", "hi"), ("bench", *BENCH), ("bench", "--json", *BENCH)],
    ids=["ask", "ask --json", "bench", "bench --json"],
)
def test_a_key_no_header_can_carry_is_refused_unshown(hostile, monkeypatch, why, key, command):
    server = hostile()
    monkeypatch.setenv("LLMCHAT_TEST_KEY", key)
    result = run(*command, "--server", server.url, "--api-key-env", "LLMCHAT_TEST_KEY")
    assert_key_unshown(result, why)
    assert server.requests == []  # checked when read: nothing was sent
    if command[:2] == ("ask", "--json"):
        last = json.loads(result.stdout.splitlines()[-1])
        assert last["event"] == "error" and "$LLMCHAT_TEST_KEY" in last["message"]


def test_a_key_no_header_can_carry_is_refused_unshown_in_the_app(hostile, tmp_path, monkeypatch):
    server = hostile()
    monkeypatch.setenv("LLMCHAT_TEST_KEY", f"sk-{SECRET}\nx")
    monkeypatch.setenv("LLMCHAT_DATA_DIR", str(tmp_path / "data"))

    async def scenario():
        app = fake_app(inference_worker, tmp_path, server=server.url, api_key_env="LLMCHAT_TEST_KEY")
        async with app.run_test(size=(140, 45)) as pilot:
            shown = lambda: "$LLMCHAT_TEST_KEY" in screen_text(app)  # noqa: E731
            await wait_for(pilot, shown, timeout=30, what="the key's refusal")
            await pilot.pause(0.3)
            assert SECRET not in screen_text(app) and "a line break" in screen_text(app)

    asyncio.run(scenario())
    assert server.requests == []


def test_a_good_key_is_sent_as_the_bearer(hostile, monkeypatch):
    server = hostile()
    monkeypatch.setenv("LLMCHAT_TEST_KEY", "  sk-good_key.1-2~3  ")  # the edges' whitespace is dropped
    result = run("ask", "--server", server.url, "--api-key-env", "LLMCHAT_TEST_KEY", "--no-save", "hi")
    assert result.exit_code == 0, result.output
    sent = [{k.lower(): v for k, v in headers.items()} for _, _, headers, _ in server.requests]
    assert len(sent) >= 2 and {h.get("authorization") for h in sent} == {"Bearer sk-good_key.1-2~3"}


# -- redirects -----------------------------------------------------------------------------------------
def redirect(code: int, to: str) -> Reply:
    return Reply(code, [], headers={"Location": to})


@pytest.mark.parametrize("code", [301, 302, 303, 307, 308])
@pytest.mark.parametrize("elsewhere", ["another port", "another host name", "the same origin"])
def test_a_chat_request_is_never_redirected(hostile, code, elsewhere):
    other = hostile()
    server = hostile()
    to = {
        "another port": f"{other.url}/chat/completions?token=sk-{SECRET}",
        "another host name": f"{other.url.replace('127.0.0.1', 'localhost')}/chat/completions",
        "the same origin": "/v2/chat/completions",
    }[elsewhere]
    server.route("POST", "/v1/chat/completions", redirect(code, to))
    result = run("ask", "--server", server.url, "hi")
    assert other.requests == []  # the conversation went nowhere else
    assert result.exit_code == 1, result.output  # the turn failed (README: a failed turn exits 1)
    pointed = to.split("?")[0] if "://" in to else f"{server.url.removesuffix('/v1')}{to}"
    assert f"redirected ({code}) to {pointed};" in result.stderr, result.stderr
    assert "not found" not in result.stderr
    assert SECRET not in result.output


def test_a_redirected_model_list_names_where_it_pointed(hostile):
    other = hostile()
    server = hostile({("GET", "/v1/models"): redirect(307, f"{other.url}/models")})
    result = run("ask", "--server", server.url, "hi")
    assert result.exit_code == 2 and other.requests == []
    assert result.stderr.strip() == (
        f"llmchat: {server.url}/models redirected (307) to {other.url}/models; llmchat follows no "
        "redirect: give --server the address the server names, if you trust it"
    )


def test_a_relative_redirect_of_a_side_endpoint_is_named_in_full(hostile):
    server = hostile({("GET", "/v1/models"): redirect(302, "/elsewhere/models")})
    result = run("ask", "--server", server.url, "hi")
    root = server.url.removesuffix("/v1")
    assert result.exit_code == 2 and f"redirected (302) to {root}/elsewhere/models;" in result.stderr


def test_the_server_json_error_event_names_the_redirect(hostile):
    other = hostile()
    server = hostile({("GET", "/v1/models"): redirect(308, f"{other.url}/models")})
    result = run("ask", "--json", "--server", server.url, "hi")
    last = json.loads(result.stdout.splitlines()[-1])
    assert last["event"] == "error" and "redirected (308)" in last["message"]


def test_models_listed_then_a_bench_redirect_is_one_line(hostile):
    other = hostile()
    server = hostile({("POST", "/v1/chat/completions"): redirect(307, f"{other.url}/chat/completions")})
    result = run("bench", "--server", server.url, *BENCH)
    assert result.exit_code == 2 and other.requests == []
    assert "redirected (307)" in result.stderr and "Traceback" not in result.output


def test_a_redirect_body_is_not_taken_for_json(hostile):
    server = hostile(
        {("GET", "/v1/models"): json_reply({"data": []}, status=302, headers={"Location": "/x"})}
    )
    result = run("ask", "--server", server.url, "hi")
    assert result.exit_code == 2 and "redirected (302)" in result.stderr


# -- a query in the URL ----------------------------------------------------------------------------------
def test_a_query_in_a_configured_server_url_is_refused_unshown_in_the_app(hostile, tmp_path, monkeypatch):
    """A server from the config file is checked when the app connects: the query (it may hold a
    key) is shown nowhere, not even in "connecting to …", and nothing is sent."""
    server = hostile()
    monkeypatch.setenv("LLMCHAT_DATA_DIR", str(tmp_path / "data"))
    seen: list[str] = []

    async def scenario():
        app = fake_app(inference_worker, tmp_path, server=f"{server.url}?api_key=sk-{SECRET}")
        async with app.run_test(size=(140, 45)) as pilot:
            seen.append(screen_text(app))
            refused = lambda: seen.append(screen_text(app)) or "not a server URL" in seen[-1]  # noqa: E731
            await wait_for(pilot, refused, timeout=30, what="the URL's refusal")

    asyncio.run(scenario())
    assert not any(SECRET in screen for screen in seen)
    assert server.requests == []
