"""A damaged saved decode step (engine/fast/steps.py `save`): compiled again, said in one line,
replaced; the answer is the eager path's."""

import torch

from engine import models
from engine.events import TokenSampled
from engine.fast import compiled, fused, steps
from engine.sampling import SamplingSettings
from engine.session import ChatSession


def _greedy(session: ChatSession) -> list[int]:
    return [e.id for e in session.send("How does inference work?") if isinstance(e, TokenSampled)]


def test_a_truncated_saved_step_is_compiled_again_and_replaced(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    # As a disk filled mid-write by something else, or a copy cut short, leaves it.
    monkeypatch.setattr(compiled, "_compile_in_a_subprocess", lambda *args: False)
    loaded = models.load(str(tiny_model_dir), "fp32", "cpu")
    fast = fused.for_model(loaded.model, compiled=True)
    damaged = [steps.saved_path(fast, torch.float32, kind) for kind in steps.KINDS]
    for path in damaged:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\x80\x05truncated")
    settings = SamplingSettings(temperature=0.0, max_new_tokens=8)
    session = ChatSession(loaded, settings, compile=True)
    assert session.compiled.wait_settled(600) and session.compiled.kind == "whole"
    note = session.compiled.describe()
    assert note.count("the saved decode step could not be loaded") == 1 and "\n" not in note, note
    assert _greedy(session) == _greedy(ChatSession(loaded, settings, compile=False))
    for kind, path in zip(steps.KINDS, damaged):  # replaced by the step compiled here
        assert steps.load(path).keys() == ({"step"} if kind == "whole" else {"block", "head"})


def test_code_replaced_under_a_running_app_does_not_change_which_step_it_loads(
    tiny_model_dir, tmp_path, monkeypatch
):
    # An upgrade while the app runs: its compile child imports the new code and saves a step of
    # it. The key was read from the files at each compile, so the app looked for the new step
    # and loaded code it does not run (a test run aborted so when a source changed mid-run).
    from pathlib import Path

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    fast = fused.for_model(models.load(str(tiny_model_dir), "fp32", "cpu").model, compiled=True)
    before = steps.saved_path(fast, torch.float32, "whole")
    monkeypatch.setattr(Path, "read_bytes", lambda self: b"// the sources as an upgrade left them")
    assert steps.saved_path(fast, torch.float32, "whole") == before
