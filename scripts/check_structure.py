"""The structure's targets, checked: function sizes in engine/ and tui/, and no import cycle
between the project's modules (a late import inside a function counts: it hides a cycle, it
does not break one). ruff checks private access (SLF001) and complexity (C901) itself.

    python scripts/check_structure.py            # exit 1 and say why when a target is missed
    python scripts/check_structure.py --report   # the figures, whatever they are

A function's length is its lines from `def` to its last statement, docstring included, nested
functions counted in their parent and on their own.
"""

from __future__ import annotations

import argparse
import ast
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "tui", "themes")
LONGEST = 60
P90 = {"engine": 19, "tui": 16}
"""Issue 32's bar (the figures were 18 and 15 when it was set): never raise it."""
STILL_LONG: set[tuple[str, str]] = set()
"""Functions over LONGEST lines still to be split (each a debt, named here); the set may only shrink."""


def modules() -> dict[str, Path]:
    """Every module of the project's packages, by dotted name."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def function_lengths(path: Path) -> list[tuple[int, str, int]]:
    """(length, name, line) of each function in a file."""
    tree = ast.parse(path.read_text(), str(path))
    return [
        (node.end_lineno - node.lineno + 1, node.name, node.lineno)
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules `name` imports anywhere in its file (at the top or inside a function)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            submodules = {f"{base}.{a.name}" for a in node.names} & known
            out.update(submodules or {base})  # `from pkg import module` imports the module
    return {_owner(m, known) for m in out if _owner(m, known)} - {name}


def _owner(module: str, known: set[str]) -> str | None:
    """The project module a dotted import names (`engine.events.Event` -> `engine.events`)."""
    while module and module not in known:
        module = module.rpartition(".")[0]
    return module or None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _package_edges_only(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Drop the edges from a package's __init__ to its own modules: re-exporting them is no cycle."""
    return {m: {d for d in deps if not d.startswith(m + ".")} for m, deps in graph.items()}


def check(report: bool) -> list[str]:
    found = modules()
    problems = []
    for top, limit in P90.items():
        lengths = [
            f for name, path in found.items() if name.split(".")[0] == top for f in function_lengths(path)
        ]
        sizes = sorted(size for size, _, _ in lengths)
        p90 = sizes[int(0.9 * (len(sizes) - 1))]
        if report:
            median = statistics.median(sizes)
            print(f"{top}: {len(sizes)} functions, median {median:g}, p90 {p90}, max {sizes[-1]}")
        if p90 > limit:
            problems.append(f"{top}/: p90 function length {p90} lines (target ≤ {limit})")
        for name, path in found.items():
            if name.split(".")[0] != top:
                continue
            for size, function, line in function_lengths(path):
                if size > LONGEST and (str(path.relative_to(ROOT)), function) not in STILL_LONG:
                    problems.append(
                        f"{path.relative_to(ROOT)}:{line}: {function} is {size} lines (≤ {LONGEST})"
                    )
    graph = _package_edges_only({name: imports(name, path, set(found)) for name, path in found.items()})
    for component in cycles(graph):
        problems.append("import cycle: " + " <-> ".join(component))
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", action="store_true", help="print the figures, and every miss")
    args = parser.parse_args()
    problems = check(args.report)
    for problem in problems:
        print(problem)
    return 1 if problems and not args.report else 0


if __name__ == "__main__":
    sys.exit(main())
