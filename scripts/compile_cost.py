"""What compiling the decode step costs: the regional step against the whole one.

    .venv/bin/python scripts/compile_cost.py [--precision fp32] [--model SPEC] [--windows 5] [--json]

The app compiles one decoder block run for every layer first, then the whole step, both
without Dynamo's guards, ahead of time in a child process that saves them; the app loads what
it saved (engine/fast/steps.py). This measures, on the built-in model or --model:
- each step's compile in a fresh process: cold (an empty Inductor cache, as on a fresh machine:
  what the app's background child pays) and cached (Inductor's cache full, Dynamo tracing
  again: what the app paid in-process on every start before the steps were saved);
- loading the saved step in a fresh process, to its first token (what the app pays now);
- the app's own timeline, each in a fresh process: when the regional step is ready and when the
  whole one took over, from the session's start (background child, save, load) and from the
  model's load (where the app starts the child: --no-early starts it after the load), cold and
  cached, and the speed of an answer asked the moment the session starts, on a cached start:
  it decodes while the steps are made ready in the app's process;
- decode tok/s of the regional step, the whole step with guards (the app before this round)
  and without (the app once the whole step took over), in alternating windows of one process,
  so all three meet the same machine; best window each, and the ratios of the best.
Not part of CI.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("regional", "whole", "whole-no-guards")
MODEL = "smollm2-135m"
"""The model measured (--model: any spec the app takes; a child is told the same)."""
QUESTION = "Tell me about the history of Paris."
EARLY = True
"""The app's timeline with the step's compile started as the model loads, as the app does (the
hidden --no-early: after the load, as before)."""


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _model(precision: str):
    """The model's fast path, the attention kernel loaded, and its cache dtype."""
    import torch

    from engine import models
    from engine.fast import fused, kernels

    loaded = models.load(MODEL, precision, "cpu", chat=False)
    fast = fused.for_model(loaded.model, compiled=True)
    kernels.load("step")
    return fast, getattr(torch, loaded.info.cache_dtype)


def _steps(precision: str, variants: tuple[str, ...]):
    """Load the model once; a compiled step and its own cache buffers for each variant."""
    import torch

    from engine.fast import steps

    fast, cache_dtype = _model(precision)
    made = {}
    for variant in variants:
        if variant == "whole":  # with Dynamo's guards, compiled by its first call, as before round two
            step = torch.compile(steps.whole_step, dynamic=False, fullgraph=True)
        else:
            kind = "regional" if variant == "regional" else "whole"
            step = steps.assemble(kind, steps.compile_here(kind, fast, cache_dtype))
        made[variant] = (step, *steps.scratch_buffers(fast, cache_dtype, capacity=4096))
    return fast, made


def compile_time(precision: str, kind: str) -> dict:
    """In this process: load the model, compile the step of `kind` (timed), save it."""
    from engine.fast import steps

    fast, cache_dtype = _model(precision)
    started = time.perf_counter()
    parts = steps.compile_here(kind, fast, cache_dtype)
    compile_s = time.perf_counter() - started
    steps.save(parts, steps.saved_path(fast, cache_dtype, kind))
    return {"kind": kind, "compile_s": round(compile_s, 2)}


def load_time(precision: str, kind: str) -> dict:
    """In this process: load the model, then the saved step of `kind` and its first call, timed."""
    import torch

    from engine.fast import steps

    fast, cache_dtype = _model(precision)
    buffers = steps.scratch_buffers(fast, cache_dtype)
    started = time.perf_counter()
    step = steps.assemble(kind, steps.load(steps.saved_path(fast, cache_dtype, kind)))
    with torch.inference_mode():
        step(fast, torch.tensor([0]), torch.tensor([0]), steps.no_offsets(fast), *buffers)
    return {"kind": kind, "load_s": round(time.perf_counter() - started, 2)}


def app_ready(precision: str) -> dict:
    """In this process, as the app does it: a session, then its background build's timeline;
    and the speed of an answer asked at once, while the steps are made ready."""
    from engine import models
    from engine.events import TokenSampled
    from engine.fast.compiled import start_early
    from engine.quant.precision import precision_for
    from engine.sampling import SamplingSettings
    from engine.session import ChatSession

    load_started = time.monotonic()
    if EARLY:  # as the app's worker does: the step's compile child starts as the model loads
        start_early(MODEL, precision, precision_for(precision, "cpu").cache_dtype)
    loaded = models.load(MODEL, precision, "cpu", chat=False)
    base = not getattr(loaded.tokenizer, "chat_template", None)  # a base model continues the text
    session = ChatSession(
        loaded, SamplingSettings(temperature=0.0, max_new_tokens=64), compile=True, raw=base
    )
    build = session.compiled
    asked = time.perf_counter()
    tokens = sum(isinstance(event, TokenSampled) for event in session.send(QUESTION))
    answer_s = time.perf_counter() - asked
    build.ready.wait(900)
    ready = build.compile_s
    build.wait_settled(900)
    return {
        "regional": round(ready, 1),
        "regional_from_load": round(build.started + ready - load_started, 1),
        "whole": round(build.whole_s, 1),
        "kind": build.kind,
        "answer_tok_s": round(tokens / answer_s, 1),
        "answer_tokens": tokens,
    }


