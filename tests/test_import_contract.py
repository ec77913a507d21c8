"""The layers, as a contract: engine/ never imports tui/ (not even tui/fmt.py or tui/config.py,
which import no UI library and so slip past the Textual/Rich test), and tui/ reaches the engine
only through the modules named here; the rest of engine/ is its own business. Late imports
inside functions count. (No import cycle anywhere: scripts/check_structure.py, run by the tests.)"""

from __future__ import annotations

import re
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path

from scripts.check_structure import imports, modules

ROOT = Path(__file__).resolve().parents[1]

ENGINE_FRONT = (
    "engine",  # DEFAULT_MODEL, spelled where nothing imports torch
    "engine.events",  # what the UI hears
    "engine.sampling",  # the settings it sends
    "engine.model_sampling",  # `ask` answers with a model's own sampling defaults
    "engine.conversation",
    "engine.utf8",  # checks on text from outside before it is sent
    "engine.chat_templates",  # --chat-template: names, and a file checked before loading
    "engine.thinking",  # thought told from answer: a saved answer's parts, --thinking's check
    "engine.worker",  # the inference thread (tui/engine_link.py starts it)
    "engine.quant.precision",  # the precisions' records: choices, help, notes
    "engine.kvcache",  # the cache precisions
    "engine.kv_windows",  # what a sliding-window layer holds (F8's note)
    "engine.instruments.*",  # the teaching instruments' engine side, built for the UI
    "engine.lab.*",
    "engine.speculative.*",
    "engine.saved.*",  # conversations: list, export, resume
    "engine.remote.*",  # a server: its target, session and bench
    "engine.serving_metrics",  # the serving metric set's keys and flags (bench --server, lab)
    # The headless CLI (`ask`, `bench`) builds a session itself, without the worker:
    "engine.models",
    "engine.session",
    "engine.bench",
    "engine.fast.kernels",  # `ask` decodes with kernels the app built (load_built)
    "engine.fast.step_path",  # which step decoded, for `ask --json`
)


def project_imports() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(name, path, set(found)) for name, path in found.items()}


def test_engine_never_imports_the_ui():
    reach = {m: {d for d in deps if d.split(".")[0] == "tui"} for m, deps in project_imports().items()}
    assert {m: d for m, d in reach.items() if m.startswith("engine") and d} == {}


def test_the_ui_reaches_the_engine_only_through_its_front():
    outside = {
        (module, dep)
        for module, deps in project_imports().items()
        if module.startswith("tui")
        for dep in deps
        if dep.startswith("engine") and not any(fnmatch(dep, pattern) for pattern in ENGINE_FRONT)
    }
    assert outside == set(), "the UI imports engine internals; use or extend the front"


def test_the_structure_script_finds_no_cycle_and_no_overlong_function():
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "check_structure.py")], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_readme_layout_names_every_module():
    """README's Layout is the tree as it is: each module, kernel and theme of engine/, tui/ and
    themes/ is named there (a new file gets its line when it is added)."""
    block = (ROOT / "README.md").read_text().split("## Layout", 1)[1].split("```", 2)[1]
    files = [
        path
        for package in ("engine", "tui", "themes")
        for path in sorted((ROOT / package).rglob("*"))
        if path.suffix in (".py", ".cpp", ".h", ".tcss") and path.name != "__init__.py"
    ]
    missing = [
        str(p.relative_to(ROOT)) for p in files if not re.search(rf"(?<![\w/]){re.escape(p.name)}", block)
    ]
    assert missing == []
