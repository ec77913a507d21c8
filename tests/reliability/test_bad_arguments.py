"""Issue 31, "Arguments": a flag no server, clock or machine can honour is one line and exit 2
(usage, README), before anything connects or loads, in every command that takes it.

They used to be tracebacks (port 99999 or `abc`, a broken IPv6 address, control characters in
--server; `lab --budget-mib inf` or `1e9`), silently wrong (--read-timeout -1, nan, inf, 1e308;
0 gave "Resource temporarily unavailable"; `--speculative ''` ignored by bench, taken for a model
directory by ask; `lab --threads 1000` ran 8x slower) or endless (`lab --max-new 100000` beyond
the model's context).
"""

from __future__ import annotations

import os

import pytest
from typer.testing import CliRunner

from tui.cli import app

GOOD = "http://127.0.0.1:9/v1"
"""A well-formed URL nobody listens on: a flag that passed its check would end 'cannot reach'."""


def run(*args: str):
    return CliRunner().invoke(app, list(args))


def assert_usage_error(result, *said: str, unsaid: str = "") -> None:
    """Exit 2 with one `llmchat:` line naming the flag, no traceback, nothing of `unsaid` shown."""
    assert result.exit_code == 2, (result.output, result.exception)
    assert isinstance(result.exception, SystemExit), result.exception
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("llmchat: "), result.stderr
    assert "cannot reach" not in lines[0] and "needs a terminal" not in lines[0], lines[0]
    for part in said:
        assert part in lines[0], (part, lines[0])
    assert not (unsaid and unsaid in result.output), result.output
    assert not any(ch in result.output for ch in "\x01\x1b\x7f"), repr(result.output)


COMMANDS = ["app", "ask", "bench"]
"""Every command that takes --server, --read-timeout and --speculative."""


def invoke(command: str, *flags: str):
    """`flags` given to the app (no subcommand), `ask hi` or `bench`."""
    args = {"app": flags, "ask": ("ask", *flags, "hi"), "bench": ("bench", *flags)}[command]
    return run(*args)


BAD_SERVERS = {
    "http://127.0.0.1:99999/v1": "port",
    "http://127.0.0.1:abc/v1": "port",
    "http://127.0.0.1:0/v1": "port",
    "http://[::1/v1": "IPv6",
    "http://127.0.0.1:8000/v1\x1b[2J": "control character",
    "http://127.0.\x01:8000/v1": "control character",
    "http://127.0.0.1:8000/v\n1": "control character",
    "http://127.0.0.1:8000/v1 x": "space",
    "http://:8000/v1": "no host",
    "ftp://127.0.0.1/v1": "http",
}


@pytest.mark.parametrize("url, why", BAD_SERVERS.items(), ids=list(map(repr, BAD_SERVERS)))
@pytest.mark.parametrize("command", COMMANDS)
def test_a_server_url_no_client_can_use_is_refused(url, why, command):
    assert_usage_error(invoke(command, "--server", url), "--server", why)


@pytest.mark.parametrize("url", [f"{GOOD}?api_key=sk-QUERY", f"{GOOD}#sk-QUERY", f"{GOOD}?"])
@pytest.mark.parametrize("command", COMMANDS)
def test_a_query_or_fragment_in_the_server_url_is_refused_unechoed(url, command):
    assert_usage_error(invoke(command, "--server", url), "--server", "--api-key-env", unsaid="QUERY")


@pytest.mark.parametrize("seconds", ["-1", "0", "nan", "inf", "-inf", "1e308"])
@pytest.mark.parametrize("command", COMMANDS)
def test_a_read_timeout_no_clock_can_keep_is_refused(seconds, command):
    result = invoke(command, "--server", GOOD, "--read-timeout", seconds)
    assert_usage_error(result, "--read-timeout", "seconds")


@pytest.mark.parametrize(
    "url",
    ["http://[::1]:9/v1", "http://127.0.0.1:9", " http://127.0.0.1:9/v1/ ", "http://u:pw@127.0.0.1:9/v1"],
)
def test_a_usable_server_url_passes_the_checks(url):
    result = run("ask", "--server", url, "hi")
    assert result.exit_code == 2 and result.stderr.startswith("llmchat: cannot reach http://"), result.stderr
    assert "pw" not in result.stderr


def test_a_read_timeout_of_a_day_is_still_accepted():
    result = run("ask", "--server", GOOD, "--read-timeout", "86400", "hi")
    assert result.exit_code == 2 and "cannot reach" in result.stderr


@pytest.mark.parametrize("choice", ["", "  "])
@pytest.mark.parametrize("command", COMMANDS)
def test_an_empty_speculative_choice_is_refused_before_loading(choice, command):
    assert_usage_error(invoke(command, "--speculative", choice), "--speculative", "lookup")


# -- lab batching ------------------------------------------------------------------------------------------
def lab(tiny_model_dir, *flags: str):
    return run("lab", "batching", "--model", str(tiny_model_dir), "--requests", "2", "--json", *flags)


@pytest.mark.parametrize("budget", ["inf", "1e9", "1e400"])
def test_a_budget_beyond_the_machines_memory_is_refused(tiny_model_dir, budget):
    assert_usage_error(lab(tiny_model_dir, "--budget-mib", budget), "--budget-mib", "memory")


def test_more_threads_than_cores_are_refused(tiny_model_dir):
    cores = os.cpu_count() or 1
    result = lab(tiny_model_dir, "--threads", str(cores + 1))
    assert_usage_error(result, "--threads", f"{cores}")


def test_answers_longer_than_the_context_are_refused(tiny_model_dir):
    result = lab(tiny_model_dir, "--max-new", "100000")  # the tiny model's context is 512
    assert_usage_error(result, "--max-new", "context", "512")