def decode_speeds(precision: str, windows: int, tokens: int = 48) -> dict:
    import torch

    from engine.fast import steps

    fast, made = _steps(precision, VARIANTS)
    offsets = steps.no_offsets(fast)  # scratch buffers hold every position from 0
    best = dict.fromkeys(VARIANTS, 0.0)
    with torch.inference_mode():
        firsts = {}
        for variant, (step, keys, values) in made.items():
            ids = [1]
            for position in range(8):  # compiles; and the same greedy tokens from each
                logits = step(fast, torch.tensor([ids[-1]]), torch.tensor([position]), offsets, keys, values)
                ids.append(int(logits.argmax()))
            firsts[variant] = ids
        if len({tuple(ids) for ids in firsts.values()}) != 1:
            raise SystemExit(f"the variants disagree: {firsts}")
        position = 8
        for _ in range(windows):
            for variant, (step, keys, values) in made.items():
                started = time.perf_counter()
                for p in range(position, position + tokens):
                    step(fast, torch.tensor([1]), torch.tensor([p]), offsets, keys, values)
                best[variant] = max(best[variant], tokens / (time.perf_counter() - started))
            position += tokens
    return {variant: round(speed, 1) for variant, speed in best.items()}


def _in_a_fresh_process(args: list[str], cache_dir: str) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, __file__, *args, "--model", MODEL],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        check=False,
    )
    if done.returncode:
        raise SystemExit(f"{' '.join(args)} failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    global MODEL, EARLY
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--model", default=MODEL, help="a model spec: alias, HF directory, .gguf")
    parser.add_argument("--windows", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--kind", choices=("regional", "whole"), help=argparse.SUPPRESS)
    parser.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)  # a child's compile
    parser.add_argument("--load", action="store_true", help=argparse.SUPPRESS)  # a child's load
    parser.add_argument("--speeds", action="store_true", help=argparse.SUPPRESS)  # a child's decode
    parser.add_argument("--app", action="store_true", help=argparse.SUPPRESS)  # a child's session
    parser.add_argument("--no-early", action="store_true", help=argparse.SUPPRESS)  # compile after the load
    args = parser.parse_args()
    MODEL, EARLY = args.model, not args.no_early
    if args.compile or args.load:
        print(json.dumps((compile_time if args.compile else load_time)(args.precision, args.kind)))
        return
    if args.app:
        print(json.dumps(app_ready(args.precision)))
        return
    if args.speeds:
        print(json.dumps(decode_speeds(args.precision, args.windows)))
        return
    result: dict = {"model": MODEL, "precision": args.precision, "cpus": os.cpu_count(), "compile_s": {}}
    with tempfile.TemporaryDirectory(prefix="llmchat-inductor-") as scratch:
        for kind in ("regional", "whole"):
            cache = os.path.join(scratch, kind)  # each its own: no kernel shared between them
            say(f"[{kind}] compiling with an empty Inductor cache, then again from it, then loading it")
            one = ["--precision", args.precision, "--kind", kind]
            cold = _in_a_fresh_process(["--compile", *one], cache)
            cached = _in_a_fresh_process(["--compile", *one], cache)
            saved = _in_a_fresh_process(["--load", *one], cache)
            result["compile_s"][kind] = {
                "cold": cold["compile_s"],
                "cached": cached["compile_s"],
                "load": saved["load_s"],
            }
        say("the app's timeline: a session's background build, with an empty cache, then again")
        app = os.path.join(scratch, "app")
        session = ["--app", "--precision", args.precision, *([] if EARLY else ["--no-early"])]
        result["app_ready_s"] = {run: _in_a_fresh_process(session, app) for run in ("cold", "cached")}
        say(f"decode tok/s: {args.windows} alternating windows of the three steps in one process")
        speeds = ["--speeds", "--precision", args.precision, "--windows", str(args.windows)]
        result["decode_tok_s"] = _in_a_fresh_process(speeds, os.path.join(scratch, "whole"))
    decode = result["decode_tok_s"]
    result["regional_vs_whole"] = round(decode["regional"] / decode["whole"], 3)
    result["regional_vs_whole_no_guards"] = round(decode["regional"] / decode["whole-no-guards"], 3)
    if args.json:
        print(json.dumps(result))
        return
    print(f"{MODEL} {args.precision}, {result['cpus']} CPUs")
    for variant, times in result["compile_s"].items():
        print(
            f"  compile {variant:>8}: {times['cold']:6.1f} s cold, {times['cached']:5.1f} s from "
            f"Inductor's cache; the saved step loaded in {times['load']:4.2f} s"
        )
    for run, ready in result["app_ready_s"].items():
        print(
            f"  app, {run:>6}: regional step ready after {ready['regional']:5.1f} s "
            f"({ready['regional_from_load']:4.1f} s from the model's load), whole after "
            f"{ready['whole']:5.1f} s; an answer asked at once: {ready['answer_tok_s']:5.1f} tok/s"
        )
    for variant, speed in decode.items():
        print(f"  decode {variant:>16}: {speed:6.1f} tok/s")
    print(
        f"  regional / whole {result['regional_vs_whole']:.2f}x, "
        f"/ whole without guards {result['regional_vs_whole_no_guards']:.2f}x"
    )


if __name__ == "__main__":
    main()
