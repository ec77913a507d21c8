"""engine/ never imports Textual or Rich: the headless CLI and the tests drive it directly."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
UI_PACKAGES = ("textual", "rich")

CHECK = """
import sys
{body}
ui = sorted(m for m in sys.modules if m.split(".")[0] in {ui!r})
print(",".join(ui))
"""


def run_python(body: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", CHECK.format(body=body, ui=UI_PACKAGES)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def engine_modules() -> list[str]:
    return sorted(
        ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for path in (ROOT / "engine").rglob("*.py")
        if path.name != "__init__.py"
    )


def test_engine_loads_no_ui_library(tiny_model_dir):
    """Neither importing every engine module nor loading a model and answering pulls in a UI library."""
    imports = "\n".join(f"import {name}" for name in engine_modules())
    body = f"""
{imports}
print(",".join(sorted(m for m in sys.modules if m.split(".")[0] in {UI_PACKAGES!r})))
from engine import models
from engine.sampling import SamplingSettings
from engine.session import ChatSession
loaded = models.load({str(tiny_model_dir)!r}, "fp32", "cpu")
for _ in ChatSession(loaded, SamplingSettings(temperature=0, max_new_tokens=3)).send("hello"):
    pass
"""
    after_import, after_turn = run_python(body).splitlines()
    assert after_import == "", f"importing engine loaded {after_import}"
    assert after_turn == "", f"answering loaded {after_turn}"


def test_engine_source_names_no_ui_library():
    for path in (ROOT / "engine").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name.split(".")[0] not in UI_PACKAGES, f"{path.name} imports {name}"
