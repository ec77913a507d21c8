"""A KV cache file is trusted only when it is exactly what was saved, and only for what it really holds.

Finite but wrong values (zeroed keys, swapped layers, other token ids) pass every shape and
NaN check, yet silently change the answer; a checksum over the whole file catches them. A
file that does fit the model but holds another conversation is reused only as far as it
matches, and the notice says how far.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine.events import Notice, PromptTokens, TokenSampled
from engine.kvcache import common_prefix
from engine.sampling import SamplingSettings
from engine.saved.cache_file import load_cache, save_cache
from engine.saved.chat import SavedChat
from engine.saved.store import Store
from engine.session import ChatSession

GREEDY = SamplingSettings(temperature=0.0, max_new_tokens=8)
SYSTEM = "You are a helpful assistant."


@pytest.fixture(scope="module")
def warm_session(tiny_loaded):
    session = ChatSession(tiny_loaded, GREEDY)
    list(session.send("What is the capital of France?"))
    return session


@pytest.fixture
def saved(tmp_path, warm_session, tiny_loaded):
    path = tmp_path / "conversation-1.safetensors"
    save_cache(warm_session.cache, tiny_loaded, path)
    return path


def rewrite(path, tensors=None, **metadata_changes):
    """Save the file again with tensors or metadata fields replaced (None deletes a field)."""
    with safe_open(str(path), "pt") as f:
        metadata = dict(f.metadata())
    all_tensors = load_file(str(path))
    all_tensors.update(tensors or {})
    for key, value in metadata_changes.items():
        if value is None:
            metadata.pop(key, None)
        else:
            metadata[key] = value
    save_file(all_tensors, str(path), metadata=metadata)


def ignored(path, loaded) -> str:
    cache, notice = load_cache(path, loaded)
    assert cache is None, notice
    assert notice.startswith("saved KV cache ignored (") and notice.endswith("the history will be prefilled")
    assert "\n" not in notice
    return notice


def test_zeroed_keys_are_detected(saved, tiny_loaded):
    keys = load_file(str(saved))["layers.0.keys"]
    rewrite(saved, {"layers.0.keys": torch.zeros_like(keys)})
    assert "checksum" in ignored(saved, tiny_loaded)


def test_swapped_layers_are_detected(saved, tiny_loaded):
    tensors = load_file(str(saved))
    rewrite(
        saved,
        {
            "layers.0.keys": tensors["layers.1.keys"],
            "layers.1.keys": tensors["layers.0.keys"],
            "layers.0.values": tensors["layers.1.values"],
            "layers.1.values": tensors["layers.0.values"],
        },
    )
    assert "checksum" in ignored(saved, tiny_loaded)


def test_other_token_ids_of_the_same_count_are_detected(saved, warm_session, tiny_loaded):
    other = list(reversed(warm_session.cache.ids))
    rewrite(saved, token_ids=json.dumps(other))
    assert "checksum" in ignored(saved, tiny_loaded)


def test_one_flipped_bit_in_the_tensor_data_is_detected(saved, tiny_loaded):
    data = bytearray(saved.read_bytes())
    # The last byte belongs to the last tensor's last float; its low mantissa bit keeps it finite.
    data[-4] ^= 0x01
    saved.write_bytes(bytes(data))
    assert "checksum" in ignored(saved, tiny_loaded)


def test_a_file_without_a_checksum_is_not_trusted_and_says_so(saved, tiny_loaded):
    rewrite(saved, checksum=None)
    notice = ignored(saved, tiny_loaded)
    assert "no checksum" in notice and "older llmchat" in notice


def test_the_checksum_is_stored_in_the_metadata_and_the_file_still_round_trips(saved, tiny_loaded):
    with safe_open(str(saved), "pt") as f:
        assert f.metadata()["checksum"].startswith("sha256:")
    cache, notice = load_cache(saved, tiny_loaded)
    assert cache is not None, notice


# -- through a saved chat --------------------------------------------------------------------
def answer(events) -> dict:
    seen = {"tokens": [], "notices": []}
    for event in events:
        if isinstance(event, PromptTokens):
            seen["reused"], seen["prompt"] = event.reused, list(event.ids)
        elif isinstance(event, TokenSampled):
            seen["tokens"].append(event.id)
        elif isinstance(event, Notice):
            seen["notices"].append(event.message)
    return seen


def conversation(loaded, store, *questions) -> SavedChat:
    chat = SavedChat(ChatSession(loaded, GREEDY, system_prompt=SYSTEM), store)
    for question in questions:
        answer(chat.send(question))
    chat.save_cache()
    return chat


def test_a_damaged_file_is_rebuilt_by_prefill_and_the_answer_is_the_fresh_one(tiny_loaded, tmp_path):
    with Store(tmp_path) as store:
        live = conversation(tiny_loaded, store, "What is the capital of France?", "And Germany?")
        path = store.cache_path(live.conversation_id)
        keys = load_file(str(path))["layers.1.keys"]
        rewrite(path, {"layers.1.keys": torch.zeros_like(keys)})

        resumed = SavedChat(ChatSession(tiny_loaded, GREEDY), store)
        opened = answer(resumed.resume(live.conversation_id))
        assert any(n.startswith("saved KV cache ignored") and "checksum" in n for n in opened["notices"])
        assert len(resumed.session.cache) == 0
        fresh = SavedChat(ChatSession(tiny_loaded, GREEDY), store)
        answer(fresh.resume(live.conversation_id, use_cache=False))
        resumed.store = fresh.store = None  # the measured turns are not saved
        after = answer(resumed.send("How does inference work?"))
        expected = answer(fresh.send("How does inference work?"))
    assert after["reused"] == 0
    assert after["tokens"] == expected["tokens"]


def test_a_file_from_another_conversation_says_how_many_tokens_it_reuses(tiny_loaded, tmp_path):
    with Store(tmp_path) as store:
        mine = conversation(tiny_loaded, store, "What is the capital of France?", "And Germany?")
        theirs = conversation(tiny_loaded, store, "How does inference work?", "Prefill then decode?")
        shutil.copyfile(store.cache_path(theirs.conversation_id), store.cache_path(mine.conversation_id))

        resumed = SavedChat(ChatSession(tiny_loaded, GREEDY), store)
        notices = answer(resumed.resume(mine.conversation_id))["notices"]
        history = resumed.session.template(resumed.session.messages)
        matching = common_prefix(theirs.session.cache.ids, history)
        assert 0 < matching < len(theirs.session.cache) // 2  # the system prompt and a little more
        loaded = [n for n in notices if n.startswith("KV cache loaded")]
        assert len(loaded) == 1 and "no prefill needed" not in loaded[0]
        assert f"{matching} of its {len(theirs.session.cache)} tokens" in loaded[0]
        assert resumed.session.cache.ids == history[:matching]  # what does not match is dropped
        resumed.store = None
        assert answer(resumed.send("Thanks."))["reused"] == matching


def test_a_file_saved_before_the_last_turn_is_not_said_to_need_no_prefill(tiny_loaded, tmp_path):
    with Store(tmp_path) as store:
        chat = conversation(tiny_loaded, store, "What is the capital of France?")
        saved_ids = list(chat.session.cache.ids)
        answer(chat.send("And Germany?"))  # its cache is never saved (say the disk was full)

        resumed = SavedChat(ChatSession(tiny_loaded, GREEDY), store)
        notices = answer(resumed.resume(chat.conversation_id))["notices"]
        matching = common_prefix(saved_ids, resumed.session.template(resumed.session.messages))
        loaded = [n for n in notices if n.startswith("KV cache loaded")]
        assert len(loaded) == 1 and "no prefill needed" not in loaded[0], loaded
        assert f"{matching} of its {len(saved_ids)} tokens" in loaded[0]
        resumed.store = None
        assert answer(resumed.send("Thanks."))["reused"] == matching
