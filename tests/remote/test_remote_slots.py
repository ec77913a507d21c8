"""The server-wide KV cache fill of a llama-server, summed from its /slots (its /metrics has no
cache gauge): against the real server, and the sum on recorded /slots answers."""

from __future__ import annotations

import httpx2

from engine.events import CacheChanged
from engine.remote.metrics import slots_fill
from tests.remote.test_llama_server import QUESTION, session_for, turn

IDLE_UNUSED = [{"id": 0, "n_ctx": 2048, "speculative": False, "is_processing": False}]
"""/slots of this xllamacpp build before any request: no token count yet."""
AFTER_A_REQUEST = [
    {
        "id": 0,
        "n_ctx": 2048,
        "speculative": False,
        "is_processing": False,
        "id_task": 327,
        "n_prompt_tokens": 57,
        "n_prompt_tokens_processed": 0,
        "n_prompt_tokens_cache": 0,
        "next_token": [{"has_next_token": False, "has_new_line": False, "n_remain": -1, "n_decoded": 0}],
    }
]
"""The same after a 38-token prompt and a 20-token answer (`params` left out): 38 + 20 - 1 held."""


def test_the_fill_is_the_tokens_held_over_the_slots_context():
    assert slots_fill(IDLE_UNUSED) == (0.0, "/slots: 0 tokens held / 2,048 in 1 slot")
    fill, source = slots_fill(AFTER_A_REQUEST + [{**AFTER_A_REQUEST[0], "id": 1, "n_prompt_tokens": 943}])
    assert fill == 1000 / 4096 and source == "/slots: 1,000 tokens held / 4,096 in 2 slots"
    assert slots_fill({"error": "not supported"}) == (None, "")
    assert slots_fill([{"id": 0}]) == (None, "")  # no n_ctx: nothing to divide by


def test_the_fill_after_a_turn_on_the_real_server(llama_server):
    session = session_for(llama_server)
    events, finished = turn(session, QUESTION)
    cache = [e for e in events if isinstance(e, CacheChanged)][-1]
    slots = httpx2.get(llama_server.root + "/slots", timeout=10).json()
    held = sum(slot.get("n_prompt_tokens", 0) for slot in slots)
    # The one slot holds this conversation: its prompt and answer, less the last token (never fed).
    assert held == finished.stats.prompt_tokens + finished.stats.generated_tokens - 1
    assert cache.server_fill == held / 2048
    assert cache.server_fill_source == f"/slots: {held:,} tokens held / 2,048 in 1 slot"
    session.close()


def test_the_fill_is_read_on_connecting_before_any_turn(llama_server):
    session = session_for(llama_server)
    cache = session.cache_event()  # the worker sends this right after ModelReady
    slots = httpx2.get(llama_server.root + "/slots", timeout=10).json()
    held = sum(slot.get("n_prompt_tokens", 0) for slot in slots)
    assert cache.tokens is None  # this chat holds nothing yet
    assert cache.server_fill == held / 2048 and cache.server_fill_source.startswith("/slots: ")
    session.close()


def test_the_kv_panel_says_when_the_server_fill_was_read(llama_server):
    """The fill is read on connecting and after each turn; mid-turn the panel showed "/slots: 0
    tokens held" beside this chat's growing count, as if the two disagreed."""
    from engine.events import PhaseChanged
    from tui.widgets.kv_cache import KVCachePanel

    session = session_for(llama_server)
    panel = KVCachePanel()
    panel.set_model(session.info)
    panel.set_cache(session.cache_event(), repaint=False)
    events, _ = turn(session, QUESTION)
    mid_turn = []
    for event in events:
        if isinstance(event, PhaseChanged) and event.phase == "prefill":
            panel.set_turn(event)
        elif isinstance(event, CacheChanged):
            panel.set_cache(event, repaint=False)
            mid_turn.append(" ".join(str(panel.render()).split()))
    assert "read before this turn, again at its end" in mid_turn[0]
    shown = mid_turn[-1]  # the turn's last reading, after its answer
    held = sum(slot.get("n_prompt_tokens", 0) for slot in httpx2.get(llama_server.root + "/slots").json())
    assert f"/slots: {held:,} tokens held" in shown and "read before this turn" not in shown
    session.close()
