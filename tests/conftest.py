import pytest

from tests.tiny import build_tiny_model


@pytest.fixture(autouse=True)
def _private_data_dir(tmp_path_factory, monkeypatch):
    """Saved conversations go to a temporary directory, never the user's (tests may set their own)."""
    monkeypatch.setenv("LLMCHAT_DATA_DIR", str(tmp_path_factory.mktemp("llmchat-data")))
    # The app compiles its decode step in the background; tests that want that ask for it.
    monkeypatch.setenv("LLMCHAT_COMPILE", "0")
    yield
    # A test beside busy processes leaves torch on the threads a governor lowered it to
    # (engine/threads.py): the next test starts on the cores as configured.
    from engine import threads

    threads.restore()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """An HF directory holding a tiny random Llama and its tokenizer."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_dir):
    from engine import models

    return models.load(str(tiny_model_dir), "fp32", "cpu")


@pytest.fixture(scope="session")
def smollm2():
    """The real default model (SmolLM2-135M-Instruct), loaded once per test run."""
    from engine import models

    return models.load(models.DEFAULT_MODEL, "fp32", "cpu")


COMPILE_MODULES = {
    "test_compiled.py",
    "test_decode_step.py",
    "test_graphed.py",
    "test_matvec.py",
    "test_compile_stuck.py",
    "test_saved_step.py",
    "test_build_group.py",
}
"""Modules whose tests compile a decode step or build the C++ kernels (fresh processes, minutes)."""
SERVER_FIXTURES = {"llama_server", "own_llama_server", "two_slot_llama_server"}


def pytest_collection_modifyitems(items):
    """Mark the slow kinds by what they use, so `-m "not compile and not server"` leaves them out:
    `server` (a real llama.cpp server), `compile` (a compiled step or a kernel build)."""
    for item in items:
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.server)
        if item.path.name in COMPILE_MODULES or "kernel_sources_compile" in item.name:
            item.add_marker(pytest.mark.compile)
