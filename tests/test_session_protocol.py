"""Both kinds of session offer the one `Session` interface and declare what they can do; the UI
reads the same declaration from the ModelInfo a ModelReady brings."""

from __future__ import annotations

import dataclasses

import pytest

from engine.capabilities import LOCAL, ON_SERVER
from engine.events import ModelInfo, ServerInfo
from engine.remote.session import RemoteSession
from engine.session import ChatSession
from engine.session_protocol import Session

METHODS = [name for name, member in vars(Session).items() if not name.startswith("_") and callable(member)]
"""The protocol's calls (its data, `info` and `messages` among them, is set on each instance)."""


@pytest.mark.parametrize("kind", [ChatSession, RemoteSession])
def test_each_kind_has_every_call_of_the_protocol(kind):
    assert METHODS, "the protocol names its calls"
    assert [name for name in METHODS if not hasattr(kind, name)] == []


def test_each_kind_declares_its_capabilities():
    assert ChatSession.capabilities is LOCAL
    assert RemoteSession.capabilities is ON_SERVER
    assert LOCAL.has_weights and not LOCAL.on_server
    assert ON_SERVER.on_server
    assert not any(dataclasses.astuple(ON_SERVER))  # a server does none of what needs the weights


def test_model_info_carries_the_capabilities_of_its_kind():
    info = ModelInfo("m", "m", "fp32", "cpu", "fp32", "fp32", *[None] * 10, load_s=0.0)
    assert info.capabilities is LOCAL
    on_server = dataclasses.replace(info, server=ServerInfo("http://h:1", "llama.cpp", None, "m"))
    assert on_server.capabilities is ON_SERVER
