"""Decode speed inside the app against `llmchat ask`, on the same prompt, greedy.

The app runs headless (Textual's Pilot, 160x45, every panel live) with the real engine;
`llmchat ask --json` is the baseline. Each run is a fresh process and the two alternate,
so a busy machine slows both alike; the medians and their ratio are printed.

    .venv/bin/python scripts/tui_speed.py --rounds 3 --tokens 128
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Write a long story about a dragon who learns to bake bread."


def ask_once(args: argparse.Namespace) -> dict:
    """One `llmchat ask` run; its turn event carries decode tok/s."""
    command = [
        sys.executable,
        "-m",
        "tui.cli",
        "ask",
        args.prompt,
        "-t",
        "0",
        "-n",
        str(args.tokens),
        "--json",
        "-p",
        args.precision,
        "--device",
        args.device,
    ]
    help_text = subprocess.run(
        [sys.executable, "-m", "tui.cli", "ask", "--help"], capture_output=True, text=True, cwd=ROOT
    ).stdout
    if "--no-save" in help_text:
        command.append("--no-save")  # keep the benchmark out of the saved conversations
    out = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, check=True).stdout
    turn = next(json.loads(line) for line in out.splitlines() if '"event": "turn"' in line)
    return {
        "decode_tok_s": turn["decode_tok_s"],
        "itl_p50_ms": turn["itl_ms_p50"],
        "tokens": turn["generated_tokens"],
    }


def app_once(args: argparse.Namespace) -> dict:
    command = [
        sys.executable,
        __file__,
        "--side",
        "app",
        "--prompt",
        args.prompt,
        "--tokens",
        str(args.tokens),
        "--precision",
        args.precision,
        "--device",
        args.device,
    ]
    run = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if run.returncode:
        sys.exit(f"the app run failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def app_side(args: argparse.Namespace) -> None:
    """In this process: drive the app with Pilot and print the finished turn's stats as JSON."""
    sys.path.insert(0, str(ROOT))
    os.environ["LLMCHAT_CONFIG_DIR"] = tempfile.mkdtemp()
    os.environ["LLMCHAT_DATA_DIR"] = tempfile.mkdtemp()  # keep the benchmark out of the saved conversations
    from engine.events import TurnFinished
    from tui.app import make_app
    from tui.engine_link import inference_worker
    from tui.options import AppOptions

    finished: list[TurnFinished] = []
    ui_share: list[float] = []

    def factory(emit, sampling, system, context):
        def watching(event) -> None:
            if isinstance(event, TurnFinished):
                finished.append(event)
            emit(event)

        return inference_worker(watching, sampling, system, context)

    options = AppOptions(
        precision=args.precision,
        device=args.device,
        sampling={"temperature": 0, "max_new_tokens": args.tokens},
    )

    async def drive() -> None:
        app = make_app(options, factory)
        async with app.run_test(size=(160, 45)) as pilot:
            # Poll with plain sleeps: pilot.pause() makes the app process a round of messages each time.
            while not app.turns.ready:
                await asyncio.sleep(0.1)
            await pilot.press(*args.prompt)
            cpu, wall = time.thread_time(), time.perf_counter()
            await pilot.press("enter")
            while not finished:
                await asyncio.sleep(0.1)
            ui_share.append((time.thread_time() - cpu) / (time.perf_counter() - wall))

    asyncio.run(drive())
    stats = finished[0].stats
    print(
        json.dumps(
            {
                "decode_tok_s": round(stats.decode_tok_s, 2),
                "itl_p50_ms": round(stats.itl_p50_s * 1000, 3),
                "tokens": stats.generated_tokens,
                "ui_cpu_share": round(ui_share[0], 3),
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--side", choices=["compare", "app"], default="compare", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side == "app":
        app_side(args)
        return
    asks, apps = [], []
    for round_ in range(1, args.rounds + 1):
        asks.append(ask_once(args))
        apps.append(app_once(args))
        print(
            f"round {round_}: ask {asks[-1]['decode_tok_s']:.1f} tok/s, "
            f"app {apps[-1]['decode_tok_s']:.1f} tok/s "
            f"({apps[-1]['tokens']} tokens; the UI thread used {apps[-1]['ui_cpu_share']:.0%} of a core)",
            flush=True,
        )
    ask_median = statistics.median(r["decode_tok_s"] for r in asks)
    app_median = statistics.median(r["decode_tok_s"] for r in apps)
    # The median ITL shrugs off the bursts other processes cause on a shared machine.
    ask_itl = statistics.median(r["itl_p50_ms"] for r in asks)
    app_itl = statistics.median(r["itl_p50_ms"] for r in apps)
    print(
        f"median decode: ask {ask_median:.1f} tok/s, app {app_median:.1f} tok/s, "
        f"ratio app/ask {app_median / ask_median:.3f}"
    )
    print(
        f"median ITL: ask {ask_itl:.1f} ms, app {app_itl:.1f} ms, speed ratio app/ask {ask_itl / app_itl:.3f}"
    )


if __name__ == "__main__":
    main()
