"""How long `llmchat ask` takes from a newcomer's chair: to the answer's first byte, and in all.

    .venv/bin/python scripts/ask_time.py [--runs 5] [--llmchat PATH] [-- extra ask options]
    .venv/bin/python scripts/ask_time.py --stages [--runs 3]
    .venv/bin/python scripts/ask_time.py --app-load MODEL [--runs 3]

Each run is a fresh process (caches warm: the model converted, the Python files compiled), as a
person typing the command meets it. The first byte is read from the command's stdout as it
arrives, so it includes the imports, the load, the prefill and the first token's decode.
`--stages` splits that time: a fresh process takes `ask`'s steps one at a time (fp32, the
built-in model) and stamps each; the interpreter's own start is what the parent saw before
the child's first stamp. `--app-load` times the app's own load of MODEL instead (fp32 on the CPU,
through transformers, as the worker loads it), imports included, in fresh processes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

QUESTION = "What is the capital of France?"


def one_run(command: list[str]) -> tuple[float, float]:
    """(seconds to the first byte on stdout, seconds until the process ended)."""
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    first = process.stdout.read(1)
    first_byte = time.perf_counter() - started
    process.stdout.read()
    process.wait()
    if process.returncode != 0 or not first:
        raise SystemExit(f"{' '.join(command)} failed (exit {process.returncode})")
    return first_byte, time.perf_counter() - started


def stages_child(started_ns: int) -> None:
    """In a fresh process: `ask`'s steps one at a time, each stamped; JSON on stdout."""
    stamps = [("interpreter", (time.time_ns() - started_ns) / 1e9)]
    mark = time.perf_counter()

    def stamp(stage: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        stamps.append((stage, now - mark))
        mark = now

    import typer  # noqa: F401

    import tui.cli.main  # noqa: F401

    stamp("typer + the command line")
    import torch  # noqa: F401

    stamp("import torch")
    from engine import DEFAULT_MODEL, models
    from engine.events import TokenSampled
    from engine.saved.chat import SavedChat  # noqa: F401
    from engine.session import ChatSession

    stamp("engine imports")
    steps = {"loading tokenizer": "model found", "loading weights": "tokenizer", "ready": "weights"}

    def progress(stage: str, fraction: float) -> None:
        for prefix, name in steps.items():
            if stage.startswith(prefix):
                stamp(name)

    loaded = models.load(DEFAULT_MODEL, "fp32", "cpu", progress=progress, fast_only=True)
    session = ChatSession(loaded)
    stamp("fast path built")
    for event in session.send(QUESTION):
        if isinstance(event, TokenSampled):
            stamp("first token (prefill)")
            session.cancel.set()
    print(json.dumps(stamps))


def stages(runs: int) -> None:
    table: dict[str, list[float]] = {}
    for _ in range(runs + 1):  # the first unmeasured, as above
        started_ns = time.time_ns()
        out = subprocess.run(
            [sys.executable, __file__, "--stages-child", str(started_ns)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for stage, seconds in json.loads(out.splitlines()[-1]):
            table.setdefault(stage, []).append(seconds)
    total = 0.0
    for stage, seconds in table.items():
        median = statistics.median(seconds[1:])
        total += median
        print(f"{stage:28} {median:5.2f} s")
    print(f"{'to the first token':28} {total:5.2f} s")


def app_load_child(model: str) -> None:
    """In a fresh process: the app's load of `model`, imports included; JSON on stdout."""
    started = time.perf_counter()
    from engine import models

    loaded = models.load(model, "fp32", "cpu", chat=False)
    print(json.dumps([time.perf_counter() - started, type(loaded.tokenizer).__name__]))


def app_load(model: str, runs: int) -> None:
    seconds = []
    for _ in range(runs + 1):  # the first unmeasured, as above
        command = [sys.executable, __file__, "--app-load-child", model]
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        took, tokenizer = json.loads(out.splitlines()[-1])
        seconds.append(took)
    taken = seconds[1:]
    print(f"app's load of {model} (tokenizer: {tokenizer})")
    print(f"median {statistics.median(taken):.2f} s (min {min(taken):.2f}, max {max(taken):.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument(
        "--llmchat", default=shutil.which("llmchat") or os.path.join(sys.prefix, "bin", "llmchat")
    )
    parser.add_argument("--stages", action="store_true", help="where the time goes, stage by stage")
    parser.add_argument("--stages-child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--app-load", metavar="MODEL", help="the app's load of MODEL, imports included")
    parser.add_argument("--app-load-child", help=argparse.SUPPRESS)
    parser.add_argument("extra", nargs="*", help="more `ask` options, after --")
    args = parser.parse_args()
    if args.stages_child:
        return stages_child(args.stages_child)
    if args.stages:
        return stages(args.runs)
    if args.app_load_child:
        return app_load_child(args.app_load_child)
    if args.app_load:
        return app_load(args.app_load, args.runs)
    command = [args.llmchat, "ask", "--no-save", "-t", "0", "--max-new-tokens", "8", *args.extra, QUESTION]
    one_run(command)  # unmeasured: the first start converts the model and compiles the .pyc files
    runs = [one_run(command) for _ in range(args.runs)]
    firsts, walls = zip(*runs)
    print(" ".join(command))
    print(
        f"first byte: median {statistics.median(firsts):.2f} s (min {min(firsts):.2f}, max {max(firsts):.2f})"
    )
    print(f"wall:       median {statistics.median(walls):.2f} s (min {min(walls):.2f}, max {max(walls):.2f})")


if __name__ == "__main__":
    main()
