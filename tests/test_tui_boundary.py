"""tui/ never imports torch or transformers itself: what runs the model lives in engine/.

The app reaches the engine through tui/engine_link.py (the `Engine` protocol and the
`SessionView` of its session); screens get the engine's results, never its tensors.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL_PACKAGES = ("torch", "transformers")
ALLOWED = {ROOT / "tui" / "engine_link.py"}


def imported_names(path: Path) -> list[str]:
    """Every absolute module name `path` imports, at any depth (also under TYPE_CHECKING)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.append(node.module or "")
    return names


def test_tui_source_imports_no_model_library():
    offenders = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted((ROOT / "tui").rglob("*.py"))
        if path not in ALLOWED
        for name in imported_names(path)
        if name.split(".")[0] in MODEL_PACKAGES
    ]
    assert offenders == []


def protocol_members(protocol: type) -> list[str]:
    """The calls and properties a protocol declares itself."""
    return sorted(name for name in vars(protocol) if not name.startswith("_"))


def test_the_worker_and_the_fake_answer_every_engine_call():
    from engine.worker import InferenceWorker
    from tests.tui_fakes import FakeEngine
    from tui.engine_link import Engine

    engines = [InferenceWorker(lambda event: None), FakeEngine(lambda event: None, None)]
    try:
        for engine in engines:
            missing = [name for name in protocol_members(Engine) if not hasattr(engine, name)]
            assert missing == [], f"{type(engine).__name__} lacks {missing}"
    finally:
        for engine in engines:
            engine.shutdown()


def test_a_chat_session_has_every_attribute_of_its_view(tiny_loaded):
    from engine.instruments.view import SessionView
    from engine.session import ChatSession

    session = ChatSession(tiny_loaded)
    assert protocol_members(SessionView) == [
        "capabilities",
        "info",
        "loaded",
        "messages",
        "namer",
        "prompt_format",
        "sampled_ids",
        "sampling",
        "step_gate",
        "stop_ids",
        "system_prompt",
        "tokenizer",
        "trace",
    ]
    assert [name for name in protocol_members(SessionView) if not hasattr(session, name)] == []
