"""`llmchat top`: a server's load, polled. Against a real two-slot llama.cpp server (two long
answers at once), through the engine, the Textual view (Pilot) and the command line; vLLM's and
SGLang's series, which llama.cpp does not send, from pages written with their real names."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from contextlib import contextmanager
from dataclasses import replace

import httpx2
import pytest
from typer.testing import CliRunner

from engine.remote import dialects
from engine.remote.client import RemoteClient
from engine.remote.metrics import series
from engine.remote.server_stats import Reading, Watch, assemble, rates, wanted, watch
from engine.remote.target import RemoteTarget
from tests.remote.llama_server import LlamaServer
from tests.tui_screen import screen_text, wait_for, widget_text
from tui.top.figures import FIGURES, NOT_REPORTED, text

ANSWER_TOKENS = 150
QUESTION = "Tell me a long story about a lighthouse keeper."


@pytest.fixture(scope="module")
def two_slots(tmp_path_factory):
    """A real llama-server with two slots, for this module, stopped after it."""
    pytest.importorskip("xllamacpp", reason="the remote tests need a real llama.cpp server (xllamacpp)")
    server = LlamaServer(tmp_path_factory.mktemp("top") / "server.log", parallel=2)
    yield server
    server.stop()


def answer(root: str, failures: list[BaseException]) -> None:
    """One streamed answer of exactly ANSWER_TOKENS tokens."""
    body = {
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": ANSWER_TOKENS,
        "ignore_eos": True,
        "stream": True,
    }
    try:
        with httpx2.stream("POST", root + "/v1/chat/completions", json=body, timeout=300) as reply:
            reply.raise_for_status()
            for _ in reply.iter_lines():
                pass
    except BaseException as e:  # reported by the test, not lost in the thread
        failures.append(e)


@contextmanager
def two_answers(server: LlamaServer):
    """Two long answers generated side by side while the block runs; joined at its end."""
    failures: list[BaseException] = []
    threads = [threading.Thread(target=answer, args=(server.root, failures)) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        yield threads
    finally:
        for thread in threads:
            thread.join(timeout=300)
    assert failures == []


def running(reading: Reading) -> bool:
    return reading.snapshot.running == 2


# -- against the real server ------------------------------------------------------------------


def poll_while(server_watch: Watch, threads: list[threading.Thread], pause_s: float) -> list[Reading]:
    """Readings every `pause_s` until the threads end, and two more after."""
    readings = [server_watch.poll()]
    while any(thread.is_alive() for thread in threads):
        time.sleep(pause_s)
        readings.append(server_watch.poll())
    for _ in range(2):
        time.sleep(pause_s)
        readings.append(server_watch.poll())
    return readings


@pytest.mark.server
def test_two_answers_fill_both_slots_and_the_rates_add_up(two_slots):
    server_watch = watch(RemoteTarget(two_slots.url))
    assert server_watch.server.dialect.kind == "llama.cpp"
    try:
        with two_answers(two_slots) as threads:
            readings = poll_while(server_watch, threads, pause_s=0.3)
    finally:
        server_watch.close()
    both = [r for r in readings if running(r)]
    assert both, [r.snapshot.running for r in readings]
    busy = both[len(both) // 2].snapshot
    assert [slot.processing for slot in busy.slots] == [True, True]
    assert busy.kv_fill > 0 and busy.kv_source.startswith("/slots: ")
    assert busy.waiting == 0
    assert all(slot.held > 0 and slot.n_ctx == 1024 for slot in busy.slots)
    # While both generate (llama.cpp's counter has not moved yet: /slots' counts are added).
    generating = [r.rates.generation_tps for r in both if r.rates is not None]
    assert generating and max(generating) > 0
    # Every token counted once: the count never goes back, and grows by both answers whole.
    counted = [r.snapshot.generated_so_far for r in readings]
    assert counted == sorted(counted)
    assert counted[-1] - counted[0] == 2 * ANSWER_TOKENS
    assert sum(r.rates.generation_tps * r.rates.seconds for r in readings[1:]) == pytest.approx(300)
    idle = readings[-1]
    assert idle.snapshot.running == 0 and idle.rates.generation_tps == 0.0
    assert [slot.processing for slot in idle.snapshot.slots] == [False, False]
    assert all(r.snapshot.error is None and r.snapshot.notes == () for r in readings)


@pytest.mark.server
def test_a_server_that_stops_answering_is_one_line_and_polling_goes_on(two_slots):
    detected = watch(RemoteTarget(two_slots.url))
    detected.close()
    gone = RemoteClient(RemoteTarget("http://127.0.0.1:9/v1", read_timeout_s=2, connect_timeout_s=2))
    server_watch = Watch(gone, detected.server)
    first, second = server_watch.poll(), server_watch.poll()
    server_watch.close()
    assert first.snapshot.error == (
        "server not answering: cannot reach http://127.0.0.1:9/v1: [Errno 111] Connection refused"
    )
    assert second.snapshot.error and second.rates == rates(first.snapshot, second.snapshot)
    assert second.rates.generation_tps is None
    assert {text(figure, second) for figure in FIGURES} == {"—"}  # no figures, no made-up 0


def run(scenario) -> None:
    asyncio.run(scenario())


def value_of(app, key: str) -> str:
    return widget_text(app.query_one(f"#{key} .value"))


@pytest.mark.server
def test_the_view_shows_the_slots_filling_and_q_quits(two_slots):
    from tui.top.app import TopApp

    app = TopApp(watch(RemoteTarget(two_slots.url)), interval_s=0.25)
    seen: dict[str, str] = {}

    async def scenario():
        async with app.run_test(size=(80, 24)) as pilot:  # a small terminal: nothing wraps
            await wait_for(pilot, lambda: app.readings >= 1, timeout=30, what="a first reading")
            assert "llama.cpp" in screen_text(app) and "2 parallel slots" in screen_text(app)
            assert value_of(app, "spec_accept_length") == NOT_REPORTED
            with two_answers(two_slots) as threads:
                await wait_for(
                    pilot,
                    lambda: widget_text(app.query_one("#slots")).count("processing") == 2,
                    timeout=60,
                    what="both slots processing",
                )
                seen["slots"] = widget_text(app.query_one("#slots"))
                seen["running"] = value_of(app, "running")
                await wait_for(
                    pilot,
                    lambda: (
                        value_of(app, "generation_tps").endswith("tok/s")
                        and float(value_of(app, "generation_tps").split()[0]) > 0
                    ),
                    timeout=60,
                    what="a generation rate",
                )
                seen["generation"] = value_of(app, "generation_tps")
                seen["screen"] = screen_text(app)
                seen["kv"] = value_of(app, "kv_cache")
                while any(thread.is_alive() for thread in threads):
                    await pilot.pause(0.2)
            await wait_for(
                pilot, lambda: value_of(app, "generation_tps") == "0.0 tok/s", timeout=30, what="idle"
            )
            await wait_for(pilot, lambda: value_of(app, "running") == "0", timeout=30, what="no request")
            assert widget_text(app.query_one("#slots")).count("idle") == 2
            assert app.return_code is None
            await pilot.press("q")
            await pilot.pause(0.2)
            assert app.return_code == 0 and app.stop.is_set()

    run(scenario)
    assert seen["running"] == "2", seen["screen"]
    slot_rows = [line for line in seen["slots"].splitlines() if "processing" in line]
    assert len(slot_rows) == 2 and all("/ 1,024" in row and "█" in row for row in slot_rows)
    assert float(seen["generation"].split()[0]) > 0
    assert seen["kv"].endswith("%") and float(seen["kv"][:-1]) > 0
    top = seen["screen"].splitlines()
    assert top[0].strip().endswith("2 parallel slots") and top[1].strip().startswith("model SmolLM2")
    assert [line.split()[:2] for line in top[3:11]] == [f.label.split()[:2] for f in FIGURES]


@pytest.mark.server
def test_the_view_says_in_one_line_that_the_server_stopped_answering_and_keeps_polling(two_slots):
    from tui.top.app import TopApp

    detected = watch(RemoteTarget(two_slots.url))
    detected.close()
    gone = RemoteClient(RemoteTarget("http://127.0.0.1:9/v1", read_timeout_s=2, connect_timeout_s=2))
    app = TopApp(Watch(gone, detected.server), interval_s=0.1)

    async def scenario():
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_for(pilot, lambda: app.readings >= 3, timeout=30, what="three polls")
            status = widget_text(app.query_one("#status"))
            assert status.startswith("server not answering: cannot reach http://127.0.0.1:9/v1")
            assert len(status.splitlines()) == 1
            assert {value_of(app, figure.key) for figure in FIGURES} == {"—"}
            await pilot.press("escape")
            await pilot.pause(0.2)
            assert app.return_code == 0

    run(scenario)


# -- the command line ---------------------------------------------------------------------------


@pytest.fixture
def cli():
    from tui.cli import app

    runner = CliRunner()
    return lambda *args: runner.invoke(app, list(args))


@pytest.mark.server
def test_top_once_prints_the_figures(cli, two_slots):
    with two_answers(two_slots):
        while not two_slots.busy():
            time.sleep(0.05)
        result = cli("top", "--server", two_slots.url, "--once", "--interval", "0.5")
    assert result.exit_code == 0, result.output
    out = result.stdout.splitlines()
    assert out[0].startswith("llama.cpp ") and two_slots.url in out[0] and "2 parallel slots" in out[0]
    assert out[1] == "model SmolLM2-135M-Instruct.Q4_1.gguf"
    rows = {line[:20].strip(): line[20:].strip() for line in out[2:] if not line.startswith(("slot ", " "))}
    assert rows["requests waiting"] == "0"
    assert rows["KV cache used"].endswith("%") and rows["accepted per step"] == NOT_REPORTED
    assert rows["generated tokens"].endswith("tok/s")
    assert len([line for line in out if line.startswith("slot ")]) == 2
    assert all(len(line) <= 80 for line in out)

    quiet = cli("top", "--server", two_slots.url, "--once", "--json", "--interval", "0.2")
    assert quiet.exit_code == 0, quiet.output
    reading = json.loads(quiet.stdout)
    assert reading["server"]["kind"] == "llama.cpp" and reading["error"] is None
    assert reading["figures"]["running"] == {"value": 0, "text": "0"}
    assert reading["figures"]["generation_tps"] == {"value": 0.0, "text": "0.0 tok/s"}
    assert reading["figures"]["spec_accept_length"] == {"value": None, "text": NOT_REPORTED}
    assert [slot["n_ctx"] for slot in reading["slots"]] == [1024, 1024]
    assert 0.2 <= reading["interval_s"] < 2


def test_top_refuses_bad_flags_in_one_line(cli):
    missing = cli("top", "--once")
    assert missing.exit_code == 2
    assert (
        missing.stderr == "llmchat: top needs --server URL, the server to watch (e.g. http://host:8000/v1)\n"
    )
    for bad in ("0.01", "61", "abc", "nan"):
        result = cli("top", "--server", "http://127.0.0.1:9/v1", "--interval", bad, "--once")
        assert result.exit_code == 2
        assert (
            result.stderr == f"llmchat: --interval must be a number of seconds from 0.1 to 60, got '{bad}'\n"
        )
    unreachable = cli("top", "--server", "http://127.0.0.1:9/v1", "--once")
    assert unreachable.exit_code == 2 and len(unreachable.stderr.splitlines()) == 1
    assert "cannot reach http://127.0.0.1:9/v1" in unreachable.stderr
    json_alone = cli("top", "--server", "http://127.0.0.1:9/v1", "--json")
    assert (
        json_alone.exit_code == 2 and json_alone.stderr == "llmchat: --json prints one reading: add --once\n"
    )


# -- vLLM's and SGLang's series (llama.cpp sends neither): pages with their real names ----------

VLLM_MODEL = 'model_name="meta-llama/Llama-3.1-8B-Instruct"'


def vllm_page(
    prompt: float, generated: float, queries: float, hits: float, drafted: float, accepted: float
) -> str:
    """A vLLM v1 /metrics page from a data-parallel server (two engines), trimmed to a few series."""
    lines = [
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
        "# TYPE vllm:num_requests_waiting gauge",
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        "# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.",
        "# TYPE vllm:prefix_cache_queries_total counter",
        "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.",
        "# TYPE vllm:prefix_cache_hits_total counter",
        "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
        "# TYPE vllm:prompt_tokens_total counter",
        "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
        "# TYPE vllm:generation_tokens_total counter",
        "# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.",
        "# TYPE vllm:spec_decode_num_draft_tokens_total counter",
        "# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.",
        "# TYPE vllm:spec_decode_num_accepted_tokens_total counter",
    ]
    per_engine = {
        "vllm:num_requests_running": (3, 2),
        "vllm:num_requests_waiting": (1, 0),
        "vllm:kv_cache_usage_perc": (0.25, 0.75),
        "vllm:prefix_cache_queries_total": (queries / 2, queries / 2),
        "vllm:prefix_cache_hits_total": (hits / 2, hits / 2),
        "vllm:prompt_tokens_total": (prompt / 2, prompt / 2),
        "vllm:generation_tokens_total": (generated / 2, generated / 2),
        "vllm:spec_decode_num_draft_tokens_total": (drafted / 2, drafted / 2),
        "vllm:spec_decode_num_accepted_tokens_total": (accepted / 2, accepted / 2),
    }
    for name, values in per_engine.items():
        lines += [f'{name}{{engine="{i}",{VLLM_MODEL}}} {value}' for i, value in enumerate(values)]
    lines += [
        f'vllm:prompt_tokens_created{{engine="0",{VLLM_MODEL}}} 1.7e9',
        "# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.",
        "# TYPE vllm:time_to_first_token_seconds histogram",
        f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.001",{VLLM_MODEL}}} 0.0',
        f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf",{VLLM_MODEL}}} 4.0',
        f'vllm:time_to_first_token_seconds_count{{engine="0",{VLLM_MODEL}}} 4.0',
        f'vllm:time_to_first_token_seconds_sum{{engine="0",{VLLM_MODEL}}} 0.5',
    ]
    return "\n".join(lines) + "\n"


def parsed(page: str, dialect, at: float):
    return assemble(series(page, wanted(dialect)), None, dialect, at)


def test_a_vllm_page_feeds_every_figure():
    before = parsed(vllm_page(1000, 5000, 800, 200, 400, 300), dialects.VLLM, at=10.0)
    after = parsed(vllm_page(1600, 5900, 1400, 500, 700, 540), dialects.VLLM, at=12.0)
    assert (after.running, after.waiting) == (5, 1)  # summed over the engines
    assert after.kv_fill == 0.5 and after.kv_source == "vllm:kv_cache_usage_perc"  # their mean
    assert (after.prompt_tokens, after.generated_tokens) == (1600, 5900)
    assert after.slots is None and after.accept_length is None
    between = rates(before, after)
    assert between.seconds == 2.0 and not between.restarted
    assert (between.prompt_tps, between.generation_tps) == (300, 450)
    assert between.cache_hit_rate == 0.5  # 300 hits of 600 tokens looked up
    assert between.spec_acceptance == 0.8  # 240 accepted of 300 drafted
    shown = {figure.key: text(figure, Reading(after, between)) for figure in FIGURES}
    assert shown == {
        "running": "5",
        "waiting": "1",
        "kv_cache": "50.0%",
        "prompt_tps": "300.0 tok/s",
        "generation_tps": "450.0 tok/s",
        "prefix_cache_hits": "50.0%",
        "spec_acceptance": "80.0%",
        "spec_accept_length": NOT_REPORTED,
    }
    first = {figure.key: text(figure, Reading(before, None)) for figure in FIGURES}
    assert first["generation_tps"] == "from the next poll" and first["running"] == "5"


def test_a_counter_that_went_down_is_a_restart_with_no_rates():
    before = parsed(vllm_page(1000, 5000, 800, 200, 400, 300), dialects.VLLM, at=10.0)
    after = parsed(vllm_page(50, 40, 0, 0, 0, 0), dialects.VLLM, at=11.0)
    between = rates(before, after)
    assert between.restarted and between.generation_tps is None and between.prompt_tps is None
    assert text(FIGURES[4], Reading(after, between)) == "counters restarted"
    idle = rates(after, replace(after, at=12.0))
    assert idle.generation_tps == 0.0  # the counters did not move: a real 0
    assert idle.cache_hit_rate is None and idle.spec_acceptance is None  # nothing looked up or drafted
    assert text(FIGURES[5], Reading(after, idle)) == "no prompt looked up"


def test_sglang_sends_its_own_rates_and_what_it_lacks_is_not_reported():
    page = "\n".join(
        [
            "# TYPE sglang:num_running_reqs gauge",
            'sglang:num_running_reqs{model_name="Qwen/Qwen3-8B"} 4.0',
            "# TYPE sglang:num_queue_reqs gauge",
            'sglang:num_queue_reqs{model_name="Qwen/Qwen3-8B"} 2.0',
            "# TYPE sglang:token_usage gauge",
            'sglang:token_usage{model_name="Qwen/Qwen3-8B"} 0.31',
            "# TYPE sglang:cache_hit_rate gauge",
            'sglang:cache_hit_rate{model_name="Qwen/Qwen3-8B"} 0.42',
            "# TYPE sglang:spec_accept_length gauge",
            'sglang:spec_accept_length{model_name="Qwen/Qwen3-8B"} 2.5',
            "# TYPE sglang:generation_tokens_total counter",
            'sglang:generation_tokens_total{model_name="Qwen/Qwen3-8B"} 900.0',
        ]
    )
    before, after = parsed(page, dialects.SGLANG, 0.0), parsed(page, dialects.SGLANG, 1.0)
    reading = Reading(after, rates(before, after))
    shown = {figure.key: text(figure, reading) for figure in FIGURES}
    assert shown == {
        "running": "4",
        "waiting": "2",
        "kv_cache": "31.0%",
        "prompt_tps": NOT_REPORTED,  # this page has no prompt counter
        "generation_tps": "0.0 tok/s",
        "prefix_cache_hits": "42.0%",
        "spec_acceptance": NOT_REPORTED,
        "spec_accept_length": "2.50 tokens",
    }


def test_a_server_with_none_of_these_series_reports_nothing():
    for dialect in (dialects.OLLAMA, dialects.GENERIC):
        snapshot = assemble({}, None, dialect, 0.0)
        reading = Reading(snapshot, rates(snapshot, replace(snapshot, at=1.0)))
        assert {text(figure, reading) for figure in FIGURES} == {NOT_REPORTED}
        assert wanted(dialect) == set()
    assert series("<html>502 Bad Gateway</html>", {"vllm:num_requests_running"}) in (None, {})


def test_the_history_is_a_column_a_poll_with_gaps_where_there_was_no_value():
    from tui.top.figures import history_line

    assert history_line([None, 0, 0.5, 1.0, None, 2.0], 8) == "   ▁▃▅ █"  # scaled to the largest
    assert history_line([0.25, 0.5, 1.0], 3, top=1.0) == "▃▅█"  # a fraction: 0..1
    assert history_line([0.0, 0.0], 4) == "  ▁▁"  # 0 is a bar at the bottom, not a gap
    assert history_line([None] * 5, 3) == "   "  # not reported: nothing drawn
    assert history_line([50, 0, 10, 2, 4], 3) == "█▂▄"  # the last polls that fit, scaled to them
