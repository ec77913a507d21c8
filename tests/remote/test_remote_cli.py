"""`llmchat ask --server` and `bench --server` against a real llama.cpp server."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from engine.saved.store import Store

QUESTION = "What is the capital of France? Answer in one word."


@pytest.fixture
def cli(tmp_path, monkeypatch):
    from tui.cli import app

    monkeypatch.setenv("LLMCHAT_DATA_DIR", str(tmp_path / "data"))
    runner = CliRunner()

    def run(*args: str):
        return runner.invoke(app, list(args))

    run.data = tmp_path / "data"
    return run


def events(output: str) -> list[dict]:
    return [json.loads(line) for line in output.splitlines() if line.startswith("{")]


def test_ask_streams_the_answer_and_both_sides_timings(cli, llama_server):
    result = cli("ask", "--server", llama_server.url, "-t", "0", "-n", "24", QUESTION, "And of Germany?")
    assert result.exit_code == 0, result.output
    assert "Paris" in result.stdout and "Berlin" in result.stdout
    assert "llama.cpp" in result.stderr and llama_server.url in result.stderr
    stats = [line for line in result.stderr.splitlines() if line.startswith("[")]
    assert len(stats) == 2 and all("| server: prefill" in line for line in stats)
    with Store(cli.data) as store:
        conversation = store.conversation(1)
        assert conversation.model.endswith(f"@ {llama_server.url}") and conversation.precision == "server"
        assert not store.cache_path(1).exists()  # the cache is on the server: no KV file


def test_ask_json_carries_ids_and_the_servers_figures(cli, llama_server):
    result = cli("ask", "--server", llama_server.url, "-t", "0", "-n", "24", "--json", "--no-save", QUESTION)
    assert result.exit_code == 0, result.output
    seen = events(result.stdout)
    ready = next(e for e in seen if e["event"] == "ready")
    assert ready["server"]["kind"] == "llama.cpp" and ready["kv_bytes_per_token"] == 23040
    tokens = [e for e in seen if e["event"] == "token"]
    assert tokens and all(isinstance(t["id"], int) for t in tokens)
    turn = next(e for e in seen if e["event"] == "turn")
    assert turn["server"]["prompt_ms"] > 0 and "Paris" in turn["text"]


def test_a_conversation_continues_on_the_server(cli, llama_server):
    assert cli("ask", "--server", llama_server.url, "-t", "0", "-n", "16", QUESTION).exit_code == 0
    again = cli("ask", "--server", llama_server.url, "-t", "0", "-n", "16", "-c", "last", "And of Germany?")
    assert again.exit_code == 0, again.output
    assert "Berlin" in again.stdout
    with Store(cli.data) as store:
        assert [m.role for m in store.path(1)] == ["user", "assistant"] * 2


def test_bad_servers_exit_with_one_line(cli, llama_server):
    unreachable = cli("ask", "--server", "http://127.0.0.1:9/v1", "hi")
    assert unreachable.exit_code == 2
    refused = "llmchat: cannot reach http://127.0.0.1:9/v1: [Errno 111] Connection refused"
    assert unreachable.stderr.strip() == refused
    unknown = cli("ask", "--server", llama_server.url, "-m", "gpt-9", "hi")
    assert unknown.exit_code == 2 and "does not serve 'gpt-9'" in unknown.stderr
    assert "Traceback" not in unreachable.output + unknown.output
    precision = cli("ask", "--server", llama_server.url, "-p", "bf16", "hi")
    assert precision.exit_code == 2 and "the server decides" in precision.stderr


def test_bench_server_json(cli, llama_server):
    result = cli(
        "bench",
        "--server",
        llama_server.url,
        "--json",
        "--prompt-lengths",
        "16,64",
        "--decode-tokens",
        "8",
        "--repeats",
        "1",
        "--turns",
        "2",
        "--concurrency",
        "1,2",
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [row["asked_tokens"] for row in report["prefill"]] == [16, 64]
    assert all(row["server_prompt_ms"] > 0 for row in report["prefill"])
    assert report["decode"]["tokens"] == 8  # ignore_eos: exactly as long as asked
    assert report["turns"]["reused_tokens"] > 0
    assert [row["streams"] for row in report["concurrency"]] == [1, 2]
    assert report["concurrency"][1]["tokens"] == 16
