import pytest

from tests.remote.llama_server import LlamaServer


@pytest.fixture(scope="session")
def llama_server(tmp_path_factory):
    """A real llama-server for the whole session, stopped at the end."""
    pytest.importorskip("xllamacpp", reason="the remote tests need a real llama.cpp server (xllamacpp)")
    server = LlamaServer(tmp_path_factory.mktemp("llama-server") / "server.log")
    yield server
    server.stop()


@pytest.fixture
def own_llama_server(tmp_path):
    """A llama-server of the test's own, which it may kill."""
    pytest.importorskip("xllamacpp", reason="the remote tests need a real llama.cpp server (xllamacpp)")
    server = LlamaServer(tmp_path / "server.log")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def two_slot_llama_server(tmp_path_factory):
    """A real llama-server with two slots (requests decoded side by side), stopped at the end."""
    pytest.importorskip("xllamacpp", reason="the remote tests need a real llama.cpp server (xllamacpp)")
    server = LlamaServer(tmp_path_factory.mktemp("llama-server-2") / "server.log", n_ctx=4096, parallel=2)
    yield server
    server.stop()
